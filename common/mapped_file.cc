#include "common/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

namespace kvshard {
namespace {

// The live read-only mappings of MappedFile, begin -> size: ReleaseMappedPages drops the pages of
// a range inside one of them with MADV_DONTNEED, which always unmaps them (see there).
std::mutex g_mappings_mutex;
std::map<uintptr_t, size_t> g_mappings;  // guarded by g_mappings_mutex

void AddMapping(const uint8_t* data, size_t size) {
    std::lock_guard<std::mutex> lock(g_mappings_mutex);
    g_mappings[reinterpret_cast<uintptr_t>(data)] = size;
}

void RemoveMapping(const uint8_t* data) {
    std::lock_guard<std::mutex> lock(g_mappings_mutex);
    g_mappings.erase(reinterpret_cast<uintptr_t>(data));
}

// Whether [begin, end) lies inside one MappedFile's mapping (its pages, rounded out).
bool InsideAMapping(uintptr_t begin, uintptr_t end, uintptr_t page) {
    std::lock_guard<std::mutex> lock(g_mappings_mutex);
    auto it = g_mappings.upper_bound(begin);
    if (it == g_mappings.begin()) return false;
    --it;
    const uintptr_t map_end = (it->first + it->second + page - 1) / page * page;
    return begin >= it->first && end <= map_end;
}

}  // namespace

Result<MappedFile> MappedFile::Open(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return NotFound(path + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        return NotFound(path + ": not a regular file");
    }
    MappedFile file;
    file.path_ = path;
    file.size_ = static_cast<size_t>(st.st_size);
    if (file.size_ > 0) {
        void* p = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int err = errno;
            ::close(fd);
            return Internal(path + ": mmap failed: " + std::strerror(err));
        }
        file.data_ = static_cast<const uint8_t*>(p);
        AddMapping(file.data_, file.size_);
    }
    ::close(fd);
    return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept { *this = std::move(other); }

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
    if (this != &other) {
        if (data_ != nullptr) {
            RemoveMapping(data_);
            ::munmap(const_cast<uint8_t*>(data_), size_);
        }
        path_ = std::move(other.path_);
        data_ = std::exchange(other.data_, nullptr);
        size_ = std::exchange(other.size_, 0);
    }
    return *this;
}

MappedFile::~MappedFile() {
    if (data_ != nullptr) {
        RemoveMapping(data_);
        ::munmap(const_cast<uint8_t*>(data_), size_);
    }
}

Result<std::string> ReadFileToString(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return NotFound(path + ": cannot open: " + std::strerror(errno));
    std::ostringstream ss;
    ss << in.rdbuf();
    if (in.bad()) return DataLoss(path + ": read error");
    return ss.str();
}

void ReleaseMappedPages(const void* data, size_t bytes) {
    if (data == nullptr || bytes == 0) return;
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<uintptr_t>(data) / page * page;
    const auto end = (reinterpret_cast<uintptr_t>(data) + bytes + page - 1) / page * page;
    // MADV_PAGEOUT, not MADV_DONTNEED: on the clean pages of a read-only file mapping both give
    // the pages back (they are read from the file again if touched), but on any other memory
    // DONTNEED discards what the pages hold (anonymous pages come back as zeros), while PAGEOUT
    // only moves them to swap, or leaves them where there is none. The range is rounded out to
    // whole pages, which may take in a neighbour's bytes: so it must be harmless on any memory.
    // Kernels before 5.4 refuse PAGEOUT (EINVAL): the pages then simply stay.
    // But PAGEOUT passes over every page that another process maps too, and a model file is
    // often mapped by several (a server and a benchmark, engineers sharing a machine): the whole
    // file then stayed resident (96 MB of the default model). Inside a MappedFile's mapping,
    // which is read-only and private so its pages are never anything but the file's, DONTNEED
    // is safe and always unmaps them from this process.
    const bool file_pages = InsideAMapping(begin, end, page);
    ::madvise(reinterpret_cast<void*>(begin), end - begin,
              file_pages ? MADV_DONTNEED : MADV_PAGEOUT);
}

}  // namespace kvshard
