// LocalGroup: collectives among the worker threads of one process (embedded mode). Each thread
// holds the Collective of its rank. Small all-reduces (the decode step's: a few thousand floats)
// go through the group's staging buffers and cost one barrier; larger ones, and all-gathers and
// broadcasts, exchange pointers to the ranks' own buffers at a barrier and read or write each
// other's memory directly, so nothing is copied through a transport.
//
// Determinism: AllReduceSum adds the ranks' values of every element in rank order 0..size-1 (a
// small one on every rank, a large one on the element's owner, which writes the sum into every
// rank's buffer). The bits do not depend on which thread arrives first, and equal those of the
// Mpi communicator.
//
// Waiting: a rank waits at a barrier by spinning for a few microseconds, then yielding the CPU,
// and only then sleeping until woken, so that a group with a core per rank meets in well under a
// microsecond and one with more ranks than cores (tests: tp 4 on 2 cores) still makes progress.
//
// Failure: every wait ends by the group's timeout. A timeout, an Abort() (from any rank or
// thread) or ranks that disagree about the operation (AllReduceSum of 5 floats on one rank,
// Barrier on another) break the group: every pending and later call on every rank returns the
// same error. A rank leaving with an error first waits for the ranks that are still copying to
// or from its buffers (work that never blocks), so the caller may free its buffer at once.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/collective.h"
#include "common/status.h"

namespace kvshard {

// Thread-safety: all methods may be called from any thread.
class LocalGroup : public std::enable_shared_from_this<LocalGroup> {
  public:
    static constexpr int64_t kDefaultTimeoutMs = 60'000;
    // AllReduceSum of at most this many floats goes through the staging buffers (one barrier,
    // every rank adds all values); larger ones split the additions among the ranks (two
    // barriers). 2 × size × this many floats of staging per group.
    static constexpr int64_t kMaxStagedFloats = 16 * 1024;

    // REQUIRES: size >= 1, timeout_ms > 0.
    static std::shared_ptr<LocalGroup> Create(int size, int64_t timeout_ms = kDefaultTimeoutMs);

    int size() const { return size_; }
    int64_t timeout_ms() const { return timeout_ms_; }

    // The communicator of `rank`, sharing ownership of the group.
    // REQUIRES: 0 <= rank < size(); one communicator per rank in use at a time.
    std::unique_ptr<kvshard::Collective> Collective(int rank);

    // Breaks the group (see above). Idempotent: the first failure is the one reported.
    void Abort(const std::string& reason);

    // OK while the group works; otherwise the error every call returns.
    Status status() const;

    // What a rank does at a barrier; ranks that meet at one barrier must agree on it.
    enum class Op { kAllReduceSum, kAllGather, kBroadcast, kBarrier };
    struct OpDesc {
        Op op = Op::kBarrier;
        int64_t count = 0;  // floats or bytes
        int root = 0;
        void* data = nullptr;  // this rank's buffer, read or written by the other ranks
    };

    // The barrier the operations of local_collective.cc are built from. Publishes `desc` for this
    // rank and waits until every rank arrived (returns OK and the generation passed), the deadline
    // passes or the group breaks (returns the failure). When `then_touch_peers`, the ranks go on
    // to read or write each other's buffers until their next Arrive, and a failing rank waits for
    // them before returning.
    Status Arrive(int rank, const OpDesc& desc, std::chrono::steady_clock::time_point deadline,
                  bool then_touch_peers, uint64_t* generation);
    // The descriptor `rank` published at `generation`. REQUIRES: the caller passed that
    // generation's barrier and has not arrived at the next one.
    const OpDesc& Published(uint64_t generation, int rank) const;

    // The generation `rank`'s next Arrive will pass. REQUIRES: called by `rank`'s thread.
    uint64_t next_generation(int rank) const { return ranks_[rank].next_generation; }
    // kMaxStagedFloats floats of `rank` for the operation at `generation`: written by `rank`
    // before it arrives there, read by every rank after that barrier until its next Arrive.
    float* staging(uint64_t generation, int rank) { return staging_[generation & 1][rank].data(); }

  private:
    struct Slot {
        OpDesc desc;
        std::atomic<uint64_t> generation{~uint64_t{0}};
    };
    // What only `rank`'s thread writes, on a cache line of its own.
    struct alignas(64) RankState {
        // Set when the rank arrives at a barrier after which it touches its peers' buffers;
        // cleared when it arrives at the next one or fails.
        std::atomic<bool> touching_peers{false};
        uint64_t next_generation = 0;
    };

    LocalGroup(int size, int64_t timeout_ms);

    // Spins, yields, then sleeps until done() or the deadline; returns done()'s last value.
    template <typename Done>
    bool WaitUntil(const Done& done, std::chrono::steady_clock::time_point deadline);
    // Wakes the sleepers of WaitUntil after a change that may satisfy them.
    void WakeSleepers();
    // Breaks the group with `failure` unless it is broken or barrier `generation` completed
    // (target arrivals reached). Returns whether the barrier completed.
    bool BreakUnlessCompleted(uint64_t target, const Status& failure);
    // The failure path of Arrive: waits for the ranks touching peers' buffers, returns failure_.
    Status Fail(int rank);
    std::string MissingRanks(uint64_t generation) const;

    const int size_;
    const int64_t timeout_ms_;

    // The arrivals since the group was made (barrier g completes at (g + 1) × size) and, in the
    // top bit, whether the group is broken. Arrivals stop counting once it is.
    static constexpr uint64_t kBroken = uint64_t{1} << 63;
    alignas(64) std::atomic<uint64_t> state_{0};
    std::atomic<int> num_sleepers_{0};

    mutable std::mutex mu_;
    std::condition_variable cv_;  // sleepers of WaitUntil, with mu_
    Status failure_;              // guarded by mu_; set before kBroken is

    std::vector<RankState> ranks_;
    // Descriptors and staging by generation parity: a rank can be at most one barrier ahead of a
    // rank still reading the descriptors of the previous one.
    std::vector<Slot> slots_[2];
    std::vector<std::vector<float>> staging_[2];
};

}  // namespace kvshard
