// The shared-memory staging region of the TCP KV transport's same-host path (docs/comm.md and
// docs/disaggregation.md, "Shared memory between worker processes"). Internal to comm/.
//
// The sender of a connection creates one anonymous memory file per connection (memfd_create),
// sizes it, seals it against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL:
// from then on no process can change its size), maps it populated, and names it to the receiver
// over the TCP session as its process id, its descriptor number and a random salt. The receiver
// opens it through /proc/PID/fd/FD read-only, checks that it is that sender's region (the memory
// file's name carries the salt), that it is sealed and exactly as large as claimed, and maps it
// read-only, populated, once for the connection's life. Sealing is what makes mapping safe: a
// sender cannot shrink the file under the receiver's mapping, so it can never make the receiver
// fault (SIGBUS); and the receiver cannot write into the sender's region. Nothing is ever named in
// a file system: the region lives exactly as long as the descriptors and mappings of the two
// processes, so nothing outlives them whatever happens to either.
//
// Copies into and out of the region are hashed (XXH3-64) in cache-sized pieces right after they
// are copied, so a chunk is read from memory once on each side. The receiver's copy out goes
// through a bounce buffer in L1 and on to its staging buffer with non-temporal stores, so the
// staging buffer's lines are not read before they are overwritten.
//
// Thread-safety: a region is used by one thread at a time (its connection's).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace kvshard::internal {

// Regions are named "/kvshard-kv-PID-FD-SALT" (hex; SALT 16 digits), at most this long.
inline constexpr size_t kMaxKvShmNameBytes = 64;
// The largest region a receiver accepts (the protocol's agreement: an offer of more is refused).
inline constexpr int64_t kMaxKvShmRegionBytes = int64_t{256} << 20;
// The smallest region a sender may offer.
inline constexpr int64_t kMinKvShmRegionBytes = int64_t{64} << 10;

// This machine's identity for the same-host check: the kernel's boot id
// (/proc/sys/kernel/random/boot_id, shared by every container on one kernel), read once. Empty
// when it cannot be read (then no shared-memory path is offered or accepted).
const std::string& KvHostBootId();

// A region name taken apart (see above).
struct KvShmName {
    pid_t pid = 0;
    int fd = -1;
    uint64_t salt = 0;
};
// The parts of `name`: InvalidArgument when it is not a well-formed region name.
Result<KvShmName> ParseKvShmName(const std::string& name);
inline bool IsKvShmName(const std::string& name) { return ParseKvShmName(name).ok(); }

// The sender's side: owns the descriptor and the mapping.
class KvShmSenderRegion {
  public:
    // Creates, sizes, seals and maps (populated) a fresh region of `bytes`. Unavailable (naming
    // the call and errno) when the kernel cannot give it; InvalidArgument for a size out of
    // bounds.
    static Result<KvShmSenderRegion> Create(int64_t bytes);

    KvShmSenderRegion() = default;
    KvShmSenderRegion(KvShmSenderRegion&& other) noexcept;
    KvShmSenderRegion& operator=(KvShmSenderRegion&& other) noexcept;
    KvShmSenderRegion(const KvShmSenderRegion&) = delete;
    KvShmSenderRegion& operator=(const KvShmSenderRegion&) = delete;
    ~KvShmSenderRegion();  // unmaps, closes

    bool valid() const { return data_ != nullptr; }
    const std::string& name() const { return name_; }
    int64_t bytes() const { return bytes_; }
    uint8_t* data() const { return data_; }

    // Copies `n` bytes from `from` to [offset, offset + n) of the region and returns their
    // XXH3-64, hashed piece by piece while in cache. REQUIRES: the range inside the region.
    uint64_t CopyIn(int64_t offset, const uint8_t* from, size_t n) const;

  private:
    void Reset();
    std::string name_;
    int fd_ = -1;
    uint8_t* data_ = nullptr;
    int64_t bytes_ = 0;
};

// The receiver's side: a read-only mapping of a sender's region, checked against the claim.
class KvShmReceiverRegion {
  public:
    // Opens and maps the region `name` read-only. InvalidArgument when the name is malformed,
    // `claimed_bytes` is outside [kMinKvShmRegionBytes, kMaxKvShmRegionBytes], or the object is
    // not a memory file sealed against shrinking of exactly `claimed_bytes` (a peer may not make
    // this side read more than it announced, nor fault); NotFound/Unavailable when it cannot be
    // opened or is not that sender's region (another process namespace: not reachable after
    // all, e.g. two pods of one node).
    static Result<KvShmReceiverRegion> Open(const std::string& name, int64_t claimed_bytes);

    KvShmReceiverRegion() = default;
    KvShmReceiverRegion(KvShmReceiverRegion&& other) noexcept;
    KvShmReceiverRegion& operator=(KvShmReceiverRegion&& other) noexcept;
    KvShmReceiverRegion(const KvShmReceiverRegion&) = delete;
    KvShmReceiverRegion& operator=(const KvShmReceiverRegion&) = delete;
    ~KvShmReceiverRegion();  // unmaps, closes

    bool valid() const { return data_ != nullptr; }
    int64_t bytes() const { return bytes_; }

    // Copies [offset, offset + n) of the region into `out` and returns the XXH3-64 of what was
    // copied (hashed piece by piece in a bounce buffer, which is then what is written to `out`:
    // bytes the sender changes meanwhile cannot pass the check unseen). `out` needs no
    // alignment. InvalidArgument when the range is not inside the region.
    Result<uint64_t> CopyOut(int64_t offset, int64_t n, uint8_t* out) const;

  private:
    void Reset();
    int fd_ = -1;
    const uint8_t* data_ = nullptr;
    int64_t bytes_ = 0;
};

}  // namespace kvshard::internal
