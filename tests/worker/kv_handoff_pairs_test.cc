// The KV pair path's worker side (worker/kv_handoff_pairs.h) on CPU pools over in-memory pair
// links: a prefill rank's blocks offered, readied and received by decode ranks of another tp,
// each receiving rank's blocks then holding exactly the prefill rank's bytes of its heads (the
// re-shard); a discarded offer leaves the pair usable; a dead peer fails the receive and later
// offers name why; the settings a RegisterAck carries decode, and bad ones are refused.
#include "worker/kv_handoff_pairs.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "kernels/cpu_ops.h"
#include "kernels/paged_attention.h"
#include "tests/worker/kv_pair_test_pools.h"
#include "worker/kv_handoff_nccl_pairs.h"

namespace kvshard {
namespace {

constexpr int64_t kLayers = testing::kPairLayers, kBlockSize = testing::kPairBlockSize,
                  kHeadDim = testing::kPairHeadDim, kBlocks = testing::kPairBlocks;

ModelSpec Spec() { return testing::PairSpec(); }

// One rank: a CPU backend and a pool of random bytes holding its heads.
struct Rank {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<KvPool> pool;
    ShardLayout layout;
};

Rank MakeRank(int rank, int tp, uint32_t seed) {
    Rank r;
    Result<std::unique_ptr<Backend>> b = MakeBackend({.kind = BackendKind::kCpu});
    KV_CHECK(b.ok()) << b.status().ToString();
    r.backend = std::move(*b);
    r.layout = testing::PairLayout(rank, tp);
    r.pool = testing::RandomPairPool(r.layout, *r.backend, seed);
    return r;
}

// K then V of global head `head`, layer `layer`, block `block`.
std::vector<uint8_t> HeadBytes(const Rank& r, int64_t block, int64_t layer, int64_t head) {
    return testing::PairHeadBytes(*r.pool, r.layout, block, layer, head);
}

// Links keyed by pair id; each side takes its endpoint.
struct Links {
    std::map<std::string, std::unique_ptr<InMemoryKvPairLink>> by_id;
    KvNcclRankChannels::MakeChannel Maker() {
        return [this](const KvNcclPairAssignment& p) -> Result<std::unique_ptr<KvPairChannel>> {
            auto& link = by_id[p.nccl_unique_id];
            if (link == nullptr) link = std::make_unique<InMemoryKvPairLink>();
            return link->Borrow(p.nccl_rank);
        };
    }
};

struct Cluster {
    Links links;
    std::vector<Rank> prefill, decode;
    std::vector<std::unique_ptr<KvPairHandoff>> send, recv;
};

// Prefill tp `ptp` and decode tp `dtp`, every rank's pair path made.
void Make(Cluster* c, int ptp, int dtp) {
    int next_id = 0;
    Result<std::vector<KvNcclPair>> pairs = PlanKvNcclPairs(
        Spec(), {{"prefill", ptp}}, {{"decode", dtp}}, [&]() -> Result<std::string> {
            std::string id = std::to_string(next_id++);
            id.resize(kKvNcclUniqueIdBytes, '.');
            return id;
        });
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    for (int r = 0; r < ptp; ++r) c->prefill.push_back(MakeRank(r, ptp, 10 + r));
    for (int r = 0; r < dtp; ++r) c->decode.push_back(MakeRank(r, dtp, 20 + r));
    for (int side = 0; side < 2; ++side) {
        std::vector<Rank>& ranks = side == 0 ? c->prefill : c->decode;
        for (size_t r = 0; r < ranks.size(); ++r) {
            Result<std::unique_ptr<KvPairHandoff>> h = KvPairHandoff::Create(
                KvNcclPairsOfRank(*pairs, side == 0 ? "prefill" : "decode", int(r)),
                c->links.Maker(), "in-memory", 2'000,
                {.backend = ranks[r].backend.get(),
                 .pool = ranks[r].pool.get(),
                 .layout = ranks[r].layout,
                 .group_of_layer = {0, 0}});
            ASSERT_TRUE(h.ok()) << h.status().ToString();
            (side == 0 ? c->send : c->recv).push_back(std::move(*h));
        }
    }
}

KvSendOp SendOp(uint64_t id) { return testing::PairSendOp(id); }
KvRecvOp RecvOp(uint64_t id) { return testing::PairRecvOp(id); }

class KvPairHandoffTp : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(KvPairHandoffTp, ReceivingRanksHoldTheSendersBytesOfTheirHeads) {
    const auto [ptp, dtp] = GetParam();
    Cluster c;
    Make(&c, ptp, dtp);
    const std::vector<int32_t> from = {3, 1, 4}, to = {0, -1, 5};  // block 1 already held
    for (auto& s : c.send) {
        Result<int64_t> bytes = s->Offer(SendOp(7), {std::span<const int32_t>(from)});
        ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
    }
    for (auto& s : c.send) s->Ready(7);
    for (size_t d = 0; d < c.recv.size(); ++d) {
        Result<int64_t> bytes = c.recv[d]->Receive(RecvOp(7), {std::span<const int32_t>(to)});
        ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
        EXPECT_GT(*bytes, 0);
    }
    for (const Rank& dst : c.decode) {
        for (int64_t h = dst.layout.kv_heads.begin; h < dst.layout.kv_heads.end; ++h) {
            // The owner: the lowest prefill rank holding h.
            const Rank* owner = nullptr;
            for (const Rank& p : c.prefill) {
                if (owner == nullptr && p.layout.kv_heads.Contains(h)) owner = &p;
            }
            for (size_t i = 0; i < from.size(); ++i) {
                if (to[i] < 0) continue;
                for (int64_t l = 0; l < kLayers; ++l) {
                    EXPECT_EQ(HeadBytes(dst, to[i], l, h), HeadBytes(*owner, from[i], l, h))
                        << "head " << h << " block " << from[i] << " layer " << l;
                }
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Tps, KvPairHandoffTp,
                         ::testing::Values(std::pair{1, 1}, std::pair{1, 2}, std::pair{2, 1},
                                           std::pair{2, 4}));

TEST(KvPairHandoff, DiscardedOfferLeavesThePairUsable) {
    Cluster c;
    Make(&c, 1, 1);
    const std::vector<int32_t> blocks = {2};
    ASSERT_TRUE(c.send[0]->Offer(SendOp(5), {std::span<const int32_t>(blocks)}).ok());
    c.send[0]->Discard(5);
    c.send[0]->Ready(5);  // discarded: nothing to send, the pair stays in order
    ASSERT_TRUE(c.send[0]->Offer(SendOp(6), {std::span<const int32_t>(blocks)}).ok());
    c.send[0]->Ready(6);
    const std::vector<int32_t> into = {3};
    ASSERT_TRUE(c.recv[0]->Receive(RecvOp(6), {std::span<const int32_t>(into)}).ok());
    EXPECT_EQ(HeadBytes(c.decode[0], 3, 1, 2), HeadBytes(c.prefill[0], 2, 1, 2));
}

TEST(KvPairHandoff, DeadPeerFailsTheReceiveAndLaterOffersSayWhy) {
    Cluster c;
    Make(&c, 1, 1);
    const std::vector<int32_t> blocks = {2};
    ASSERT_TRUE(c.send[0]->Offer(SendOp(5), {std::span<const int32_t>(blocks)}).ok());
    c.links.by_id.begin()->second->Kill(0);
    c.send[0]->Ready(5);
    Result<int64_t> got = c.recv[0]->Receive(RecvOp(5), {std::span<const int32_t>(blocks)});
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().ToString();
    // The sender's thread sees the failure on its own (its send of 5): until it has, an offer
    // may still be taken (and is dropped here).
    Result<int64_t> again = int64_t{0};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
        again = c.send[0]->Offer(SendOp(6), {std::span<const int32_t>(blocks)});
        if (!again.ok()) break;
        c.send[0]->Discard(6);
        std::this_thread::yield();
    }
    ASSERT_FALSE(again.ok());
    EXPECT_NE(again.status().message().find("the coordinator re-plans the pairs with instance "
                                            "decode"),
              std::string::npos)
        << again.status().ToString();
    // Both sides say their pairs are down, for the coordinator to re-plan them.
    EXPECT_EQ(c.send[0]->DownPairs("decode"), std::optional<uint64_t>(0));
    EXPECT_EQ(c.recv[0]->DownPairs("prefill"), std::optional<uint64_t>(0));
}

TEST(KvPairHandoff, ReceiveFromAnInstanceWithoutPairsIsRefused) {
    Cluster c;
    Make(&c, 1, 1);
    KvRecvOp op = RecvOp(3);
    op.src_instance = "elsewhere";
    const std::vector<int32_t> blocks = {1};
    EXPECT_EQ(c.recv[0]->Receive(op, {std::span<const int32_t>(blocks)}).status().code(),
              StatusCode::kNotFound);
}

TEST(KvPairHandoffSettings, DecodeAndRefuse) {
    using Settings = std::vector<std::pair<std::string, std::string>>;
    Result<std::optional<KvPairHandoffSettings>> none = KvPairHandoffSettingsOf({{"a", "b"}});
    ASSERT_TRUE(none.ok());
    EXPECT_FALSE(none->has_value());
    KvNcclPairAssignment p{.peer_instance = "decode",
                           .peer_rank = 0,
                           .nccl_rank = 0,
                           .head_begin = 0,
                           .head_end = 4,
                           .nccl_unique_id = std::string(kKvNcclUniqueIdBytes, 'x')};
    const std::string pairs = EncodeKvNcclPairs({p});
    Result<std::optional<KvPairHandoffSettings>> ok = KvPairHandoffSettingsOf(Settings{
        {"kv_nccl_pairs", pairs}, {"kv_pair_link", "socket"}, {"kv_pair_timeout_ms", "250"}});
    ASSERT_TRUE(ok.ok()) << ok.status().ToString();
    ASSERT_TRUE(ok->has_value());
    EXPECT_EQ((*ok)->link, KvPairLink::kSocket);
    EXPECT_EQ((*ok)->timeout_ms, 250);
    EXPECT_EQ((*ok)->pairs, std::vector<KvNcclPairAssignment>{p});
    for (const Settings& bad :
         {Settings{{"kv_nccl_pairs", pairs}}, Settings{{"kv_pair_link", "socket"}},
          Settings{{"kv_nccl_pairs", pairs}, {"kv_pair_link", "carrier pigeon"}},
          Settings{
              {"kv_nccl_pairs", pairs}, {"kv_pair_link", "socket"}, {"kv_pair_timeout_ms", "0"}},
          Settings{{"kv_nccl_pairs", "junk"}, {"kv_pair_link", "socket"}}}) {
        EXPECT_FALSE(KvPairHandoffSettingsOf(bad).ok());
    }
}

TEST(KvPairHandoff, PairsOfHeadsThisRankDoesNotHoldAreRefused) {
    Rank r = MakeRank(0, 2, 1);  // heads [0, 2)
    KvNcclPairAssignment p{.peer_instance = "prefill",
                           .peer_rank = 0,
                           .nccl_rank = 1,
                           .head_begin = 1,
                           .head_end = 3,
                           .nccl_unique_id = std::string(kKvNcclUniqueIdBytes, 'x')};
    Links links;
    Result<std::unique_ptr<KvPairHandoff>> h =
        KvPairHandoff::Create({p}, links.Maker(), "in-memory", 1'000,
                              {.backend = r.backend.get(),
                               .pool = r.pool.get(),
                               .layout = r.layout,
                               .group_of_layer = {0, 0}});
    EXPECT_EQ(h.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvshard
