#include "common/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

namespace kvshard {

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
    }
    ::close(fd);
    return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept { *this = std::move(other); }

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
    if (this != &other) {
        if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
        path_ = std::move(other.path_);
        data_ = std::exchange(other.data_, nullptr);
        size_ = std::exchange(other.size_, 0);
    }
    return *this;
}

MappedFile::~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
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
    ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_PAGEOUT);
}

}  // namespace kvshard
