// KvPeerExchange: the in-process KV handoff by peer copies (KvHandoffPath::kPeerCopy,
// config/engine_config.h) — the sending rank hands the receiving rank where the KV is, not the
// bytes, and the receiving rank copies it pool to pool (QueueKvPeerCopies, worker/kv_handoff.h:
// cudaMemcpyPeerAsync between two GPUs of this process, a memcpy on the CPU).
//
// After the step that wrote a transfer's KV (its backend synchronized), a sending rank posts one
// KvPeerSource per receiving rank that gets heads from it, keyed by that rank's KV transport
// endpoint (KvSendOp.dst_endpoints) and the transfer id. The receiving rank's step takes the
// sources of its KvRecvOp (Take) and copies from each. Nothing waits for the other side's step:
// the sender only posts; the receiver's step comes after the request's handoff, which comes after
// the send step.
//
// Why reading the sender's pool later is safe: a prefill instance keeps a handed-off request's
// blocks, unwritten, until the decode instance reports the transfer done or failed
// (coordinator/engine.h), and a source outlives nothing it points at — each sending rank
// registers its backend and pool (RegisterSource); when the registration is destroyed (the
// rank's runner goes away) its sources fail the copy (Unavailable) instead of reading freed
// memory, and the destructor waits for a copy in progress to end.
//
// Bounds: at most max_sources sources wait per receiving endpoint (a post beyond is
// ResourceExhausted, which fails that send: the request decodes on its prefill instance); a
// source not taken within stale_after_ms is dropped at the next post or take.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "worker/kv_pool.h"
#include "worker/shard.h"

namespace kvshard {

// A sending rank as sources name it. Ownership: shared by the rank's registration and its
// posted sources; the backend, pool and layout are the rank's, valid while `alive`.
struct KvPeerRank {
    Backend* backend = nullptr;
    const KvPool* pool = nullptr;
    ShardLayout layout;
    std::mutex mu;      // held while a receiver copies from the pool, and to clear `alive`
    bool alive = true;  // guarded by mu
};

// Where one receiving rank finds part of a transfer's KV.
struct KvPeerSource {
    uint64_t transfer_id = 0;
    std::shared_ptr<KvPeerRank> rank;
    // By KV cache group: the sender's blocks of the handed-off entries (FirstHandoffEntry on),
    // in the order of the receiver's entries.
    std::vector<std::vector<int32_t>> blocks;
    IndexRange heads;   // global KV heads this receiver gets from this sender
    int64_t cells = 0;  // layers × heads it covers (layers whose group hands over blocks)
};

struct KvPeerExchangeOptions {
    int64_t max_sources = 4'096;       // waiting per receiving endpoint
    int64_t stale_after_ms = 120'000;  // a source not taken for this long is dropped
};

class KvPeerExchange {
  public:
    // A sending rank's registration: its sources are valid while it lives. Destroying it waits
    // for a copy from its pool in progress, then fails later ones.
    class Registration {
      public:
        explicit Registration(std::shared_ptr<KvPeerRank> rank) : rank_(std::move(rank)) {}
        ~Registration();
        Registration(const Registration&) = delete;
        Registration& operator=(const Registration&) = delete;
        const std::shared_ptr<KvPeerRank>& rank() const { return rank_; }

      private:
        std::shared_ptr<KvPeerRank> rank_;
    };

    explicit KvPeerExchange(const KvPeerExchangeOptions& options = {}) : options_(options) {}

    // REQUIRES: backend, pool and layout outlive the registration.
    static std::unique_ptr<Registration> RegisterSource(Backend& backend, const KvPool& pool,
                                                        const ShardLayout& layout);

    // Hands `source` to the receiving rank at `dst_endpoint`. ResourceExhausted when that
    // endpoint has max_sources waiting; Aborted when the transfer was discarded there.
    Status Post(const std::string& dst_endpoint, KvPeerSource source);

    // Waits until sources of `transfer_id` covering `expected_cells` have been posted for
    // `endpoint`, then removes and returns them. DeadlineExceeded when they have not by
    // `deadline` (what was posted stays until Discard or staleness).
    Result<std::vector<KvPeerSource>> Take(const std::string& endpoint, uint64_t transfer_id,
                                           int64_t expected_cells,
                                           std::chrono::steady_clock::time_point deadline);

    // Drops the sources of `transfer_id` for `endpoint`, and later posts of it.
    void Discard(const std::string& endpoint, uint64_t transfer_id);

    // Sources waiting, over every endpoint (for tests).
    int64_t num_waiting() const;

  private:
    using Clock = std::chrono::steady_clock;
    struct Waiting {
        KvPeerSource source;
        Clock::time_point posted;
    };
    // REQUIRES: mu_ held.
    void DropStale(Clock::time_point now);

    const KvPeerExchangeOptions options_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::map<std::string, std::vector<Waiting>> waiting_;  // guarded by mu_
    // Discarded transfers per endpoint, with when (dropped with staleness); guarded by mu_.
    std::map<std::pair<std::string, uint64_t>, Clock::time_point> discarded_;
};

}  // namespace kvshard
