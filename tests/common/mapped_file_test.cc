// ReleaseMappedPages gives a file mapping's pages back and keeps what any other memory holds: the
// weight loader calls it on every tensor it copied, and a loader that hands it heap memory (a
// converted tensor, a test's buffer) must not find zeros there afterwards.
#include "common/mapped_file.h"

#include <fcntl.h>
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

// Pages of this process's mapping at `data` resident now, from /proc/self/pagemap's present bit.
size_t ResidentPages(const uint8_t* data, size_t bytes) {
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t first = reinterpret_cast<uintptr_t>(data) / page;
    const size_t n = (bytes + page - 1) / page;
    std::vector<uint64_t> entries(n);
    const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    const ssize_t got = ::pread(fd, entries.data(), n * sizeof(uint64_t),
                                static_cast<off_t>(first * sizeof(uint64_t)));
    ::close(fd);
    if (got != static_cast<ssize_t>(n * sizeof(uint64_t))) return 0;
    size_t present = 0;
    for (uint64_t e : entries) present += (e >> 63) & 1;
    return present;
}

TEST(ReleaseMappedPages, AFileMappingsPagesLeaveEvenWhileAnotherMappingHoldsThem) {
    // A second mapping of the file stands for another process mapping the model (a server and
    // a benchmark): MADV_PAGEOUT passes over pages mapped twice, so the file's pages stayed.
    testing::TempDir dir;
    const std::string path = dir.File("weights.bin");
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    std::vector<uint8_t> bytes(page * 64);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = Pattern(i);
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<long>(bytes.size()));
    Result<MappedFile> file = MappedFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    Result<MappedFile> other = MappedFile::Open(path);
    ASSERT_TRUE(other.ok()) << other.status().ToString();
    uint64_t sum = 0;
    for (size_t i = 0; i < bytes.size(); ++i) sum += file->data()[i] + other->data()[i];
    EXPECT_GT(sum, 0u);
    ASSERT_EQ(ResidentPages(file->data(), bytes.size()), 64u);
    ReleaseMappedPages(file->data(), bytes.size());
    EXPECT_EQ(ResidentPages(file->data(), bytes.size()), 0u);
    EXPECT_EQ(ResidentPages(other->data(), bytes.size()), 64u);  // its own pages stay
    for (size_t i = 0; i < bytes.size(); ++i) ASSERT_EQ(file->data()[i], bytes[i]) << "byte " << i;
}

}  // namespace
}  // namespace kvshard
