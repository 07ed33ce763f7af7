// A worker rank's NCCL KV handoff pairs (worker/kv_handoff_nccl_channels.h) made from the pairs
// PlanKvNcclPairs hands it, over in-memory links that stand in for the pair communicators (one
// link per unique id): every pair of a prefill rank and a decode rank moves a transfer through
// the protocol, the channels are made in plan order, a pair is found by its peer and only in its
// direction, and a channel that cannot be made fails Create naming the pair.
#include "worker/kv_handoff_nccl_channels.h"

#include <gtest/gtest.h>

#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "worker/kv_handoff_nccl_pairs.h"

namespace kvshard {
namespace {

ModelSpec Spec(int64_t kv_heads) {
    ModelSpec s;
    s.num_heads = kv_heads * 2;
    s.num_kv_heads = kv_heads;
    s.head_dim = 8;
    s.hidden_size = s.num_heads * 8;
    s.ffn_size = 64;
    s.vocab_size = 32;
    s.num_layers = 2;
    return s;
}

// One in-memory link per unique id, shared by the pair's two ranks.
class FakeComms {
  public:
    KvNcclRankChannels::MakeChannel Maker(std::vector<std::string>* made_order) {
        return [this, made_order](
                   const KvNcclPairAssignment& pair) -> Result<std::unique_ptr<KvPairChannel>> {
            if (made_order != nullptr) made_order->push_back(pair.nccl_unique_id);
            std::unique_ptr<InMemoryKvPairLink>& link = links_[pair.nccl_unique_id];
            if (link == nullptr) link = std::make_unique<InMemoryKvPairLink>();
            return link->Borrow(pair.nccl_rank);
        };
    }

  private:
    std::map<std::string, std::unique_ptr<InMemoryKvPairLink>> links_;
};

Result<std::vector<KvNcclPair>> Plan(int prefill_tp, int decode_tp) {
    int next = 0;
    return PlanKvNcclPairs(Spec(4), {{"prefill-0", prefill_tp}}, {{"decode-0", decode_tp}},
                           [&next]() -> Result<std::string> {
                               std::string id(kKvNcclUniqueIdBytes, '\0');
                               id[0] = static_cast<char>(++next);
                               return id;
                           });
}

TEST(KvNcclRankChannels, EveryPairMovesATransferAcrossTpShapes) {
    for (const auto& [prefill_tp, decode_tp] : {std::pair{1, 1}, {2, 1}, {1, 2}, {2, 4}, {4, 2}}) {
        SCOPED_TRACE(std::to_string(prefill_tp) + " -> " + std::to_string(decode_tp));
        Result<std::vector<KvNcclPair>> plan = Plan(prefill_tp, decode_tp);
        ASSERT_TRUE(plan.ok()) << plan.status().ToString();
        FakeComms comms;
        std::vector<std::unique_ptr<KvNcclRankChannels>> prefill, decode;
        for (int r = 0; r < prefill_tp; ++r) {
            auto made = KvNcclRankChannels::Create(KvNcclPairsOfRank(*plan, "prefill-0", r),
                                                   comms.Maker(nullptr), {});
            ASSERT_TRUE(made.ok()) << made.status().ToString();
            prefill.push_back(std::move(*made));
        }
        for (int r = 0; r < decode_tp; ++r) {
            auto made = KvNcclRankChannels::Create(KvNcclPairsOfRank(*plan, "decode-0", r),
                                                   comms.Maker(nullptr), {});
            ASSERT_TRUE(made.ok()) << made.status().ToString();
            decode.push_back(std::move(*made));
        }
        uint64_t id = 0;
        for (const KvNcclPair& pair : *plan) {
            ++id;
            Result<KvPairSender*> sender =
                prefill[pair.src_rank]->Sender("decode-0", pair.dst_rank);
            ASSERT_TRUE(sender.ok()) << sender.status().ToString();
            const int64_t per_block = (pair.heads.end - pair.heads.begin) * 32;
            std::vector<char> src(static_cast<size_t>(2 * per_block));
            for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i + id);
            std::promise<Status> done;
            ASSERT_TRUE((*sender)
                            ->Offer({id, 2, per_block}, src.data(),
                                    [&done](const Status& s) { done.set_value(s); })
                            .ok());
            KvPairSender* s = *sender;
            Result<KvPairReceiver*> receiver =
                decode[pair.dst_rank]->Receiver("prefill-0", pair.src_rank, {4, per_block},
                                                [s](uint64_t t) { return s->Ready(t); });
            ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
            std::vector<char> dst(src.size());
            const Status got = (*receiver)->Receive({id, 2, per_block}, dst.data(), dst.size());
            ASSERT_TRUE(got.ok()) << got.ToString();
            EXPECT_EQ(dst, src);
            EXPECT_TRUE(done.get_future().get().ok());
        }
    }
}

TEST(KvNcclRankChannels, MadeInPlanOrderAndFoundOnlyInTheirDirection) {
    Result<std::vector<KvNcclPair>> plan = Plan(2, 4);
    ASSERT_TRUE(plan.ok());
    const std::vector<KvNcclPairAssignment> mine = KvNcclPairsOfRank(*plan, "prefill-0", 1);
    ASSERT_GE(mine.size(), 2u);
    FakeComms comms;
    std::vector<std::string> order;
    auto made = KvNcclRankChannels::Create(mine, comms.Maker(&order), {});
    ASSERT_TRUE(made.ok());
    std::vector<std::string> expected;
    for (const auto& pair : mine) expected.push_back(pair.nccl_unique_id);
    EXPECT_EQ(order, expected);
    KvNcclRankChannels& channels = **made;
    EXPECT_TRUE(channels.Sender("decode-0", mine[0].peer_rank).ok());
    EXPECT_EQ(channels.Sender("decode-1", mine[0].peer_rank).status().code(),
              StatusCode::kNotFound);
    EXPECT_EQ(channels.Sender("decode-0", 99).status().code(), StatusCode::kNotFound);
    // A prefill rank only sends.
    EXPECT_EQ(
        channels
            .Receiver("decode-0", mine[0].peer_rank, {4, 64}, [](uint64_t) { return Status::Ok(); })
            .status()
            .code(),
        StatusCode::kInvalidArgument);
}

TEST(KvNcclRankChannels, RefusesBadPairsAndNamesThePairThatFailed) {
    Result<std::vector<KvNcclPair>> plan = Plan(1, 2);
    ASSERT_TRUE(plan.ok());
    std::vector<KvNcclPairAssignment> mine = KvNcclPairsOfRank(*plan, "prefill-0", 0);
    ASSERT_EQ(mine.size(), 2u);
    FakeComms comms;
    // The second pair's peer cannot be reached.
    int calls = 0;
    auto failing = [&](const KvNcclPairAssignment& pair) -> Result<std::unique_ptr<KvPairChannel>> {
        if (++calls == 2) return Status(StatusCode::kDeadlineExceeded, "peer did not join");
        return comms.Maker(nullptr)(pair);
    };
    auto made = KvNcclRankChannels::Create(mine, failing, {});
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().code(), StatusCode::kDeadlineExceeded);
    EXPECT_NE(made.status().message().find("decode-0 rank " + std::to_string(mine[1].peer_rank)),
              std::string::npos)
        << made.status().ToString();
    // Two pairs with one peer.
    std::vector<KvNcclPairAssignment> twice = {mine[0], mine[0]};
    EXPECT_EQ(KvNcclRankChannels::Create(twice, comms.Maker(nullptr), {}).status().code(),
              StatusCode::kInvalidArgument);
    // Options that are not positive.
    KvNcclChannelsOptions options;
    options.max_offers_per_pair = 0;
    EXPECT_EQ(KvNcclRankChannels::Create(mine, comms.Maker(nullptr), options).status().code(),
              StatusCode::kInvalidArgument);
    // A receiver needs its pool's limits.
    std::vector<KvNcclPairAssignment> decode_side = KvNcclPairsOfRank(*plan, "decode-0", 0);
    auto receiving = KvNcclRankChannels::Create(decode_side, comms.Maker(nullptr), {});
    ASSERT_TRUE(receiving.ok());
    EXPECT_EQ((*receiving)
                  ->Receiver("prefill-0", 0, {0, 64}, [](uint64_t) { return Status::Ok(); })
                  .status()
                  .code(),
              StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvshard
