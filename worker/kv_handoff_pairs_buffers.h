// The buffers of the KV pair path (worker/kv_handoff_pairs.h): backend memory (Backend::Allocate,
// kernels/backend.h) that a rank's pairs send from and receive into — device memory on a GPU,
// which is what the NCCL pair channel sends; host memory on the CPU backend, which is what the
// socket test link sends — packed from and unpacked into the pool by copies on the backend's
// stream (KvPairStaging).
//
// Offer buffers (KvPairBuffers): each offer holds one buffer per pair until its sender is done
// with it (sent, discarded, or the pair failed). Sizes are rounded up to a size class (a multiple
// of 1/8 of the size's power of two, at least 64 KiB: at most 12.5% more than asked), and a
// buffer given back is kept for reuse by the next offer of its class, so a steady stream of
// offers allocates nothing on the step's path. Bound: every offer buffer of the rank, held or
// kept for reuse, totals at most `max_bytes`; a Take past it first takes the smallest kept
// buffer of a larger class as it is (a free on a GPU waits for the whole device, the senders'
// transfers in flight included, which wait for their decode ranks: the step thread would stall
// behind them), then frees kept buffers of smaller classes, then fails with ResourceExhausted
// naming the bound (the offer fails and the prefill instance decodes the request itself, as for
// any failed offer).
//
// Ownership and threads: a KvPairBuffer (a held buffer) is a shared handle; the last copy
// dropped — on the sender's thread when its `done` runs, or wherever the offer is withdrawn —
// gives the buffer back to a queue guarded by a mutex. Only the owner thread (the worker's step
// thread, which calls Take) allocates or frees backend memory; the queue is drained by Take. The
// pool's shared state outlives every handle, and frees what it keeps when the last goes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "worker/kv_handoff.h"

namespace kvshard {

// The default bound of a rank's offer buffers (KvPairBuffers): 1 GiB, e.g. four 2k-token
// prompts' KV of a Llama-3-8B-shaped model (fp16, tp 1) waiting for their decode instance.
// Not in the device plan's reserve: a buffer that cannot be had fails its offer, nothing else.
inline constexpr int64_t kKvPairMaxOfferBytes = int64_t{1} << 30;

// The size class of `bytes` (see above). REQUIRES: bytes > 0.
int64_t KvPairBufferClass(int64_t bytes);

class KvPairBuffers {
  public:
    // A held offer buffer: backend memory of at least the bytes asked. Copies share it; the
    // last one dropped gives it back (from any thread).
    using Held = std::shared_ptr<const BackendBuffer>;

    // REQUIRES: backend outlives the pool and every Held; max_bytes > 0.
    KvPairBuffers(Backend* backend, int64_t max_bytes);
    ~KvPairBuffers();
    KvPairBuffers(const KvPairBuffers&) = delete;
    KvPairBuffers& operator=(const KvPairBuffers&) = delete;

    // A buffer of at least `bytes` (> 0): a kept one of its class, else a fresh allocation.
    // ResourceExhausted naming the bound when the rank's offer buffers would pass it, or the
    // backend's when it cannot allocate. Owner thread only.
    Result<Held> Take(int64_t bytes);

    // Bytes of every offer buffer now allocated (held and kept), and of those held.
    int64_t allocated_bytes() const;
    int64_t held_bytes() const;
    int64_t max_bytes() const { return max_bytes_; }

  private:
    struct Shared;
    // Moves the buffers given back into `kept_`. Owner thread only.
    void Reclaim();

    Backend* const backend_;
    const int64_t max_bytes_;
    std::shared_ptr<Shared> shared_;
    std::multimap<int64_t, BackendBuffer> kept_;  // by size class; owner thread only
};

// The copies between a pool and a pair buffer, queued on the backend's stream through its
// PeerCopy with the backend itself as the source (kernels/backend.h: a copy within one CUDA
// device's memory is cudaMemcpyAsync device to device; on the CPU a memcpy).
class KvPairStaging {
  public:
    // InvalidArgument naming the backend when it has no PeerCopy that copies within itself.
    static Result<KvPairStaging> Of(Backend* backend);

    // Queues run.bytes from pool_base + run.pool_offset to buffer + run.piece_offset, for every
    // run (Pack), or the other way (Unpack). Nothing waits: the caller synchronizes the backend
    // before the buffer is sent (Pack) or the pool is read (Unpack). The backend's errors.
    Status Pack(std::span<const KvCopyRun> runs, const uint8_t* pool_base, uint8_t* buffer) const;
    Status Unpack(std::span<const KvCopyRun> runs, const uint8_t* buffer, uint8_t* pool_base) const;

  private:
    KvPairStaging(Backend* backend, PeerCopy* copies) : backend_(backend), copies_(copies) {}
    Backend* backend_;
    PeerCopy* copies_;
};

}  // namespace kvshard
