// KvPairHandoff: one worker rank's part in the KV pair path of a handoff between pools
// (kv_transfer.path: nccl, issue 13 item 6) — the steps' side of comm/kv_pair_protocol.h over
// the rank's pair channels (KvNcclRankChannels, worker/kv_handoff_nccl_channels.h), made at the
// worker's start from its RegisterAck (kv_nccl_pairs and the two settings below).
//
//   prefill step (KvSendOp T to instance D)  Offer: for each pair with D, this pair's KV heads
//                                            of T's blocks packed into a buffer the pair's sender
//                                            holds until D is ready for T
//   decode engine plans its receive of T     the coordinator tells the prefill instance: its next
//                                            plan's kv_ready holds T (the "ready for T" of the
//                                            protocol, over the coordinator's control path)
//   prefill step (kv_ready T)                Ready: the senders send T, on their own threads
//   decode step (KvRecvOp T from P)          Receive: for each pair with P, T's bytes received
//                                            and written into this rank's blocks
//   prefill step (kv_discards T)             Discard: a T still held (never readied) is dropped
//
// Head mapping: a pair carries the global KV heads KvReshardPlan gives it, so a handoff between
// instances of different tp is re-sharded pair by pair (each head sent once, by its owner).
// Buffer layout, the same on both sides: for each run of consecutive layers of one KV cache
// group, in layer order, the run's blocks (FirstHandoffEntry on), each the run's layers of the
// pair's heads as a KvPiece lays them out (KvCopyRuns); a negative receiving block is skipped.
// One pair transfer is num_blocks = the block-layers sent, bytes_per_block = one block-layer of
// the pair's heads.
//
// Buffers are the backend's memory (worker/kv_handoff_pairs_buffers.h): packed from the pool and
// unpacked into it by copies on the rank's stream (KvPairStaging), the backend synchronized after
// packing, before a sender may send, and after unpacking, before the pool is read. On a GPU they
// are device memory, which the NCCL channel sends; on the CPU backend host memory, which the
// socket test link (comm/socket_kv_pair_channel.h) sends — so the CPU tests run this same code.
// An offer holds one buffer per pair until sent or discarded (KvPairBuffers: reused by size
// class; all of a rank's offer buffers bounded by `max_offer_bytes`, kKvPairMaxOfferBytes by
// default, and at most 64 offers per pair); the receive buffer is one, kept at the largest
// receive so far.
//
// Order: the coordinator readies a pair's transfers in the order the decode plans receive them
// (their kv_recvs, plan after plan), so each pair's sends and receives match in issue order
// whatever the transfer ids (the router's, not increasing in that order); the receiving side
// numbers its receives for the protocol's own check.
//
// Failures: the receiver was announced before its step ran, so a receive that cannot complete
// (any error on this rank, before or during the receive) aborts every pair with that sending
// instance: a pair whose order may be lost is never used again. A failed pair's Offers and
// Receives return its error at once (the prefill instance then decodes the request itself, or
// the decode instance hands it back), and the step's TransferFailure says the pairs are down
// (DownPairs): the coordinator re-plans them (cli/kv_pair_replan.h KvPairPlan::OnPairsDown), as
// for a re-form but with both instances healthy, so both sides' ranks get new pairs through
// Replan.
//
// Re-forming (cli/kv_pair_replan.h): when an instance re-forms, the coordinator makes new ids for
// every pair with it; its new ranks get them at registration, and the ranks of the healthy
// instances get theirs in a RankSettingsMessage, on which the worker calls Replan: the channels
// with an instance whose pairs changed are aborted and dropped (with the offers they held) and
// the new ones made. Epochs never mix: a channel is made from one id only, and an id is never
// made twice (a fresh NCCL unique id; a socket id names a fresh port and random bytes, which the
// connection's hello checks), so an old channel cannot reach a new peer. The transfers in flight
// across the re-form are kept off the new channels by id: the new pairs carry the coordinator's
// next transfer id when it made them (first_transfer_id), and both sides refuse an older transfer
// on them at once (Unavailable, without failing the pair): a transfer planned before the
// re-plan may have been offered on the old channel, and a new channel must never see a receive
// its sender never sends (or the other way round). The prefill instance decodes such a request.
//
// Thread-safety: one thread (the worker's step thread) calls everything; the senders' threads
// touch only the buffers they were given; a background Replan's thread only makes channels and
// hands them over under its Join's mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "comm/kv_nccl_pairs.h"
#include "comm/step_plan.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "worker/kv_handoff.h"
#include "worker/kv_handoff_nccl_channels.h"
#include "worker/kv_handoff_pairs_buffers.h"
#include "worker/kv_pool.h"
#include "worker/shard.h"

namespace kvshard {

// Which link a worker's pairs run on (the setting kv_pair_link): socket, the test link between
// CPU worker processes of one machine; nccl, MakeNcclKvPairChannel on the rank's GPU.
inline constexpr std::string_view kKvPairLinkSetting = "kv_pair_link";
inline constexpr std::string_view kKvPairTimeoutSetting = "kv_pair_timeout_ms";
// The first transfer id the pairs of these settings carry (module comment; absent: 0).
inline constexpr std::string_view kKvPairFirstTransferSetting = "kv_pair_first_transfer";
enum class KvPairLink { kSocket, kNccl };
std::string_view KvPairLinkName(KvPairLink link);  // "socket", "nccl"

struct KvPairHandoffSettings {
    KvPairLink link = KvPairLink::kSocket;
    int64_t timeout_ms = 10'000;  // each send and each receive
    std::vector<KvNcclPairAssignment> pairs;
    // Transfers with a smaller id are refused by these pairs (module comment, Re-forming).
    uint64_t first_transfer_id = 0;
};

// The pair path's settings from a RegisterAck's settings, or nullopt where they name no pairs
// (another path). InvalidArgument naming the setting for a bad value or a missing companion.
Result<std::optional<KvPairHandoffSettings>> KvPairHandoffSettingsOf(
    const std::vector<std::pair<std::string, std::string>>& settings);

// The rank's pool as the pair path reads and writes it.
struct KvPairPool {
    Backend* backend = nullptr;
    KvPool* pool = nullptr;
    ShardLayout layout;
    std::vector<int64_t> group_of_layer;  // KV cache group of each layer
};

class KvPairHandoff {
  public:
    // Makes one pair's channel (as KvNcclRankChannels::MakeChannel), polling `cancelled` while
    // it waits for its peer (an NCCL join): true ends the wait (Aborted). A background join's is
    // set when a later Replan supersedes it and when the handoff is destroyed.
    using MakePairChannel = std::function<Result<std::unique_ptr<KvPairChannel>>(
        const KvNcclPairAssignment&, const std::function<bool()>& cancelled)>;

    // Makes the rank's channels (every pair's, in plan order; see KvNcclRankChannels). Refuses,
    // naming the pair, a pair whose heads this rank does not hold, and a receiving side whose
    // pairs with one instance do not cover its heads exactly once; refuses a backend that cannot
    // stage (KvPairStaging::Of). `link_name` names the link in logs; `max_offer_bytes` (> 0)
    // bounds the rank's offer buffers (KvPairBuffers).
    static Result<std::unique_ptr<KvPairHandoff>> Create(
        std::vector<KvNcclPairAssignment> pairs, MakePairChannel make, std::string link_name,
        int64_t timeout_ms, KvPairPool pool, int64_t max_offer_bytes = kKvPairMaxOfferBytes,
        uint64_t first_transfer_id = 0);
    // The same with a maker that never waits for a peer long enough to need cancelling (the
    // in-memory links of tests).
    static Result<std::unique_ptr<KvPairHandoff>> Create(
        std::vector<KvNcclPairAssignment> pairs, const KvNcclRankChannels::MakeChannel& make,
        std::string link_name, int64_t timeout_ms, KvPairPool pool,
        int64_t max_offer_bytes = kKvPairMaxOfferBytes, uint64_t first_transfer_id = 0);

    // The rank's pairs as the coordinator re-planned them (module comment, Re-forming): for each
    // instance whose pairs with this rank changed (an id, a head range, pairs added or gone), the
    // old channels are aborted and dropped with the offers they held, and new ones made from
    // `pairs` (with `first_transfer_id`); the pairs with other instances are kept as they are.
    // Refuses, changing nothing, pairs Create would refuse. When making an instance's new
    // channels fails, its pairs stay down (their Offers and Receives return that error at once,
    // and DownPairs names them, so the coordinator re-plans them again) and the first such error
    // is returned. Returns the instances re-planned through `replanned`.
    // `in_background`: the new channels are made on a thread of their own and taken up by a later
    // call once made (an NCCL join waits for the re-formed peer, which may still be loading its
    // weights: the step thread must not wait with it); until then the instance's Offers and
    // Receives fail at once (Unavailable), and errors in making them are logged, not returned.
    Status Replan(std::vector<KvNcclPairAssignment> pairs, uint64_t first_transfer_id,
                  std::vector<std::string>* replanned = nullptr, bool in_background = false);
    // Cancels the joins still waiting in the background (MakePairChannel's `cancelled`) and
    // waits for them, then drops every pair.
    ~KvPairHandoff();
    // How long making an NCCL pair channel waits for its peer to join: the two workers of a pair
    // reach it after loading their weights, which they do at the same time, not in lockstep.
    static constexpr int64_t kNcclJoinTimeoutMs = 180'000;
    // The channel maker of `link` for a rank on `backend`: socket, MakeSocketKvPairChannel, which
    // sends host memory — refused for a non-CPU backend, naming KVSHARD_KV_PAIR_LINK; nccl,
    // MakeNcclKvPairChannel on backend.device — refused for a non-CUDA backend, and in a build
    // without CUDA (naming kv_transfer.path). The NCCL channel polls the maker's `cancelled`
    // while it joins (NcclKvPairChannelConfig::cancelled), so a join superseded or closed ends
    // then rather than after kNcclJoinTimeoutMs; a socket channel never waits to be made.
    static Result<MakePairChannel> MakerOf(KvPairLink link, const BackendConfig& backend);

    // Prefill side: offers transfer op.transfer_id to every pair with op.dst_instance, `blocks`
    // by KV cache group (the entries the handoff carries). Returns the bytes offered (0 where this
    // rank sends that instance nothing). On an error nothing of the transfer stays held.
    Result<int64_t> Offer(const KvSendOp& op, const std::vector<std::span<const int32_t>>& blocks);
    // Prefill side: the receiving instance asked for `transfer_id` (kv_ready). A transfer this
    // rank offered nothing of is ignored.
    void Ready(uint64_t transfer_id);
    // Prefill side: `transfer_id` will not be asked for; what is still held of it is dropped.
    void Discard(uint64_t transfer_id);

    // Decode side: receives op.transfer_id from every pair with op.src_instance into `blocks`
    // (by group; negative entries skipped). Returns the bytes received. On an error the pairs
    // with op.src_instance are aborted (see above).
    Result<int64_t> Receive(const KvRecvOp& op,
                            const std::vector<std::span<const int32_t>>& blocks);
    // Decode side: this rank gives up `op` before receiving it: the pairs with op.src_instance
    // are aborted, with `why`.
    void Abandon(const KvRecvOp& op, const Status& why);

    // The first transfer id of this rank's pairs with `instance` when they are down for good
    // (one of them failed or was aborted, or making them failed), for the coordinator to re-plan
    // them (TransferFailure::pairs_down); nullopt when they are up, still being joined, or this
    // rank has none with it.
    std::optional<uint64_t> DownPairs(const std::string& instance);

  private:
    // This rank's pairs with one instance and their channels.
    struct Peer {
        std::vector<KvNcclPairAssignment> pairs;       // in plan order
        std::unique_ptr<KvNcclRankChannels> channels;  // null when making them failed
        Status failed;                                 // why channels is null
        uint64_t first_transfer_id = 0;
        bool abandoned = false;          // Abandon aborted its receivers
        std::vector<bool> received_any;  // per pair: logged its first receive
        std::vector<uint64_t> receives;  // per pair: receives posted
    };
    KvPairHandoff(MakePairChannel make, int64_t timeout_ms, std::string link_name, KvPairPool pool,
                  KvPairStaging staging, int64_t max_offer_bytes);
    // Create's refusals of `pairs` for a rank holding `layout`'s heads.
    static Status CheckPairs(const std::vector<KvNcclPairAssignment>& pairs,
                             const ShardLayout& layout);
    // The pairs with one instance and their channels, made now.
    // `cancelled` (may be empty) as MakePairChannel's.
    Peer MakePeer(std::vector<KvNcclPairAssignment> pairs, uint64_t first_transfer_id,
                  const std::function<bool()>& cancelled = {}) const;
    // The peer a transfer of `op_what` with `instance` goes over: nullptr when this rank has no
    // pair with it; an error (at once) when its channels are down or `transfer_id` predates them.
    Result<Peer*> PeerFor(const std::string& instance, uint64_t transfer_id,
                          const std::string& op_what);
    // A background Replan's channels with one instance, being made.
    struct Join {
        std::string instance;
        std::thread thread;
        std::mutex mu;
        bool done = false;         // guarded by mu
        std::optional<Peer> made;  // guarded by mu: the result, once done
        bool current = true;       // false once a later Replan superseded it (step thread)
        std::atomic<bool> cancel{false};  // superseded, or the handoff closing: stop waiting
    };
    // Takes up the channels the background joins finished (the step thread, first thing in
    // every call that uses the pairs).
    void CollectJoins();
    // The copies between the pool and a pair's buffer, and the transfer they make.
    struct Layout {
        std::vector<KvCopyRun> runs;  // piece_offset: offset in the pair's buffer
        int64_t bytes = 0;
        int64_t block_layers = 0;
        int64_t bytes_per_block_layer = 0;
    };
    Layout LayoutOf(const std::vector<std::span<const int32_t>>& blocks, IndexRange heads) const;

    // Declared before peers_: the senders (and the buffers their offers hold) go first.
    KvPairBuffers offer_buffers_;
    BackendBuffer receive_buffer_;  // reused by every receive; grown by size class
    std::map<std::string, Peer> peers_;  // by instance
    std::list<std::unique_ptr<Join>> joins_;
    const MakePairChannel make_;
    const int64_t timeout_ms_;
    const std::string link_name_;
    KvPairPool pool_;
    const KvPairStaging staging_;
    size_t num_groups_ = 0;
    std::map<uint64_t, std::string> offered_;  // transfer id -> receiving instance
};

// The pair path's receives of a plan were announced when the plan was made: a step that ends
// before it took them (an error on the way) leaves their pairs out of order, so unless Received()
// was called the destructor abandons them (KvPairHandoff::Abandon). Nothing with no handoff.
class KvPairReceiveGuard {
  public:
    KvPairReceiveGuard(KvPairHandoff* pairs, const std::vector<KvRecvOp>& recvs)
        : pairs_(pairs), recvs_(recvs) {}
    ~KvPairReceiveGuard() {
        if (pairs_ == nullptr || received_) return;
        for (const KvRecvOp& op : recvs_)
            pairs_->Abandon(op, Aborted("the step ended before its KV receives"));
    }
    KvPairReceiveGuard(const KvPairReceiveGuard&) = delete;
    KvPairReceiveGuard& operator=(const KvPairReceiveGuard&) = delete;
    void Received() { received_ = true; }

  private:
    KvPairHandoff* const pairs_;
    const std::vector<KvRecvOp>& recvs_;
    bool received_ = false;
};

}  // namespace kvshard
