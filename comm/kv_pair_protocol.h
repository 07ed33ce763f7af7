// The transfer protocol of the NCCL point-to-point KV handoff (kv_transfer.path: nccl, issue 13
// item 6), for one pair (a prefill rank and a decode rank, comm/kv_pair_channel.h), written
// against KvPairChannel so that the CPU tests run it on InMemoryKvPairLink.
//
// Why it has this shape:
//  - The decode step's receive comes after the prefill step's send (coordinator/engine_handoff.cc),
//    and a send blocks until the peer posts its receive, so the prefill step cannot send inline:
//    it Offers the transfer to the pair's KvPairSender, whose own thread sends it. The prefill
//    side keeps the transfer's blocks until `done` runs.
//  - NCCL matches a pair's messages in issue order, so a transfer issued on one side only would
//    pair with the next one on the other. The decode side therefore announces "ready for T"
//    (over the control path) before it posts the receive, and the sender issues exactly the
//    transfers announced, in announcement order; a transfer the decode side gives up before
//    announcing is Discarded on the sender (never issued on either side). Transfer ids announced
//    by one receiver increase strictly, so the two sides cannot disagree about the order.
//  - The receiver checks a transfer against its own pool (KvPairReceiveLimits) before it
//    announces or posts anything: the block count, the bytes per block and the destination size.
//  - Any failure (a timeout, a dead peer, an announcement that may or may not have arrived, a
//    ready for a transfer the sender does not hold) fails the pair for good: its channel is
//    aborted, every transfer still held ends with that error (the caller recomputes or fails the
//    request as for a dead peer, and frees the blocks in `done`), and the pair needs a fresh
//    communicator (re-plan the pairs: new unique ids). Nothing waits past its deadline.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/kv_pair_channel.h"
#include "common/status.h"

namespace kvshard {

// One transfer on one pair: `num_blocks` blocks of the pair's heads, `bytes_per_block` each,
// contiguous in the source and destination buffers.
struct KvPairTransfer {
    uint64_t transfer_id = 0;
    int64_t num_blocks = 0;
    int64_t bytes_per_block = 0;
};

// What the decode rank's pool can take on this pair: at most `max_blocks` blocks of exactly
// `bytes_per_block` bytes (its layout for the pair's heads).
struct KvPairReceiveLimits {
    int64_t max_blocks = 0;
    int64_t bytes_per_block = 0;
};

// The prefill (rank 0) side of one pair.
// Thread-safety: Offer, Ready, Discard and failure may be called from any thread; the sender's
// own thread is the only one that uses the channel. `done` callbacks run on that thread, or on
// the caller of Discard / the destructor.
class KvPairSender {
  public:
    using Done = std::function<void(const Status&)>;

    // REQUIRES: channel->rank() == 0, outlives the sender; timeout_ms > 0 (per send, from its
    // issue); max_offers > 0 (transfers held at once).
    KvPairSender(KvPairChannel* channel, int64_t timeout_ms, int64_t max_offers);
    // Aborts the channel (a send in progress returns), ends every held transfer with Aborted and
    // joins the thread.
    ~KvPairSender();
    KvPairSender(const KvPairSender&) = delete;
    KvPairSender& operator=(const KvPairSender&) = delete;

    // Holds transfer `t` of the bytes at `src` until the decode side asks for it (Ready) or
    // gives it up (Discard); `done` runs exactly once when the transfer ends, with its result.
    // When Offer returns an error `done` never runs (bad transfer, duplicate id, too many held,
    // the pair failed).
    Status Offer(const KvPairTransfer& t, const void* src, Done done);
    // The decode side announced that its receive for `transfer_id` follows: queues the send.
    // A transfer not held (never offered, discarded, already readied) fails the pair.
    Status Ready(uint64_t transfer_id);
    // The decode side will never ask for `transfer_id`: ends it with Aborted, without issuing it.
    // InvalidArgument when it is not held or already readied (then it is sent as announced).
    Status Discard(uint64_t transfer_id);

    // Ok, or the error that failed the pair.
    Status failure() const;
    int64_t held() const;

  private:
    struct Offered {
        KvPairTransfer transfer;
        const void* src = nullptr;
        Done done;
        bool ready = false;
    };

    void Run();
    // REQUIRES: mu_ held. Records the first failure and takes every held transfer out, to end.
    std::vector<Offered> FailLocked(const Status& why);

    KvPairChannel* const channel_;
    const int64_t timeout_ms_;
    const int64_t max_offers_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::map<uint64_t, Offered> offers_;  // guarded by mu_
    std::deque<uint64_t> ready_;          // guarded by mu_; announcement order
    Status failure_;                      // guarded by mu_
    bool stopping_ = false;               // guarded by mu_
    std::thread thread_;
};

// The decode (rank 1) side of one pair; used by the decode step's thread.
class KvPairReceiver {
  public:
    // Tells the prefill side "ready for transfer T" over the control path. An error means the
    // message may or may not have arrived: the pair fails.
    using AnnounceReady = std::function<Status(uint64_t transfer_id)>;

    // REQUIRES: channel->rank() == 1, outlives the receiver; timeout_ms > 0.
    KvPairReceiver(KvPairChannel* channel, KvPairReceiveLimits limits, AnnounceReady announce,
                   int64_t timeout_ms);

    // Checks `t` against the limits and `dst_bytes`, announces it, then receives it into `dst`.
    // InvalidArgument (naming the bound) before anything is announced or posted: the pair stays
    // usable and the caller discards `t` on the prefill side. Any later error fails the pair.
    Status Receive(const KvPairTransfer& t, void* dst, size_t dst_bytes);

    Status failure() const { return failure_; }

  private:
    KvPairChannel* const channel_;
    const KvPairReceiveLimits limits_;
    const AnnounceReady announce_;
    const int64_t timeout_ms_;
    bool any_announced_ = false;
    uint64_t last_announced_ = 0;
    Status failure_;
};

// num_blocks * bytes_per_block, or InvalidArgument for a count or size that is not positive or
// a product past what a size_t holds.
Result<size_t> KvPairTransferBytes(const KvPairTransfer& t);

}  // namespace kvshard
