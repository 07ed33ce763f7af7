// The pair channels one worker rank holds for the NCCL KV handoff (kv_transfer.path: nccl,
// issue 13 item 6), made at start from the pairs its RegisterAck names (`kv_nccl_pairs`,
// comm/kv_nccl_pairs.h): a KvPairSender per pair where the rank sends (nccl_rank 0, a prefill
// rank) and a KvPairReceiver per pair where it receives (nccl_rank 1, a decode rank), both of
// comm/kv_pair_protocol.h, looked up by the peer (instance, rank).
//
// Creation: the channels are made at start, one at a time in the order the pairs are given —
// KvNcclPairsOfRank's plan order, which both ranks of every pair share — so a blocking join
// (MakeNcclKvPairChannel waits for the peer) always progresses: the first pair of the plan that
// is not yet formed is the next one for both its ranks. The first failure ends Create, naming the
// pair; channels made before it are closed.
//
// Made by the worker's KV pair handoff (worker/kv_handoff_pairs.h) at start.
//
// Thread-safety: Create, Sender and Receiver from one thread (the worker's); the senders and
// receivers handed out follow comm/kv_pair_protocol.h.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/kv_nccl_pairs.h"
#include "comm/kv_pair_channel.h"
#include "comm/kv_pair_protocol.h"
#include "common/status.h"

namespace kvshard {

struct KvNcclChannelsOptions {
    int64_t send_timeout_ms = 60'000;     // per send, from its issue
    int64_t receive_timeout_ms = 60'000;  // per receive, from its announcement
    int64_t max_offers_per_pair = 64;     // transfers a sender holds at once
};

class KvNcclRankChannels {
  public:
    // Makes the channel of one pair as this rank sees it (MakeNcclKvPairChannel on this rank's
    // GPU in serve; an InMemoryKvPairLink endpoint in tests).
    using MakeChannel =
        std::function<Result<std::unique_ptr<KvPairChannel>>(const KvNcclPairAssignment&)>;

    // InvalidArgument for bad options or two pairs with one peer; the first channel's error,
    // prefixed with the pair it was making.
    static Result<std::unique_ptr<KvNcclRankChannels>> Create(
        std::vector<KvNcclPairAssignment> pairs, const MakeChannel& make,
        const KvNcclChannelsOptions& options);

    ~KvNcclRankChannels();
    KvNcclRankChannels(const KvNcclRankChannels&) = delete;
    KvNcclRankChannels& operator=(const KvNcclRankChannels&) = delete;

    // The sender of the pair with this peer: NotFound without one, InvalidArgument where this
    // rank receives on it.
    Result<KvPairSender*> Sender(std::string_view peer_instance, int peer_rank);
    // The receiver of the pair with this peer, made on first use with the pool's limits and the
    // control path's announcement (later calls return it as made). NotFound / InvalidArgument as
    // Sender's, the other way round.
    Result<KvPairReceiver*> Receiver(std::string_view peer_instance, int peer_rank,
                                     const KvPairReceiveLimits& limits,
                                     const KvPairReceiver::AnnounceReady& announce);

    // Fails the pair with this peer (its channel's Abort): a call in progress on it returns, and
    // so does every later one. Nothing when there is no such pair.
    void Abort(std::string_view peer_instance, int peer_rank, const Status& why);

    const std::vector<KvNcclPairAssignment>& pairs() const { return pairs_; }

  private:
    struct PairState;
    KvNcclRankChannels(std::vector<KvNcclPairAssignment> pairs, KvNcclChannelsOptions options);
    Result<PairState*> Find(std::string_view peer_instance, int peer_rank, int nccl_rank);

    const std::vector<KvNcclPairAssignment> pairs_;
    const KvNcclChannelsOptions options_;
    std::vector<std::unique_ptr<PairState>> states_;  // one per pair, in pairs_ order
};

}  // namespace kvshard
