// KvPairHandoff (worker/kv_handoff_pairs.h).
#include "worker/kv_handoff_pairs.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>

#include "comm/kv_transport.h"
#include "comm/nccl_kv_pair_channel.h"
#include "comm/socket_kv_pair_channel.h"
#include "common/build_config.h"
#include "worker/kv_handoff.h"

namespace kvshard {
namespace {

std::string PairOf(const KvNcclPairAssignment& p) {
    return "KV pair with " + p.peer_instance + " rank " + std::to_string(p.peer_rank);
}

#if KVSHARD_WITH_CUDA
KvPairHandoff::MakePairChannel NcclMaker(int device) {
    return [device](const KvNcclPairAssignment& p, const std::function<bool()>& cancelled) {
        return MakeNcclKvPairChannel({.nccl_unique_id = p.nccl_unique_id,
                                      .rank = p.nccl_rank,
                                      .cuda_device = device,
                                      .init_timeout_ms = KvPairHandoff::kNcclJoinTimeoutMs,
                                      .cancelled = cancelled});
    };
}
#else
Result<KvPairHandoff::MakePairChannel> NcclMaker(int) {
    return InvalidArgument(
        "kv_transfer.path: nccl: this kvshard was built without CUDA, so without NCCL");
}
#endif

}  // namespace

std::string_view KvPairLinkName(KvPairLink link) {
    switch (link) {
        case KvPairLink::kSocket:
            return "socket";
        case KvPairLink::kNccl:
            return "nccl";
    }
    return "?";
}

Result<std::optional<KvPairHandoffSettings>> KvPairHandoffSettingsOf(
    const std::vector<std::pair<std::string, std::string>>& settings) {
    const std::string* pairs = nullptr;
    const std::string* link = nullptr;
    const std::string* timeout = nullptr;
    const std::string* first = nullptr;
    for (const auto& [key, value] : settings) {
        if (key == kKvNcclPairsSetting) pairs = &value;
        if (key == kKvPairLinkSetting) link = &value;
        if (key == kKvPairTimeoutSetting) timeout = &value;
        if (key == kKvPairFirstTransferSetting) first = &value;
    }
    if (pairs == nullptr) {
        if (link != nullptr) {
            return InvalidArgument("worker setting " + std::string(kKvPairLinkSetting) +
                                   " without " + std::string(kKvNcclPairsSetting));
        }
        return std::optional<KvPairHandoffSettings>();
    }
    KvPairHandoffSettings s;
    KV_ASSIGN_OR_RETURN(s.pairs, DecodeKvNcclPairs(*pairs));
    if (link == nullptr) {
        return InvalidArgument("worker setting " + std::string(kKvPairLinkSetting) +
                               ": missing beside " + std::string(kKvNcclPairsSetting));
    }
    if (*link == KvPairLinkName(KvPairLink::kSocket)) {
        s.link = KvPairLink::kSocket;
    } else if (*link == KvPairLinkName(KvPairLink::kNccl)) {
        s.link = KvPairLink::kNccl;
    } else {
        return InvalidArgument("worker setting " + std::string(kKvPairLinkSetting) + ": '" + *link +
                               "' is not one of socket, nccl");
    }
    if (timeout != nullptr) {
        int64_t ms = 0;
        auto [ptr, ec] = std::from_chars(timeout->data(), timeout->data() + timeout->size(), ms);
        if (ec != std::errc() || ptr != timeout->data() + timeout->size() || ms <= 0) {
            return InvalidArgument("worker setting " + std::string(kKvPairTimeoutSetting) + ": '" +
                                   *timeout + "' is not a positive number of milliseconds");
        }
        s.timeout_ms = ms;
    }
    if (first != nullptr) {
        auto [ptr, ec] =
            std::from_chars(first->data(), first->data() + first->size(), s.first_transfer_id);
        if (ec != std::errc() || ptr != first->data() + first->size()) {
            return InvalidArgument("worker setting " + std::string(kKvPairFirstTransferSetting) +
                                   ": '" + *first + "' is not a transfer id");
        }
    }
    return std::optional<KvPairHandoffSettings>(std::move(s));
}

Result<KvPairHandoff::MakePairChannel> KvPairHandoff::MakerOf(KvPairLink link,
                                                              const BackendConfig& backend) {
    const std::string backend_name(BackendKindName(backend.kind));
    switch (link) {
        case KvPairLink::kSocket:
            if (backend.kind != BackendKind::kCpu) {
                return InvalidArgument(
                    "KVSHARD_KV_PAIR_LINK=socket: the socket test link sends host memory and "
                    "this rank's KV pair buffers are " +
                    backend_name + " device memory; unset it (GPUs use NCCL)");
            }
            return MakePairChannel([](const KvNcclPairAssignment& p, const std::function<bool()>&) {
                return MakeSocketKvPairChannel(p.nccl_unique_id, p.nccl_rank);
            });
        case KvPairLink::kNccl:
            if (backend.kind != BackendKind::kCuda) {
                return InvalidArgument("kv_transfer.path: nccl: this rank runs the " +
                                       backend_name +
                                       " backend; NCCL pair channels send GPU memory (cuda)");
            }
            return NcclMaker(backend.device);
    }
    return InvalidArgument("kv_pair_link: unknown link");
}

KvPairHandoff::KvPairHandoff(MakePairChannel make, int64_t timeout_ms, std::string link_name,
                             KvPairPool pool, KvPairStaging staging, int64_t max_offer_bytes)
    : offer_buffers_(pool.backend, max_offer_bytes),
      make_(std::move(make)),
      timeout_ms_(timeout_ms),
      link_name_(std::move(link_name)),
      pool_(std::move(pool)),
      staging_(staging) {
    for (int64_t g : pool_.group_of_layer) num_groups_ = std::max(num_groups_, size_t(g + 1));
}

Status KvPairHandoff::CheckPairs(const std::vector<KvNcclPairAssignment>& pairs,
                                 const ShardLayout& layout) {
    const IndexRange held = layout.kv_heads;
    std::map<std::string, int64_t> received_heads;
    for (const KvNcclPairAssignment& p : pairs) {
        if (p.head_begin < held.begin || p.head_end > held.end) {
            return InvalidArgument(PairOf(p) + ": KV heads [" + std::to_string(p.head_begin) +
                                   ", " + std::to_string(p.head_end) +
                                   ") are not all held by this rank (" + layout.ToString() + ")");
        }
        if (p.nccl_rank == 1) received_heads[p.peer_instance] += p.head_end - p.head_begin;
    }
    for (const auto& [instance, heads] : received_heads) {
        if (heads != held.size()) {
            return InvalidArgument("KV pairs with " + instance + " carry " + std::to_string(heads) +
                                   " KV heads, this rank holds " + std::to_string(held.size()));
        }
    }
    return Status::Ok();
}

KvPairHandoff::Peer KvPairHandoff::MakePeer(std::vector<KvNcclPairAssignment> pairs,
                                            uint64_t first_transfer_id,
                                            const std::function<bool()>& cancelled) const {
    Peer peer;
    peer.pairs = pairs;
    peer.first_transfer_id = first_transfer_id;
    peer.received_any.assign(pairs.size(), false);
    peer.receives.assign(pairs.size(), 0);
    const KvNcclChannelsOptions options{.send_timeout_ms = timeout_ms_,
                                        .receive_timeout_ms = timeout_ms_,
                                        .max_offers_per_pair = 64};
    Result<std::unique_ptr<KvNcclRankChannels>> channels = KvNcclRankChannels::Create(
        std::move(pairs), [&](const KvNcclPairAssignment& p) { return make_(p, cancelled); },
        options);
    if (channels.ok()) {
        peer.channels = std::move(*channels);
    } else {
        peer.failed = channels.status();
    }
    return peer;
}

// The pairs grouped by peer instance, in the order of each instance's first pair (the plan
// groups a rank's pairs by instance, so each group keeps the plan's order of joins).
static std::vector<std::pair<std::string, std::vector<KvNcclPairAssignment>>> ByInstance(
    std::vector<KvNcclPairAssignment> pairs) {
    std::vector<std::pair<std::string, std::vector<KvNcclPairAssignment>>> out;
    for (KvNcclPairAssignment& p : pairs) {
        auto it = std::find_if(out.begin(), out.end(),
                               [&](const auto& g) { return g.first == p.peer_instance; });
        if (it == out.end()) it = out.insert(out.end(), {p.peer_instance, {}});
        it->second.push_back(std::move(p));
    }
    return out;
}

Result<std::unique_ptr<KvPairHandoff>> KvPairHandoff::Create(
    std::vector<KvNcclPairAssignment> pairs, const KvNcclRankChannels::MakeChannel& make,
    std::string link_name, int64_t timeout_ms, KvPairPool pool, int64_t max_offer_bytes,
    uint64_t first_transfer_id) {
    return Create(
        std::move(pairs),
        [make](const KvNcclPairAssignment& p, const std::function<bool()>&) { return make(p); },
        std::move(link_name), timeout_ms, std::move(pool), max_offer_bytes, first_transfer_id);
}

Result<std::unique_ptr<KvPairHandoff>> KvPairHandoff::Create(
    std::vector<KvNcclPairAssignment> pairs, MakePairChannel make, std::string link_name,
    int64_t timeout_ms, KvPairPool pool, int64_t max_offer_bytes, uint64_t first_transfer_id) {
    if (max_offer_bytes <= 0) {
        return InvalidArgument("KV pair path: max_offer_bytes=" + std::to_string(max_offer_bytes) +
                               " must be > 0");
    }
    if (timeout_ms <= 0) {
        return InvalidArgument("KV pair path: timeout_ms=" + std::to_string(timeout_ms) +
                               " must be > 0");
    }
    KV_ASSIGN_OR_RETURN(KvPairStaging staging, KvPairStaging::Of(pool.backend));
    KV_RETURN_IF_ERROR(CheckPairs(pairs, pool.layout));
    std::unique_ptr<KvPairHandoff> h(new KvPairHandoff(std::move(make), timeout_ms,
                                                       std::move(link_name), std::move(pool),
                                                       staging, max_offer_bytes));
    for (auto& [instance, group] : ByInstance(std::move(pairs))) {
        Peer peer = h->MakePeer(std::move(group), first_transfer_id);
        // At start the first failure is the rank's: it does not become Ready.
        if (peer.channels == nullptr) return peer.failed;
        h->peers_.emplace(instance, std::move(peer));
    }
    return h;
}

KvPairHandoff::~KvPairHandoff() {
    for (auto& join : joins_) join->cancel = true;
    for (auto& join : joins_) {
        if (join->thread.joinable()) join->thread.join();
    }
}

static Status NotMade(const std::string& instance, const Status& why) {
    return why.WithContext("KV pairs with instance " + instance +
                           " re-planned but not made (kv_transfer.path: nccl; they stay down "
                           "until the coordinator re-plans them again)");
}

void KvPairHandoff::CollectJoins() {
    for (auto it = joins_.begin(); it != joins_.end();) {
        Join& join = **it;
        std::optional<Peer> made;
        {
            std::lock_guard<std::mutex> lock(join.mu);
            if (!join.done) {
                ++it;
                continue;
            }
            made = std::move(join.made);
        }
        join.thread.join();
        if (join.current && made.has_value()) {
            if (made->channels == nullptr) {
                made->failed = NotMade(join.instance, made->failed);
                spdlog::error("{}", made->failed.ToString());
            } else {
                spdlog::info(
                    "KV pairs with instance {} joined: {} pair(s) on the {} link, "
                    "transfers from id {}",
                    join.instance, made->pairs.size(), link_name_, made->first_transfer_id);
            }
            peers_[join.instance] = std::move(*made);
        }
        it = joins_.erase(it);
    }
}

Status KvPairHandoff::Replan(std::vector<KvNcclPairAssignment> pairs, uint64_t first_transfer_id,
                             std::vector<std::string>* replanned, bool in_background) {
    CollectJoins();
    KV_RETURN_IF_ERROR(CheckPairs(pairs, pool_.layout));
    auto groups = ByInstance(std::move(pairs));
    auto drop = [&](const std::string& instance, Peer& old, const std::string& why) {
        if (old.channels != nullptr) {
            for (const KvNcclPairAssignment& p : old.pairs)
                old.channels->Abort(p.peer_instance, p.peer_rank, Aborted(why));
        }
        old.channels.reset();  // its senders drop what they held (offer_buffers_ takes it back)
        std::erase_if(offered_, [&](const auto& o) { return o.second == instance; });
        for (auto& join : joins_) {
            if (join->instance != instance) continue;
            join->current = false;
            join->cancel = true;  // its peer joins the new pairs, not these
        }
        if (replanned != nullptr) replanned->push_back(instance);
    };
    for (auto it = peers_.begin(); it != peers_.end();) {
        const bool kept = std::any_of(groups.begin(), groups.end(),
                                      [&](const auto& g) { return g.first == it->first; });
        if (kept) {
            ++it;
            continue;
        }
        drop(it->first, it->second, "the pairs with instance " + it->first + " were re-planned");
        it = peers_.erase(it);
    }
    Status first;
    for (auto& [instance, group] : groups) {
        auto it = peers_.find(instance);
        if (it != peers_.end() && it->second.pairs == group) continue;  // unchanged
        if (it != peers_.end()) {
            drop(instance, it->second, "the pairs with instance " + instance + " were re-planned");
            peers_.erase(it);
        } else if (replanned != nullptr) {
            replanned->push_back(instance);
        }
        const size_t n = group.size();
        if (in_background) {
            Peer waiting;
            waiting.pairs = group;
            waiting.first_transfer_id = first_transfer_id;
            waiting.failed = Unavailable("the KV pairs with instance " + instance +
                                         " are being joined (re-planned after it re-formed)");
            peers_.emplace(instance, std::move(waiting));
            auto join = std::make_unique<Join>();
            join->instance = instance;
            Join* j = join.get();
            join->thread = std::thread([this, j, group = std::move(group), first_transfer_id] {
                Peer made = MakePeer(group, first_transfer_id, [j] { return j->cancel.load(); });
                std::lock_guard<std::mutex> lock(j->mu);
                j->made = std::move(made);
                j->done = true;
            });
            joins_.push_back(std::move(join));
            spdlog::info(
                "KV pairs with instance {} re-planned: joining {} pair(s) on the {} link "
                "in the background, transfers from id {}",
                instance, n, link_name_, first_transfer_id);
            continue;
        }
        Peer peer = MakePeer(std::move(group), first_transfer_id);
        if (peer.channels == nullptr) {
            peer.failed = NotMade(instance, peer.failed);
            spdlog::error("{}", peer.failed.ToString());
            if (first.ok()) first = peer.failed;
        } else {
            spdlog::info(
                "KV pairs with instance {} re-planned: {} pair(s) on the {} link, "
                "transfers from id {}",
                instance, n, link_name_, first_transfer_id);
        }
        peers_.emplace(instance, std::move(peer));
    }
    return first;
}

Result<KvPairHandoff::Peer*> KvPairHandoff::PeerFor(const std::string& instance,
                                                    uint64_t transfer_id,
                                                    const std::string& op_what) {
    auto it = peers_.find(instance);
    if (it == peers_.end()) return static_cast<Peer*>(nullptr);
    Peer& peer = it->second;
    if (peer.channels == nullptr) {
        return Status(peer.failed.code(), op_what + peer.failed.message());
    }
    if (transfer_id < peer.first_transfer_id) {
        return Status(StatusCode::kUnavailable,
                      op_what + "planned before the KV pairs with instance " + instance +
                          " were re-planned (they carry transfers from id " +
                          std::to_string(peer.first_transfer_id) + " on)");
    }
    return &peer;
}

KvPairHandoff::Layout KvPairHandoff::LayoutOf(const std::vector<std::span<const int32_t>>& blocks,
                                              IndexRange heads) const {
    const KvPoolConfig& c = pool_.pool->config();
    Layout out;
    out.bytes_per_block_layer = KvPieceBytes({.layer_begin = 0,
                                              .layer_end = 1,
                                              .head_begin = static_cast<int32_t>(heads.begin),
                                              .head_end = static_cast<int32_t>(heads.end),
                                              .num_blocks = 1,
                                              .block_size = static_cast<int32_t>(c.block_size),
                                              .head_dim = static_cast<int32_t>(c.head_dim),
                                              .dtype = c.storage});
    const std::vector<int64_t>& group_of = pool_.group_of_layer;
    const auto num_layers = static_cast<int64_t>(group_of.size());
    for (int64_t begin = 0; begin < num_layers;) {
        const int64_t g = group_of[static_cast<size_t>(begin)];
        int64_t end = begin + 1;
        while (end < num_layers && group_of[static_cast<size_t>(end)] == g) ++end;
        const std::span<const int32_t> b = blocks[static_cast<size_t>(g)];
        if (!b.empty()) {
            for (KvCopyRun run : KvCopyRuns(*pool_.pool, pool_.layout, b, begin, end, heads)) {
                run.piece_offset += out.bytes;
                out.runs.push_back(run);
            }
            const int64_t block_layers = static_cast<int64_t>(b.size()) * (end - begin);
            out.block_layers += block_layers;
            out.bytes += block_layers * out.bytes_per_block_layer;
        }
        begin = end;
    }
    return out;
}

Result<int64_t> KvPairHandoff::Offer(const KvSendOp& op,
                                     const std::vector<std::span<const int32_t>>& blocks) {
    CollectJoins();
    const std::string what = "KV pair send of transfer " + std::to_string(op.transfer_id) + ": ";
    if (blocks.size() != num_groups_) {
        return InvalidArgument(what + std::to_string(blocks.size()) +
                               " block tables for the pool's KV cache groups");
    }
    // Every pair's buffer packed on the rank's stream (after the step's writes of the blocks),
    // then one wait, then the offers: a sender may send as soon as it holds a buffer.
    struct Packed {
        const KvNcclPairAssignment* pair;
        KvPairSender* sender;
        Layout layout;
        KvPairBuffers::Held buffer;
    };
    std::vector<Packed> packed;
    auto failed_earlier = [&](const KvNcclPairAssignment& p, const Status& failed) {
        return Status(failed.code(), what + PairOf(p) + " failed earlier (" + failed.message() +
                                         "); the coordinator re-plans the pairs with "
                                         "instance " +
                                         p.peer_instance);
    };
    KV_ASSIGN_OR_RETURN(Peer * peer, PeerFor(op.dst_instance, op.transfer_id, what));
    if (peer == nullptr) return int64_t{0};
    const uint8_t* base = pool_.pool->BlockData(0);
    for (const KvNcclPairAssignment& p : peer->pairs) {
        if (p.nccl_rank != 0) continue;
        KV_ASSIGN_OR_RETURN(KvPairSender * sender,
                            peer->channels->Sender(p.peer_instance, p.peer_rank));
        if (Status failed = sender->failure(); !failed.ok()) return failed_earlier(p, failed);
        Layout layout = LayoutOf(blocks, {p.head_begin, p.head_end});
        if (layout.bytes == 0) continue;
        Result<KvPairBuffers::Held> buffer = offer_buffers_.Take(layout.bytes);
        if (!buffer.ok()) return buffer.status().WithContext(what + PairOf(p));
        KV_RETURN_IF_ERROR(staging_.Pack(layout.runs, base, (*buffer)->As<uint8_t>()));
        packed.push_back({&p, sender, std::move(layout), std::move(*buffer)});
    }
    if (packed.empty()) return int64_t{0};
    KV_RETURN_IF_ERROR(pool_.backend->Synchronize());
    std::vector<KvPairSender*> offered;
    auto withdraw = [&] {
        for (KvPairSender* s : offered) (void)s->Discard(op.transfer_id);
    };
    int64_t bytes = 0;
    for (Packed& k : packed) {
        const std::string pair = PairOf(*k.pair);
        const uint64_t id = op.transfer_id;
        const void* src = k.buffer->data();
        // The buffer goes back to offer_buffers_ when the sender drops `done` (sent, discarded,
        // or the pair failed), or here when the offer is refused.
        Status st = k.sender->Offer(
            {.transfer_id = id,
             .num_blocks = k.layout.block_layers,
             .bytes_per_block = k.layout.bytes_per_block_layer},
            src, [buffer = std::move(k.buffer), pair, id](const Status& done) {
                if (!done.ok() && done.code() != StatusCode::kAborted) {
                    spdlog::warn("{}: transfer {} not sent: {}", pair, id, done.ToString());
                }
            });
        if (!st.ok()) {
            withdraw();
            if (Status failed = k.sender->failure(); !failed.ok())
                return failed_earlier(*k.pair, failed);
            return st.WithContext(what + pair);
        }
        offered.push_back(k.sender);
        bytes += k.layout.bytes;
    }
    offered_[op.transfer_id] = op.dst_instance;
    return bytes;
}

void KvPairHandoff::Ready(uint64_t transfer_id) {
    CollectJoins();
    auto it = offered_.find(transfer_id);
    if (it == offered_.end()) return;
    const std::string instance = std::move(it->second);
    offered_.erase(it);
    auto peer = peers_.find(instance);
    if (peer == peers_.end() || peer->second.channels == nullptr) return;
    for (const KvNcclPairAssignment& p : peer->second.pairs) {
        if (p.nccl_rank != 0) continue;
        Result<KvPairSender*> sender = peer->second.channels->Sender(p.peer_instance, p.peer_rank);
        if (!sender.ok()) continue;
        if (Status st = (*sender)->Ready(transfer_id); !st.ok())
            spdlog::warn("{}: ready for transfer {}: {}", PairOf(p), transfer_id, st.ToString());
    }
}

void KvPairHandoff::Discard(uint64_t transfer_id) {
    CollectJoins();
    auto it = offered_.find(transfer_id);
    if (it == offered_.end()) return;
    const std::string instance = std::move(it->second);
    offered_.erase(it);
    auto peer = peers_.find(instance);
    if (peer == peers_.end() || peer->second.channels == nullptr) return;
    for (const KvNcclPairAssignment& p : peer->second.pairs) {
        if (p.nccl_rank != 0) continue;
        Result<KvPairSender*> sender = peer->second.channels->Sender(p.peer_instance, p.peer_rank);
        // Not held any more (sent, or the pair failed): nothing to drop.
        if (sender.ok()) (void)(*sender)->Discard(transfer_id);
    }
}

void KvPairHandoff::Abandon(const KvRecvOp& op, const Status& why) {
    CollectJoins();
    auto peer = peers_.find(op.src_instance);
    if (peer == peers_.end() || peer->second.channels == nullptr) return;
    // A transfer older than the pairs never touched them (PeerFor refuses it): they stay up.
    if (op.transfer_id < peer->second.first_transfer_id) return;
    for (const KvNcclPairAssignment& p : peer->second.pairs) {
        if (p.nccl_rank != 1) continue;
        peer->second.channels->Abort(p.peer_instance, p.peer_rank,
                                     Aborted("transfer " + std::to_string(op.transfer_id) +
                                             " given up on this rank: " + why.ToString()));
    }
    peer->second.abandoned = true;
}

std::optional<uint64_t> KvPairHandoff::DownPairs(const std::string& instance) {
    CollectJoins();
    auto it = peers_.find(instance);
    if (it == peers_.end()) return std::nullopt;
    const Peer& peer = it->second;
    const bool joining = std::any_of(joins_.begin(), joins_.end(), [&](const auto& j) {
        return j->current && j->instance == instance;
    });
    if (joining) return std::nullopt;
    if (peer.channels == nullptr || peer.abandoned) return peer.first_transfer_id;
    for (const KvNcclPairAssignment& p : peer.pairs) {
        if (p.nccl_rank != 0) continue;
        Result<KvPairSender*> sender = peer.channels->Sender(p.peer_instance, p.peer_rank);
        if (sender.ok() && !(*sender)->failure().ok()) return peer.first_transfer_id;
    }
    return std::nullopt;
}

Result<int64_t> KvPairHandoff::Receive(const KvRecvOp& op,
                                       const std::vector<std::span<const int32_t>>& blocks) {
    CollectJoins();
    const KvPoolConfig& c = pool_.pool->config();
    uint8_t* base = pool_.pool->MutableBlockData(0);
    int64_t bytes = 0;
    bool any = false;
    const std::string what = "KV pair receive of transfer " + std::to_string(op.transfer_id) + ": ";
    // Refused here (pairs down, or a transfer older than them) nothing was received: the pairs'
    // order is intact, so they are not aborted.
    KV_ASSIGN_OR_RETURN(Peer * peer, PeerFor(op.src_instance, op.transfer_id, what));
    const std::vector<KvNcclPairAssignment> none;
    const auto& pairs = peer != nullptr ? peer->pairs : none;
    for (size_t i = 0; i < pairs.size(); ++i) {
        const KvNcclPairAssignment& p = pairs[i];
        if (p.nccl_rank != 1) continue;
        any = true;
        const Layout layout = LayoutOf(blocks, {p.head_begin, p.head_end});
        if (layout.bytes == 0) continue;
        Status st;
        // The coordinator announced this receive when it planned it (kv_ready), so the
        // protocol's announcement here has nothing left to do.
        Result<KvPairReceiver*> receiver = peer->channels->Receiver(
            p.peer_instance, p.peer_rank,
            {.max_blocks = c.num_blocks * static_cast<int64_t>(pool_.group_of_layer.size()),
             .bytes_per_block = layout.bytes_per_block_layer},
            [](uint64_t) { return Status::Ok(); });
        if (!receiver.ok()) st = receiver.status();
        if (st.ok() && receive_buffer_.bytes() < static_cast<size_t>(layout.bytes)) {
            // The last unpack was waited for: the old buffer is free.
            receive_buffer_ = BackendBuffer();
            Result<BackendBuffer> grown =
                pool_.backend->Allocate(static_cast<size_t>(KvPairBufferClass(layout.bytes)));
            if (grown.ok()) {
                receive_buffer_ = std::move(*grown);
            } else {
                st = grown.status();
            }
        }
        if (st.ok()) {
            // The pair's order is the coordinator's (module comment): the receiver numbers its
            // receives in the order it posts them, which its protocol requires to increase.
            // Receive returns once the bytes are in the buffer (NCCL: its stream waited for).
            st = (*receiver)->Receive({.transfer_id = ++peer->receives[i],
                                       .num_blocks = layout.block_layers,
                                       .bytes_per_block = layout.bytes_per_block_layer},
                                      receive_buffer_.data(), receive_buffer_.bytes());
        }
        if (st.ok()) st = staging_.Unpack(layout.runs, receive_buffer_.As<uint8_t>(), base);
        if (st.ok()) st = pool_.backend->Synchronize();
        if (!st.ok()) {
            const Status failed = st.WithContext("KV pair receive of transfer " +
                                                 std::to_string(op.transfer_id) + ": " + PairOf(p));
            Abandon(op, failed);
            return failed;
        }
        if (!peer->received_any[i]) {
            peer->received_any[i] = true;
            spdlog::info("{}: first transfer received over the {} link ({} bytes)", PairOf(p),
                         link_name_, layout.bytes);
        }
        bytes += layout.bytes;
    }
    if (!any) {
        return NotFound(
            "KV pair receive of transfer " + std::to_string(op.transfer_id) +
            ": this rank has no pair with " +
            (op.src_instance.empty() ? "an unnamed instance" : "instance " + op.src_instance));
    }
    return bytes;
}

}  // namespace kvshard
