// One rule for which KV heads a rank holds (kv/kv_geometry.h LocalKvHeadRange): the worker's
// shard layout (worker/shard.h), the KV geometry the planner sizes (kv/) and the bytes per block
// serve sizes each rank's pool with (cli/serve_devices.h) give the same answer for tp 1, 2, 4 and
// 8 over 1, 2, 4 and 8 KV heads, with the heads replicated when there are fewer than ranks.
#include <gtest/gtest.h>

#include <algorithm>

#include "cli/serve_devices.h"
#include "kernels/paged_attention.h"
#include "kv/kv_geometry.h"
#include "worker/shard.h"

namespace kvshard::cli {
namespace {

ModelSpec Spec(int64_t heads, int64_t kv_heads) {
    ModelSpec s;
    s.num_layers = 2;
    s.hidden_size = heads * 8;
    s.num_heads = heads;
    s.num_kv_heads = kv_heads;
    s.head_dim = 8;
    s.ffn_size = 256;
    s.vocab_size = 1000;
    return s;
}

// What DESIGN.md states: an even split when the KV heads are a multiple of tp, otherwise one head
// per rank, r / (tp / kv), replicated on tp / kv consecutive ranks.
kv::HeadRange Documented(int64_t kv_heads, int64_t tp, int64_t rank) {
    if (kv_heads >= tp) return {rank * kv_heads / tp, (rank + 1) * kv_heads / tp};
    const int64_t head = rank / (tp / kv_heads);
    return {head, head + 1};
}

TEST(KvHeadRuleTest, EveryModuleGivesEachRankTheSameKvHeads) {
    for (int64_t kv_heads : {1, 2, 4, 8}) {
        const ModelSpec spec = Spec(/*heads=*/16, kv_heads);
        for (int tp : {1, 2, 4, 8}) {
            SCOPED_TRACE(std::to_string(kv_heads) + " KV heads, tp " + std::to_string(tp));
            std::vector<int> holders(static_cast<size_t>(kv_heads), 0);
            for (int rank = 0; rank < tp; ++rank) {
                const kv::HeadRange want = Documented(kv_heads, tp, rank);
                Result<kv::HeadRange> rule = kv::LocalKvHeadRange(16, kv_heads, tp, rank);
                ASSERT_TRUE(rule.ok()) << rule.status().ToString();
                EXPECT_EQ(*rule, want) << "rank " << rank;
                Result<ShardLayout> shard = MakeShardLayout(spec, {.rank = rank, .tp = tp});
                ASSERT_TRUE(shard.ok()) << shard.status().ToString();
                EXPECT_EQ(shard->kv_heads.begin, want.begin) << "rank " << rank;
                EXPECT_EQ(shard->kv_heads.end, want.end) << "rank " << rank;
                for (int64_t h = want.begin; h < want.end; ++h) ++holders[static_cast<size_t>(h)];
            }
            // Every head held, by tp / kv ranks when replicated.
            for (int n : holders) EXPECT_EQ(n, std::max<int64_t>(1, tp / kv_heads));
            const int64_t per_rank = std::max<int64_t>(1, kv_heads / tp);
            EXPECT_EQ(kv::MaxLocalKvHeads(16, kv_heads, tp).value(), per_rank);
            Result<kv::KvGeometry> geometry = kv::MakeKvGeometry(spec, tp, KvDtype::kFp32, 16);
            ASSERT_TRUE(geometry.ok()) << geometry.status().ToString();
            EXPECT_EQ(geometry->num_kv_heads, per_rank);
            const int64_t pool_block = KvBlockBytes(spec, KvDtype::kFp32, 16, tp);
            EXPECT_EQ(pool_block, spec.num_layers * cpu::PagedLayerBytes(KvDtype::kFp32, 16,
                                                                         per_rank, spec.head_dim));
            EXPECT_EQ(pool_block, geometry->BytesPerBlock());
        }
    }
}

// Uneven splits run on kvshard's workers (the default model, 9 query heads over 3 KV heads, at tp
// 2): a KV head whose query heads straddle two ranks is held by both, serve sizes the pool for the
// widest rank, and the planner, which plans only even splits, refuses by name.
TEST(KvHeadRuleTest, AStraddledGroupIsHeldByBothRanks) {
    const ModelSpec spec = Spec(/*heads=*/9, /*kv_heads=*/3);
    EXPECT_EQ(kv::LocalKvHeadRange(9, 3, 2, 0).value(), (kv::HeadRange{0, 2}));
    EXPECT_EQ(kv::LocalKvHeadRange(9, 3, 2, 1).value(), (kv::HeadRange{1, 3}));
    EXPECT_EQ(MakeShardLayout(spec, {.rank = 1, .tp = 2})->kv_heads, (IndexRange{1, 3}));
    EXPECT_EQ(kv::MaxLocalKvHeads(9, 3, 2).value(), 2);
    EXPECT_EQ(KvBlockBytes(spec, KvDtype::kInt8, 16, 2),
              spec.num_layers * cpu::PagedLayerBytes(KvDtype::kInt8, 16, 2, spec.head_dim));
    Result<kv::KvGeometry> planned = kv::MakeKvGeometry(spec, 2, KvDtype::kFp32, 16);
    ASSERT_FALSE(planned.ok());
    EXPECT_NE(planned.status().message().find("3 KV heads"), std::string::npos)
        << planned.status().message();
}

}  // namespace
}  // namespace kvshard::cli
