// The shared-memory staging region of the TCP KV transport (comm/shm_region.h).
#include "comm/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <utility>

namespace kvshard::internal {

namespace {

constexpr char kNamePrefix[] = "/kvshard-kv-";

std::string Errno(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

std::string RandomName() {
    static std::atomic<uint64_t> counter{0};
    std::random_device device;
    const uint64_t salt = (uint64_t{device()} << 32) ^ device();
    char buffer[kMaxKvShmNameBytes + 1];
    std::snprintf(buffer, sizeof(buffer), "%s%x-%llx-%016llx", kNamePrefix,
                  static_cast<unsigned>(::getpid()),
                  static_cast<unsigned long long>(counter.fetch_add(1)),
                  static_cast<unsigned long long>(salt));
    return buffer;
}

}  // namespace

const std::string& KvHostBootId() {
    static const std::string id = [] {
        std::ifstream in("/proc/sys/kernel/random/boot_id");
        std::string line;
        std::getline(in, line);
        return line.size() == 36 ? line : std::string();
    }();
    return id;
}

bool IsKvShmName(const std::string& name) {
    const size_t prefix = sizeof(kNamePrefix) - 1;
    if (name.size() <= prefix || name.size() > kMaxKvShmNameBytes) return false;
    if (name.compare(0, prefix, kNamePrefix) != 0) return false;
    for (size_t i = prefix; i < name.size(); ++i) {
        const char c = name[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == '-')) return false;
    }
    return true;
}

// ---- sender ----

Result<KvShmSenderRegion> KvShmSenderRegion::Create(int64_t bytes) {
    if (bytes < kMinKvShmRegionBytes || bytes > kMaxKvShmRegionBytes) {
        return InvalidArgument("shared-memory region of " + std::to_string(bytes) +
                               " bytes outside [" + std::to_string(kMinKvShmRegionBytes) + ", " +
                               std::to_string(kMaxKvShmRegionBytes) + "]");
    }
    KvShmSenderRegion region;
    region.name_ = RandomName();
    region.fd_ = ::shm_open(region.name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (region.fd_ < 0) {
        region.name_.clear();
        return Unavailable("KV shared memory: " + Errno("shm_open"));
    }
    if (::ftruncate(region.fd_, bytes) != 0)
        return Unavailable("KV shared memory: " + Errno("ftruncate"));
    void* data = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_POPULATE, region.fd_, 0);
    if (data == MAP_FAILED) return Unavailable("KV shared memory: " + Errno("mmap"));
    region.data_ = static_cast<uint8_t*>(data);
    region.bytes_ = bytes;
    return region;
}

KvShmSenderRegion::KvShmSenderRegion(KvShmSenderRegion&& other) noexcept
    : name_(std::move(other.name_)),
      fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {
    other.name_.clear();
}

KvShmSenderRegion& KvShmSenderRegion::operator=(KvShmSenderRegion&& other) noexcept {
    if (this != &other) {
        Reset();
        name_ = std::move(other.name_);
        other.name_.clear();
        fd_ = std::exchange(other.fd_, -1);
        data_ = std::exchange(other.data_, nullptr);
        bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
}

KvShmSenderRegion::~KvShmSenderRegion() { Reset(); }

void KvShmSenderRegion::Unlink() {
    if (!name_.empty()) ::shm_unlink(name_.c_str());
    name_.clear();
}

void KvShmSenderRegion::Reset() {
    Unlink();
    if (data_ != nullptr) ::munmap(data_, static_cast<size_t>(bytes_));
    if (fd_ >= 0) ::close(fd_);
    data_ = nullptr;
    fd_ = -1;
    bytes_ = 0;
}

// ---- receiver ----

Result<KvShmReceiverRegion> KvShmReceiverRegion::Open(const std::string& name,
                                                      int64_t claimed_bytes) {
    if (!IsKvShmName(name)) {
        return InvalidArgument("KV shared memory: '" + name.substr(0, kMaxKvShmNameBytes) +
                               "' is not a region name");
    }
    if (claimed_bytes < kMinKvShmRegionBytes || claimed_bytes > kMaxKvShmRegionBytes) {
        return InvalidArgument("KV shared memory: a region of " + std::to_string(claimed_bytes) +
                               " bytes is outside the agreed [" +
                               std::to_string(kMinKvShmRegionBytes) + ", " +
                               std::to_string(kMaxKvShmRegionBytes) + "]");
    }
    KvShmReceiverRegion region;
    region.fd_ = ::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
    if (region.fd_ < 0) {
        const bool missing = errno == ENOENT;
        const std::string why =
            "KV shared memory: cannot open " + name + ": " + std::strerror(errno);
        return missing ? NotFound(why) : Unavailable(why);
    }
    struct stat st {};
    if (::fstat(region.fd_, &st) != 0) return Unavailable("KV shared memory: " + Errno("fstat"));
    if (!S_ISREG(st.st_mode) || st.st_size != claimed_bytes) {
        return InvalidArgument("KV shared memory: " + name + " holds " +
                               std::to_string(st.st_size) + " bytes, the offer claimed " +
                               std::to_string(claimed_bytes));
    }
    region.bytes_ = claimed_bytes;
    return region;
}

KvShmReceiverRegion::KvShmReceiverRegion(KvShmReceiverRegion&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), bytes_(std::exchange(other.bytes_, 0)) {}

KvShmReceiverRegion& KvShmReceiverRegion::operator=(KvShmReceiverRegion&& other) noexcept {
    if (this != &other) {
        if (fd_ >= 0) ::close(fd_);
        fd_ = std::exchange(other.fd_, -1);
        bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
}

KvShmReceiverRegion::~KvShmReceiverRegion() {
    if (fd_ >= 0) ::close(fd_);
}

Status KvShmReceiverRegion::Read(int64_t offset, int64_t n, uint8_t* out) const {
    if (fd_ < 0) return Internal("KV shared memory: no region");
    if (offset < 0 || n <= 0 || offset > bytes_ || n > bytes_ - offset) {
        return InvalidArgument("KV shared memory: bytes [" + std::to_string(offset) + ", +" +
                               std::to_string(n) + ") outside the region of " +
                               std::to_string(bytes_));
    }
    int64_t done = 0;
    while (done < n) {
        const ssize_t got = ::pread(fd_, out + done, static_cast<size_t>(n - done), offset + done);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return DataLoss("KV shared memory: " + Errno("pread"));
        if (got == 0) {
            return DataLoss("KV shared memory: the region ended at " +
                            std::to_string(offset + done) + " of " + std::to_string(bytes_) +
                            " bytes (shrunk by its sender)");
        }
        done += got;
    }
    return Status::Ok();
}

}  // namespace kvshard::internal
