// KvNcclRankChannels (worker/kv_handoff_nccl_channels.h).
#include "worker/kv_handoff_nccl_channels.h"

#include <set>
#include <utility>

namespace kvshard {

namespace {

std::string PairName(const KvNcclPairAssignment& pair) {
    return "KV NCCL pair with " + pair.peer_instance + " rank " + std::to_string(pair.peer_rank) +
           " (this rank " + (pair.nccl_rank == 0 ? "sends" : "receives") + ")";
}

}  // namespace

// The sender or receiver is declared after the channel, so that it goes first.
struct KvNcclRankChannels::PairState {
    std::unique_ptr<KvPairChannel> channel;
    std::unique_ptr<KvPairSender> sender;
    std::unique_ptr<KvPairReceiver> receiver;
};

KvNcclRankChannels::KvNcclRankChannels(std::vector<KvNcclPairAssignment> pairs,
                                       KvNcclChannelsOptions options)
    : pairs_(std::move(pairs)), options_(options) {}

KvNcclRankChannels::~KvNcclRankChannels() = default;

Result<std::unique_ptr<KvNcclRankChannels>> KvNcclRankChannels::Create(
    std::vector<KvNcclPairAssignment> pairs, const MakeChannel& make,
    const KvNcclChannelsOptions& options) {
    if (options.send_timeout_ms <= 0 || options.receive_timeout_ms <= 0 ||
        options.max_offers_per_pair <= 0) {
        return InvalidArgument(
            "KV NCCL pairs: send_timeout_ms=" + std::to_string(options.send_timeout_ms) +
            ", receive_timeout_ms=" + std::to_string(options.receive_timeout_ms) +
            ", max_offers_per_pair=" + std::to_string(options.max_offers_per_pair) +
            " must all be > 0");
    }
    std::set<std::pair<std::string, int32_t>> peers;
    for (const KvNcclPairAssignment& pair : pairs) {
        if (!peers.emplace(pair.peer_instance, pair.peer_rank).second) {
            return InvalidArgument("KV NCCL pairs: two pairs with " + pair.peer_instance +
                                   " rank " + std::to_string(pair.peer_rank));
        }
        if (pair.nccl_rank != 0 && pair.nccl_rank != 1) {
            return InvalidArgument(PairName(pair) + ": nccl_rank " +
                                   std::to_string(pair.nccl_rank) + " is not 0 or 1");
        }
    }
    std::unique_ptr<KvNcclRankChannels> channels(new KvNcclRankChannels(std::move(pairs), options));
    for (const KvNcclPairAssignment& pair : channels->pairs_) {
        Result<std::unique_ptr<KvPairChannel>> made = make(pair);
        if (!made.ok()) {
            return Status(made.status().code(), PairName(pair) + ": " + made.status().message());
        }
        if ((*made)->rank() != pair.nccl_rank) {
            return Internal(PairName(pair) + ": channel made for rank " +
                            std::to_string((*made)->rank()));
        }
        auto state = std::make_unique<PairState>();
        state->channel = std::move(*made);
        if (pair.nccl_rank == 0) {
            state->sender = std::make_unique<KvPairSender>(
                state->channel.get(), options.send_timeout_ms, options.max_offers_per_pair);
        }
        channels->states_.push_back(std::move(state));
    }
    return channels;
}

Result<KvNcclRankChannels::PairState*> KvNcclRankChannels::Find(std::string_view peer_instance,
                                                                int peer_rank, int nccl_rank) {
    for (size_t i = 0; i < pairs_.size(); ++i) {
        const KvNcclPairAssignment& pair = pairs_[i];
        if (pair.peer_instance != peer_instance || pair.peer_rank != peer_rank) continue;
        if (pair.nccl_rank != nccl_rank) {
            return InvalidArgument(PairName(pair) + ": asked to " +
                                   (nccl_rank == 0 ? "send" : "receive"));
        }
        return states_[i].get();
    }
    return NotFound("no KV NCCL pair with " + std::string(peer_instance) + " rank " +
                    std::to_string(peer_rank));
}

void KvNcclRankChannels::Abort(std::string_view peer_instance, int peer_rank, const Status& why) {
    for (size_t i = 0; i < pairs_.size(); ++i) {
        if (pairs_[i].peer_instance == peer_instance && pairs_[i].peer_rank == peer_rank)
            states_[i]->channel->Abort(why);
    }
}

Result<KvPairSender*> KvNcclRankChannels::Sender(std::string_view peer_instance, int peer_rank) {
    KV_ASSIGN_OR_RETURN(PairState * state, Find(peer_instance, peer_rank, 0));
    return state->sender.get();
}

Result<KvPairReceiver*> KvNcclRankChannels::Receiver(
    std::string_view peer_instance, int peer_rank, const KvPairReceiveLimits& limits,
    const KvPairReceiver::AnnounceReady& announce) {
    KV_ASSIGN_OR_RETURN(PairState * state, Find(peer_instance, peer_rank, 1));
    if (state->receiver == nullptr) {
        if (limits.max_blocks <= 0 || limits.bytes_per_block <= 0 || !announce) {
            return InvalidArgument("KV NCCL pair with " + std::string(peer_instance) + " rank " +
                                   std::to_string(peer_rank) +
                                   ": max_blocks=" + std::to_string(limits.max_blocks) +
                                   ", bytes_per_block=" + std::to_string(limits.bytes_per_block) +
                                   " must be > 0, with an announcement callback");
        }
        state->receiver = std::make_unique<KvPairReceiver>(state->channel.get(), limits, announce,
                                                           options_.receive_timeout_ms);
    }
    return state->receiver.get();
}

}  // namespace kvshard
