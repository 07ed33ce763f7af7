// ReleaseMappedPages gives a file mapping's pages back and keeps what any other memory holds: the
// weight loader calls it on every tensor it copied, and a loader that hands it heap memory (a
// converted tensor, a test's buffer) must not find zeros there afterwards.
#include "common/mapped_file.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <vector>

#include "tests/test_util.h"

namespace kvshard {
namespace {

uint8_t Pattern(size_t i) { return static_cast<uint8_t>(i * 131 + (i >> 12)); }

TEST(ReleaseMappedPages, KeepsWhatHeapMemoryHolds) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<uint8_t> heap(page * 16);
    for (size_t i = 0; i < heap.size(); ++i) heap[i] = Pattern(i);
    // An unaligned range in the middle: rounded out, it covers whole pages of the buffer.
    ReleaseMappedPages(heap.data() + page + 100, page * 10);
    for (size_t i = 0; i < heap.size(); ++i) ASSERT_EQ(heap[i], Pattern(i)) << "byte " << i;
}

TEST(ReleaseMappedPages, KeepsWhatAnAnonymousMappingHolds) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    const size_t bytes = page * 8;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(p, MAP_FAILED);
    auto* data = static_cast<uint8_t*>(p);
    for (size_t i = 0; i < bytes; ++i) data[i] = Pattern(i);
    ReleaseMappedPages(data, bytes);
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(data[i], Pattern(i)) << "byte " << i;
    ::munmap(p, bytes);
}

TEST(ReleaseMappedPages, AFileMappingReadsTheSameBytesAfterItsPagesWentBack) {
    testing::TempDir dir;
    const std::string path = dir.File("weights.bin");
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<uint8_t> bytes(page * 32 + 77);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = Pattern(i);
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<long>(bytes.size()));
    Result<MappedFile> file = MappedFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    uint64_t sum = 0;
    for (size_t i = 0; i < file->size(); ++i) sum += file->data()[i];  // all resident now
    EXPECT_GT(sum, 0u);
    ReleaseMappedPages(file->data() + 10, file->size() - 20);
    ASSERT_EQ(file->size(), bytes.size());
    for (size_t i = 0; i < bytes.size(); ++i) ASSERT_EQ(file->data()[i], bytes[i]) << "byte " << i;
}

}  // namespace
}  // namespace kvshard
