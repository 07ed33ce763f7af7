// The shared-memory staging region of the TCP KV transport (comm/shm_region.h).
#include "comm/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <utility>

#include "comm/kv_hash.h"

namespace kvshard::internal {

namespace {

constexpr char kNamePrefix[] = "/kvshard-kv-";
// The memory file's own name (what /proc/PID/fd/FD links to): this prefix and the salt in hex.
constexpr char kMemfdPrefix[] = "kvshard-kv-";
// Copies are hashed in pieces of this size right after each is copied, while it is in the
// core's L2 (2 MiB here): one pass over memory for both.
constexpr size_t kHashPieceBytes = 64 << 10;

std::string Errno(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

uint64_t RandomSalt() {
    std::random_device device;
    return (uint64_t{device()} << 32) ^ device();
}

std::string SaltHex(uint64_t salt) {
    char buffer[17];
    std::snprintf(buffer, sizeof(buffer), "%016llx", static_cast<unsigned long long>(salt));
    return buffer;
}

// Copies `n` bytes and returns the XXH3-64 of `hashed` (either side of the copy), piece by piece.
uint64_t CopyAndHash(uint8_t* to, const uint8_t* from, size_t n, bool hash_destination) {
    if (n <= kHashPieceBytes) {
        std::memcpy(to, from, n);
        return XXH3_64bits(hash_destination ? to : from, n);
    }
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (size_t at = 0; at < n; at += kHashPieceBytes) {
        const size_t piece = std::min(kHashPieceBytes, n - at);
        std::memcpy(to + at, from + at, piece);
        XXH3_64bits_update(&state, (hash_destination ? to : from) + at, piece);
    }
    return XXH3_64bits_digest(&state);
}

// The receiver's copy out of the region into a staging buffer that is not read again until the
// decode worker unpacks it, usually after the piece has left the caches: piece by piece through a
// bounce buffer that stays in L1 (copied, then hashed there, so what is hashed is what is
// written), then to `to` with non-temporal stores, which do not read the destination's lines
// first. A plain memcpy into a cold destination moves each byte over the memory bus three times
// (read for ownership, write back, and the source); this moves it twice, which is what lets the
// receiver keep pace with a sender copying on the other core.
uint64_t CopyOutAndHash(uint8_t* to, const uint8_t* from, size_t n) {
#if defined(__x86_64__)
    constexpr size_t kBounceBytes = 16 << 10;
    alignas(64) uint8_t bounce[kBounceBytes];
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    for (size_t at = 0; at < n; at += kBounceBytes) {
        const size_t piece = std::min(kBounceBytes, n - at);
        std::memcpy(bounce, from + at, piece);
        XXH3_64bits_update(&state, bounce, piece);
        uint8_t* out = to + at;
        size_t done = 0;
        // Head up to 16-byte alignment of the destination, then streamed 16-byte stores.
        const size_t head = std::min(piece, (16 - reinterpret_cast<uintptr_t>(out) % 16) % 16);
        std::memcpy(out, bounce, head);
        done = head;
        for (; done + 64 <= piece; done += 64) {
            const auto* s = reinterpret_cast<const __m128i*>(bounce + done);
            auto* d = reinterpret_cast<__m128i*>(out + done);
            _mm_stream_si128(d, _mm_loadu_si128(s));
            _mm_stream_si128(d + 1, _mm_loadu_si128(s + 1));
            _mm_stream_si128(d + 2, _mm_loadu_si128(s + 2));
            _mm_stream_si128(d + 3, _mm_loadu_si128(s + 3));
        }
        std::memcpy(out + done, bounce + done, piece - done);
    }
    _mm_sfence();  // the streamed stores are visible before the piece is staged
    return XXH3_64bits_digest(&state);
#else
    return CopyAndHash(to, from, n, /*hash_destination=*/true);
#endif
}

// A hexadecimal field of a name: digits only, at most `max_digits`.
bool ParseHex(const std::string& text, size_t max_digits, uint64_t* out) {
    if (text.empty() || text.size() > max_digits) return false;
    for (char c : text) {
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
    }
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out, 16);
    return ec == std::errc() && end == text.data() + text.size();
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

Result<KvShmName> ParseKvShmName(const std::string& name) {
    const auto bad = [&] {
        return InvalidArgument("KV shared memory: '" + name.substr(0, kMaxKvShmNameBytes) +
                               "' is not a region name (/kvshard-kv-PID-FD-SALT in hex)");
    };
    const size_t prefix = sizeof(kNamePrefix) - 1;
    if (name.size() <= prefix || name.size() > kMaxKvShmNameBytes) return bad();
    if (name.compare(0, prefix, kNamePrefix) != 0) return bad();
    const size_t dash1 = name.find('-', prefix);
    const size_t dash2 = dash1 == std::string::npos ? dash1 : name.find('-', dash1 + 1);
    if (dash2 == std::string::npos) return bad();
    uint64_t pid = 0, fd = 0, salt = 0;
    if (!ParseHex(name.substr(prefix, dash1 - prefix), 8, &pid) ||
        !ParseHex(name.substr(dash1 + 1, dash2 - dash1 - 1), 8, &fd) ||
        name.size() - dash2 - 1 != 16 || !ParseHex(name.substr(dash2 + 1), 16, &salt)) {
        return bad();
    }
    if (pid == 0 || pid > 0x7fffffff || fd > 0x7fffffff) return bad();
    return KvShmName{static_cast<pid_t>(pid), static_cast<int>(fd), salt};
}

// ---- sender ----

Result<KvShmSenderRegion> KvShmSenderRegion::Create(int64_t bytes) {
    if (bytes < kMinKvShmRegionBytes || bytes > kMaxKvShmRegionBytes) {
        return InvalidArgument("shared-memory region of " + std::to_string(bytes) +
                               " bytes outside [" + std::to_string(kMinKvShmRegionBytes) + ", " +
                               std::to_string(kMaxKvShmRegionBytes) + "]");
    }
    const uint64_t salt = RandomSalt();
    KvShmSenderRegion region;
    region.fd_ =
        ::memfd_create((kMemfdPrefix + SaltHex(salt)).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (region.fd_ < 0) return Unavailable("KV shared memory: " + Errno("memfd_create"));
    if (::ftruncate(region.fd_, bytes) != 0)
        return Unavailable("KV shared memory: " + Errno("ftruncate"));
    if (::fcntl(region.fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        return Unavailable("KV shared memory: " + Errno("fcntl(F_ADD_SEALS)"));
    void* data = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_POPULATE, region.fd_, 0);
    if (data == MAP_FAILED) return Unavailable("KV shared memory: " + Errno("mmap"));
    region.data_ = static_cast<uint8_t*>(data);
    region.bytes_ = bytes;
    char name[kMaxKvShmNameBytes + 1];
    std::snprintf(name, sizeof(name), "%s%x-%x-%s", kNamePrefix, static_cast<unsigned>(::getpid()),
                  static_cast<unsigned>(region.fd_), SaltHex(salt).c_str());
    region.name_ = name;
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

void KvShmSenderRegion::Reset() {
    if (data_ != nullptr) ::munmap(data_, static_cast<size_t>(bytes_));
    if (fd_ >= 0) ::close(fd_);
    name_.clear();
    data_ = nullptr;
    fd_ = -1;
    bytes_ = 0;
}

uint64_t KvShmSenderRegion::CopyIn(int64_t offset, const uint8_t* from, size_t n) const {
    return CopyAndHash(data_ + offset, from, n, /*hash_destination=*/false);
}

// ---- receiver ----

Result<KvShmReceiverRegion> KvShmReceiverRegion::Open(const std::string& name,
                                                      int64_t claimed_bytes) {
    KV_ASSIGN_OR_RETURN(const KvShmName parts, ParseKvShmName(name));
    if (claimed_bytes < kMinKvShmRegionBytes || claimed_bytes > kMaxKvShmRegionBytes) {
        return InvalidArgument("KV shared memory: a region of " + std::to_string(claimed_bytes) +
                               " bytes is outside the agreed [" +
                               std::to_string(kMinKvShmRegionBytes) + ", " +
                               std::to_string(kMaxKvShmRegionBytes) + "]");
    }
    KvShmReceiverRegion region;
    const std::string path =
        "/proc/" + std::to_string(parts.pid) + "/fd/" + std::to_string(parts.fd);
    // Non-blocking and no controlling terminal: whatever the path turns out to lead to, opening
    // it for reading neither waits nor changes anything.
    region.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (region.fd_ < 0) {
        const bool missing = errno == ENOENT;
        const std::string why =
            "KV shared memory: cannot open " + name + " (" + path + "): " + std::strerror(errno);
        return missing ? NotFound(why) : Unavailable(why);
    }
    // That sender's region, not whatever another process namespace's PID and FD name: the memory
    // file's name carries the salt.
    char target[256] = {};
    const std::string self = "/proc/self/fd/" + std::to_string(region.fd_);
    const ssize_t len = ::readlink(self.c_str(), target, sizeof(target) - 1);
    const std::string expected = std::string("/memfd:") + kMemfdPrefix + SaltHex(parts.salt);
    if (len <= 0 || std::string(target, static_cast<size_t>(len)).rfind(expected, 0) != 0) {
        return NotFound("KV shared memory: " + path + " is not the region " + name +
                        " (another process namespace?)");
    }
    struct stat st {};
    if (::fstat(region.fd_, &st) != 0) return Unavailable("KV shared memory: " + Errno("fstat"));
    const int seals = ::fcntl(region.fd_, F_GET_SEALS);
    if (!S_ISREG(st.st_mode) || seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
        return InvalidArgument("KV shared memory: " + name +
                               " is not a memory file sealed against shrinking");
    }
    if (st.st_size != claimed_bytes) {
        return InvalidArgument("KV shared memory: " + name + " holds " +
                               std::to_string(st.st_size) + " bytes, the offer claimed " +
                               std::to_string(claimed_bytes));
    }
    void* data = ::mmap(nullptr, static_cast<size_t>(claimed_bytes), PROT_READ,
                        MAP_SHARED | MAP_POPULATE, region.fd_, 0);
    if (data == MAP_FAILED) return Unavailable("KV shared memory: " + Errno("mmap"));
    region.data_ = static_cast<const uint8_t*>(data);
    region.bytes_ = claimed_bytes;
    return region;
}

KvShmReceiverRegion::KvShmReceiverRegion(KvShmReceiverRegion&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

KvShmReceiverRegion& KvShmReceiverRegion::operator=(KvShmReceiverRegion&& other) noexcept {
    if (this != &other) {
        Reset();
        fd_ = std::exchange(other.fd_, -1);
        data_ = std::exchange(other.data_, nullptr);
        bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
}

KvShmReceiverRegion::~KvShmReceiverRegion() { Reset(); }

void KvShmReceiverRegion::Reset() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(bytes_));
    if (fd_ >= 0) ::close(fd_);
    data_ = nullptr;
    fd_ = -1;
    bytes_ = 0;
}

Result<uint64_t> KvShmReceiverRegion::CopyOut(int64_t offset, int64_t n, uint8_t* out) const {
    if (data_ == nullptr) return Internal("KV shared memory: no region");
    if (offset < 0 || n <= 0 || offset > bytes_ || n > bytes_ - offset) {
        return InvalidArgument("KV shared memory: bytes [" + std::to_string(offset) + ", +" +
                               std::to_string(n) + ") outside the region of " +
                               std::to_string(bytes_));
    }
    return CopyOutAndHash(out, data_ + offset, static_cast<size_t>(n));
}

}  // namespace kvshard::internal
