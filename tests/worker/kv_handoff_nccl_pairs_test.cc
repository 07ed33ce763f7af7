// The NCCL KV handoff's pairs (worker/kv_handoff_nccl_pairs.h) planned with fake ids: one pair per
// KvReshardPlan message of every (prefill, decode) instance pair, each with its own id, seen from
// both of its ranks (the sender as NCCL rank 0, the receiver as 1, the same id and heads), and the
// bound on a rank's pairs.
#include "worker/kv_handoff_nccl_pairs.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "worker/kv_handoff.h"

namespace kvshard {
namespace {

ModelSpec HeadsSpec(int64_t heads, int64_t kv_heads) {
    ModelSpec s;
    s.num_heads = heads;
    s.num_kv_heads = kv_heads;
    s.head_dim = 8;
    s.hidden_size = heads * 8;
    s.ffn_size = 64;
    s.vocab_size = 32;
    s.num_layers = 2;
    return s;
}

// Ids "0", "1", ... padded to an NCCL id's length: distinct, and telling the order they were made.
struct FakeIds {
    int made = 0;
    Result<std::string> operator()() {
        std::string id = std::to_string(made++);
        id.resize(kKvNcclUniqueIdBytes, '.');
        return id;
    }
};

TEST(KvNcclPairsPlan, OnePairPerReshardMessageOfEveryInstancePair) {
    const ModelSpec spec = HeadsSpec(8, 4);
    const std::vector<KvNcclInstance> prefill = {{"p0", 2}, {"p1", 1}};
    const std::vector<KvNcclInstance> decode = {{"d0", 1}, {"d1", 4}};
    FakeIds ids;
    Result<std::vector<KvNcclPair>> pairs =
        PlanKvNcclPairs(spec, prefill, decode, [&] { return ids(); });
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    std::vector<KvNcclPair> expected;
    for (const KvNcclInstance& p : prefill) {
        for (const KvNcclInstance& d : decode) {
            Result<std::vector<KvReshardMessage>> plan = KvReshardPlan(spec, p.tp, d.tp);
            ASSERT_TRUE(plan.ok());
            for (const KvReshardMessage& m : *plan)
                expected.push_back({p.name, m.src_rank, d.name, m.dst_rank, m.heads, ""});
        }
    }
    ASSERT_EQ(pairs->size(), expected.size());
    std::set<std::string> distinct;
    for (size_t i = 0; i < expected.size(); ++i) {
        KvNcclPair got = (*pairs)[i];
        EXPECT_EQ(got.nccl_unique_id.size(), kKvNcclUniqueIdBytes);
        distinct.insert(got.nccl_unique_id);
        got.nccl_unique_id.clear();
        EXPECT_EQ(got, expected[i]) << "pair " << i;
    }
    EXPECT_EQ(distinct.size(), pairs->size());
    EXPECT_EQ(ids.made, static_cast<int>(pairs->size()));
    // p0 (tp 2) to d0 (tp 1): both prefill ranks send to the one decode rank; to d1 (tp 4):
    // each prefill rank to the two decode ranks holding its heads.
    EXPECT_EQ(expected.size(), 2u + 4u + 1u + 4u);
}

TEST(KvNcclPairsPlan, EachRankSeesItsPairsWithTheSameIdAsItsPeer) {
    const ModelSpec spec = HeadsSpec(9, 3);  // KV head 1 held by both ranks at tp 2
    FakeIds ids;
    Result<std::vector<KvNcclPair>> pairs =
        PlanKvNcclPairs(spec, {{"p", 2}}, {{"d", 2}}, [&] { return ids(); });
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    for (const KvNcclPair& pair : *pairs) {
        const std::vector<KvNcclPairAssignment> src = KvNcclPairsOfRank(*pairs, "p", pair.src_rank);
        const std::vector<KvNcclPairAssignment> dst = KvNcclPairsOfRank(*pairs, "d", pair.dst_rank);
        auto find = [&](const std::vector<KvNcclPairAssignment>& v, const std::string& peer,
                        int peer_rank) -> const KvNcclPairAssignment* {
            for (const KvNcclPairAssignment& a : v)
                if (a.peer_instance == peer && a.peer_rank == peer_rank) return &a;
            return nullptr;
        };
        const KvNcclPairAssignment* s = find(src, "d", pair.dst_rank);
        const KvNcclPairAssignment* r = find(dst, "p", pair.src_rank);
        ASSERT_NE(s, nullptr);
        ASSERT_NE(r, nullptr);
        EXPECT_EQ(s->nccl_rank, 0);
        EXPECT_EQ(r->nccl_rank, 1);
        EXPECT_EQ(s->nccl_unique_id, r->nccl_unique_id);
        EXPECT_EQ(s->nccl_unique_id, pair.nccl_unique_id);
        EXPECT_EQ((IndexRange{s->head_begin, s->head_end}), pair.heads);
        EXPECT_EQ((IndexRange{r->head_begin, r->head_end}), pair.heads);
        // What the registry hands over decodes to the same.
        Result<std::vector<KvNcclPairAssignment>> wire = DecodeKvNcclPairs(EncodeKvNcclPairs(src));
        ASSERT_TRUE(wire.ok()) << wire.status().ToString();
        EXPECT_EQ(*wire, src);
    }
    // A rank of no pair (an instance not in the plan) gets none.
    EXPECT_TRUE(KvNcclPairsOfRank(*pairs, "other", 0).empty());
}

TEST(KvNcclPairsPlan, RefusesDuplicateNamesTooManyPairsAndPassesIdErrors) {
    const ModelSpec spec = HeadsSpec(8, 8);
    FakeIds ids;
    auto make = [&] { return ids(); };
    Result<std::vector<KvNcclPair>> dup = PlanKvNcclPairs(spec, {{"x", 1}}, {{"x", 1}}, make);
    ASSERT_FALSE(dup.ok());
    EXPECT_NE(dup.status().message().find("instance 'x' named twice"), std::string::npos);

    // One prefill rank paired with more decode instances than a rank may have communicators.
    std::vector<KvNcclInstance> decode;
    for (size_t i = 0; i <= kMaxKvNcclPairsPerRank; ++i)
        decode.push_back({"d" + std::to_string(i), 1});
    Result<std::vector<KvNcclPair>> many = PlanKvNcclPairs(spec, {{"p", 1}}, decode, make);
    ASSERT_FALSE(many.ok());
    EXPECT_NE(many.status().message().find("kv_transfer.path: nccl: instance 'p' rank 0 would be "
                                           "in more than 256 NCCL pairs"),
              std::string::npos)
        << many.status().message();

    Result<std::vector<KvNcclPair>> failed = PlanKvNcclPairs(
        spec, {{"p", 1}}, {{"d", 1}}, [] { return Result<std::string>(Unavailable("no NCCL")); });
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().message(), "no NCCL");

    Result<std::vector<KvNcclPair>> bad_tp = PlanKvNcclPairs(spec, {{"p", 16}}, {{"d", 1}}, make);
    EXPECT_FALSE(bad_tp.ok());
}

}  // namespace
}  // namespace kvshard
