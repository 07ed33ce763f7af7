// KvPairChannel: one pair of the NCCL point-to-point KV handoff (kv_transfer.path: nccl, issue 13
// item 6) as the transfer protocol (comm/kv_pair_protocol.h) sees it — a two-rank link that sends
// or receives one block range's bytes at a time, rank 0 the prefill side (sends) and rank 1 the
// decode side (receives). Two implementations: NCCL (comm/nccl_kv_pair_channel.h, CUDA builds)
// and InMemoryKvPairLink below, the fake the protocol's CPU tests run on.
//
// Matching: the n-th Send of rank 0 pairs with the n-th Recv of rank 1 (NCCL's rule for one
// communicator and one peer), and both must name the same byte count. A call returns once its
// bytes moved, or with the first error: after any error (a timeout, a dead peer, Abort) the
// channel is failed for good and every later call returns that error; a pair that failed needs
// a fresh communicator (new unique ids: re-plan the pairs).
//
// Thread-safety: one thread at a time calls Send/Recv (NCCL communicators are not thread-safe);
// Abort may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>

#include "common/status.h"

namespace kvshard {

class KvPairChannel {
  public:
    using Clock = std::chrono::steady_clock;

    virtual ~KvPairChannel() = default;

    // REQUIRES: rank() == 0. Sends `bytes` from `src` (device memory for NCCL) to the peer.
    virtual Status Send(const void* src, size_t bytes, Clock::time_point deadline) = 0;
    // REQUIRES: rank() == 1. Receives `bytes` into `dst`.
    virtual Status Recv(void* dst, size_t bytes, Clock::time_point deadline) = 0;
    // Fails the channel with `why` (an Aborted status naming it): a call in progress returns it
    // (NCCL: at its next poll) and so does every later one.
    virtual void Abort(const Status& why) = 0;
    virtual int rank() const = 0;
};

// Two in-memory endpoints of one pair, for tests: Send waits for the matching Recv (as a
// rendezvous NCCL send of a large message does) and copies the bytes. Kill(rank) makes that
// endpoint's peer see it die: its calls in progress and later ones fail with Unavailable.
class InMemoryKvPairLink {
  public:
    InMemoryKvPairLink();
    ~InMemoryKvPairLink();

    // The endpoint of `rank` (0 or 1); the link keeps it alive while the link lives.
    KvPairChannel* endpoint(int rank);
    // A channel of its own that forwards every call to endpoint(rank), for code that owns the
    // channels it is given (a maker's result) while the link keeps the endpoint: destroying it
    // leaves the endpoint as it was. REQUIRES: the link outlives it.
    std::unique_ptr<KvPairChannel> Borrow(int rank);
    // The endpoint of `rank` dies: both sides' calls in progress and later ones fail.
    void Kill(int rank);
    // Sends and receives that completed (tests check the issue order with it).
    int64_t completed() const;

  private:
    class Endpoint;
    struct Shared;
    std::shared_ptr<Shared> shared_;
    std::unique_ptr<Endpoint> endpoints_[2];
};

}  // namespace kvshard
