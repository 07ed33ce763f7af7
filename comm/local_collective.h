// LocalGroup: collectives among the worker threads of one process (embedded mode). Each thread
// holds the Collective of its rank; the ranks exchange pointers to their own buffers at a barrier
// and read or write each other's memory directly, so nothing is copied through a transport.
//
// Determinism: AllReduceSum splits the elements among the ranks; each element's owner adds the
// ranks' values in rank order 0..size-1 and writes the sum into every rank's buffer. The bits do
// not depend on which thread arrives first, and equal those of the Mpi communicator.
//
// Failure: every wait ends by the group's timeout. A timeout, an Abort() (from any rank or
// thread) or ranks that disagree about the operation (AllReduceSum of 5 floats on one rank,
// Barrier on another) break the group: every pending and later call on every rank returns the
// same error. A rank leaving with an error first waits for the ranks that are still copying to
// or from its buffers (work that never blocks), so the caller may free its buffer at once.
#pragma once

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

  private:
    LocalGroup(int size, int64_t timeout_ms);
    Status FailLocked(std::unique_lock<std::mutex>& lock);

    struct Slot {
        OpDesc desc;
        uint64_t generation = ~uint64_t{0};
        bool then_touch_peers = false;
    };

    const int size_;
    const int64_t timeout_ms_;

    mutable std::mutex mu_;
    std::condition_variable cv_;
    // All guarded by mu_.
    Status failure_;
    uint64_t generation_ = 0;
    int arrived_ = 0;
    int num_busy_ = 0;        // ranks touching peers' buffers since the last barrier
    std::vector<bool> busy_;  // per rank
    // Descriptors by generation parity: a rank can be at most one barrier ahead of a rank still
    // reading the descriptors of the previous one.
    std::vector<Slot> slots_[2];
};

}  // namespace kvshard
