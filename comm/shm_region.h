// The shared-memory staging region of the TCP KV transport's same-host path (docs/comm.md and
// docs/disaggregation.md, "Shared memory between worker processes"). Internal to comm/.
//
// The sender of a connection creates one POSIX shared-memory object (shm_open, a random name under
// /dev/shm, mode 0600), sizes and maps it, names it to the receiver over the TCP session, and
// unlinks the name as soon as the receiver answered: from then on the object has no name and lives
// exactly as long as the two descriptors, so nothing is left in /dev/shm whatever happens to
// either process later. The receiver opens it read-only and never maps it: it copies out of it
// with pread into its own staging buffers. So a sender can neither make the receiver map memory
// nor crash it by shrinking the object (a short read is an error, not a SIGBUS), and the receiver
// cannot write into the sender's region.
//
// Thread-safety: a region is used by one thread at a time (its connection's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace kvshard::internal {

// Regions are named "/kvshard-kv-" followed by [0-9a-f-], at most this long.
inline constexpr size_t kMaxKvShmNameBytes = 64;
// The largest region a receiver accepts (the protocol's agreement: an offer of more is refused).
inline constexpr int64_t kMaxKvShmRegionBytes = int64_t{256} << 20;
// The smallest region a sender may offer.
inline constexpr int64_t kMinKvShmRegionBytes = int64_t{64} << 10;

// This machine's identity for the same-host check: the kernel's boot id
// (/proc/sys/kernel/random/boot_id, shared by every container on one kernel), read once. Empty
// when it cannot be read (then no shared-memory path is offered or accepted).
const std::string& KvHostBootId();

// Whether `name` is a well-formed region name (see above).
bool IsKvShmName(const std::string& name);

// The sender's side: owns the name until Unlink, the descriptor and the mapping.
class KvShmSenderRegion {
  public:
    // Creates, sizes and maps (prefaulted) a fresh region of `bytes`. Unavailable (naming the
    // call and errno) when /dev/shm cannot give it; InvalidArgument for a size out of bounds.
    static Result<KvShmSenderRegion> Create(int64_t bytes);

    KvShmSenderRegion() = default;
    KvShmSenderRegion(KvShmSenderRegion&& other) noexcept;
    KvShmSenderRegion& operator=(KvShmSenderRegion&& other) noexcept;
    KvShmSenderRegion(const KvShmSenderRegion&) = delete;
    KvShmSenderRegion& operator=(const KvShmSenderRegion&) = delete;
    ~KvShmSenderRegion();  // unlinks (if still named), unmaps, closes

    // Removes the name from /dev/shm (idempotent); the mapping stays usable.
    void Unlink();

    bool valid() const { return data_ != nullptr; }
    const std::string& name() const { return name_; }
    int64_t bytes() const { return bytes_; }
    uint8_t* data() const { return data_; }

  private:
    void Reset();
    std::string name_;  // empty once unlinked
    int fd_ = -1;
    uint8_t* data_ = nullptr;
    int64_t bytes_ = 0;
};

// The receiver's side: a read-only descriptor of a sender's region, checked against the claim.
class KvShmReceiverRegion {
  public:
    // Opens `name` read-only. InvalidArgument when the name is malformed, `claimed_bytes` is
    // outside [kMinKvShmRegionBytes, kMaxKvShmRegionBytes], or the object is not a regular file
    // of exactly `claimed_bytes` (a peer may not make this side read more than it announced);
    // NotFound/Unavailable when it cannot be opened (another /dev/shm: not the same host after
    // all, e.g. two pods of one node).
    static Result<KvShmReceiverRegion> Open(const std::string& name, int64_t claimed_bytes);

    KvShmReceiverRegion() = default;
    KvShmReceiverRegion(KvShmReceiverRegion&& other) noexcept;
    KvShmReceiverRegion& operator=(KvShmReceiverRegion&& other) noexcept;
    KvShmReceiverRegion(const KvShmReceiverRegion&) = delete;
    KvShmReceiverRegion& operator=(const KvShmReceiverRegion&) = delete;
    ~KvShmReceiverRegion();

    bool valid() const { return fd_ >= 0; }
    int64_t bytes() const { return bytes_; }

    // Copies [offset, offset + n) of the region into `out`. InvalidArgument when the range is not
    // inside the announced size; DataLoss when the object delivers fewer bytes (it shrank).
    Status Read(int64_t offset, int64_t n, uint8_t* out) const;

  private:
    int fd_ = -1;
    int64_t bytes_ = 0;
};

}  // namespace kvshard::internal
