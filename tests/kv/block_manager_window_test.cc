// Sliding-window KV in the block manager: KV cache groups (kv/kv_cache_groups.h), blocks released
// as the window moves on, the prefix cache's rules for windowed groups, and the KV a Gemma 3 27B
// sequence holds at a 32k context against the capacity planner's figures.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "common/build_config.h"
#include "kv/block_manager.h"
#include "kv/capacity_planner.h"
#include "kv/kv_cache_groups.h"
#include "tests/kv/block_manager_test_util.h"

namespace kvshard::kv {
namespace {

BlockManager Make(int64_t num_blocks, std::vector<int64_t> windows, int64_t block_size = 4,
                  bool prefix_caching = true) {
    BlockManagerConfig c;
    c.num_blocks = num_blocks;
    c.block_size = block_size;
    c.watermark = 0.0;
    c.enable_prefix_caching = prefix_caching;
    c.group_windows = std::move(windows);
    return BlockManager(c);
}

// Decodes `n` tokens as the scheduler does: the next token's slot, then the step computes it.
void Decode(BlockManager& bm, SeqId id, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        ASSERT_TRUE(bm.CanAppend(id, 1));
        bm.AppendSlot(id, 7);
        bm.MarkComputed(id, bm.NumTokens(id));
    }
    ExpectValid(bm);
}

TEST(KvCacheGroupsTest, SplitsLayersIntoEqualGroups) {
    // Gemma 3's pattern of 6 at 18 layers (the 270M model): 3 global, 15 local of 512.
    std::vector<int64_t> w(18, 512);
    for (int64_t l = 5; l < 18; l += 6) w[static_cast<size_t>(l)] = 0;
    Result<KvCacheGroups> g = MakeKvCacheGroups(w);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    EXPECT_EQ(g->layers_per_group, 3);
    EXPECT_EQ(g->windows, (std::vector<int64_t>{0, 512, 512, 512, 512, 512}));
    EXPECT_EQ(g->layers[0], (std::vector<int64_t>{5, 11, 17}));
    EXPECT_EQ(g->layers[1], (std::vector<int64_t>{0, 1, 2}));
    EXPECT_EQ(g->group_of_layer[11], 0);
    EXPECT_EQ(g->slot_of_layer[11], 1);
    EXPECT_EQ(g->group_of_layer[4], 2);
    EXPECT_EQ(g->slot_of_layer[4], 1);
    EXPECT_EQ(g->BlockManagerWindows(), g->windows);

    // No window: one group of every layer, and the block manager's default (no groups).
    Result<KvCacheGroups> llama = MakeKvCacheGroups(std::vector<int64_t>(32, 0));
    ASSERT_TRUE(llama.ok());
    EXPECT_EQ(llama->layers_per_group, 32);
    EXPECT_EQ(llama->num_groups(), 1);
    EXPECT_TRUE(llama->BlockManagerWindows().empty());
    // Every layer windowed (Mistral): one windowed group.
    Result<KvCacheGroups> mistral = MakeKvCacheGroups(std::vector<int64_t>(32, 4096));
    ASSERT_TRUE(mistral.ok());
    EXPECT_EQ(mistral->BlockManagerWindows(), (std::vector<int64_t>{4096}));

    EXPECT_FALSE(MakeKvCacheGroups(std::vector<int64_t>{}).ok());
    Result<KvCacheGroups> bad = MakeKvCacheGroups(std::vector<int64_t>{0, -2});
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("layer 1"), std::string::npos);
}

TEST(BlockManagerWindowTest, ValidatesGroupWindows) {
    BlockManagerConfig c;
    c.num_blocks = 8;
    c.group_windows = {0, -1};
    const Status s = c.Validate();
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("group_windows[1]"), std::string::npos) << s.ToString();
    c.group_windows = {0, 8};
    EXPECT_TRUE(c.Validate().ok());
}

// Window 8, block 4: after position p is computed, the next query (at p + 1) reads from p - 6,
// so block i is released once 4 * (i + 1) <= p - 6, i.e. floor((computed - 7) / 4) blocks.
TEST(BlockManagerWindowTest, ReleasesBlocksAsDecodeAdvances) {
    for (bool caching : {false, true}) {
        SCOPED_TRACE(caching ? "prefix caching" : "no prefix caching");
        BlockManager bm = Make(64, {0, 8}, 4, caching);
        EXPECT_EQ(bm.num_groups(), 2);
        EXPECT_EQ(MustAllocate(bm, 1, Tokens(6)), 0);
        EXPECT_EQ(bm.NumHeldBlocks(1), 4);  // 2 blocks in each group
        bm.MarkComputed(1, 6);
        EXPECT_EQ(bm.NumReleasedBlocks(1, 1), 0);
        for (int64_t len = 7; len <= 40; ++len) {
            Decode(bm, 1, 1);
            const int64_t computed = len;
            const int64_t released = computed - 7 <= 0 ? 0 : (computed - 7) / 4;
            const int64_t blocks = (len + 3) / 4;
            ASSERT_EQ(bm.NumReleasedBlocks(1, 1), released) << "at " << len;
            ASSERT_EQ(bm.NumReleasedBlocks(1, 0), 0);
            ASSERT_EQ(bm.NumHeldBlocks(1), 2 * blocks - released);
            std::span<const BlockId> window = bm.BlockTable(1, 1);
            ASSERT_EQ(static_cast<int64_t>(window.size()), blocks);
            for (int64_t i = 0; i < blocks; ++i)
                ASSERT_EQ(window[i] == kNoBlock, i < released) << "entry " << i << " at " << len;
            // Every position the next query reads has a slot.
            for (int64_t p = len - 7; p < len; ++p) (void)bm.Slot(1, p, 1);
            const BlockManagerStats st = bm.Stats();
            ASSERT_EQ(st.num_used_blocks, 2 * blocks - released);
            // Released blocks go back to the pool: free without caching; cached (evictable,
            // in the prefix cache's LRU) when their full blocks were published.
            ASSERT_EQ(caching ? st.num_cached_blocks : st.num_free_blocks - (64 - 2 * blocks),
                      released);
        }
        EXPECT_EQ(bm.Stats().num_window_released, (40 - 7) / 4);
        bm.Free(1);
        ExpectValid(bm);
        EXPECT_EQ(bm.num_available_blocks(), 64);
        EXPECT_EQ(bm.Stats().num_used_blocks, 0);
    }
}

TEST(BlockManagerWindowTest, ReleasedBlocksEnterTheLruOldestFirst) {
    BlockManager bm = Make(64, {0, 8});
    MustAllocate(bm, 1, Tokens(24));
    const std::vector<BlockId> before(bm.BlockTable(1, 1).begin(), bm.BlockTable(1, 1).end());
    bm.MarkComputed(1, 24);  // group 1 releases floor(17 / 4) = 4 blocks
    ASSERT_EQ(bm.NumReleasedBlocks(1, 1), 4);
    ExpectValid(bm);
    // The table now says kNoBlock there; the blocks are cached, evictable, oldest first.
    for (int i = 0; i < 4; ++i) EXPECT_EQ(bm.BlockTable(1, 1)[i], kNoBlock);
    EXPECT_EQ(bm.prefix_cache().EvictionOrder(),
              std::vector<BlockId>(before.begin(), before.begin() + 4));
    bm.Free(1);
    ExpectValid(bm);
    EXPECT_EQ(bm.num_available_blocks(), 64);
}

// Only the prefix whose window blocks are still cached is reused; the anchor (full group) alone
// is not enough.
TEST(BlockManagerWindowTest, PrefixHitNeedsTheWindowsBlocks) {
    // 24-token prompt, 6 blocks a group, 2 groups; the pool holds it and the decode reserve.
    BlockManager bm = Make(14, {0, 8});
    const std::vector<int32_t> prompt = Tokens(24);
    MustAllocate(bm, 1, prompt);
    bm.MarkComputed(1, 24);  // publishes all 12, releases group 1's first 4
    bm.Free(1);
    ExpectValid(bm);
    std::vector<int32_t> follow_up = prompt;
    follow_up.push_back(5);
    // Everything cached: a 24-token hit.
    EXPECT_EQ(bm.CachedPrefixTokens(follow_up), 24);

    // Evict group 1's four out-of-window blocks (the oldest in the LRU list): an unrelated
    // prompt of 12 tokens takes the 2 free blocks and 4 evicted ones. The hit stays: from
    // position 24 on, the window reads blocks 4 and 5 only.
    MustAllocate(bm, 2, Tokens(12, 5000));
    EXPECT_EQ(bm.Stats().num_evictions, 4);
    EXPECT_EQ(bm.CachedPrefixTokens(follow_up), 24);

    // Evict blocks 5 and 4 of group 1 too: group 0 still holds the whole chain, but no prefix
    // has its window's blocks any more, so nothing is reused (the window's KV is recomputed).
    MustAllocate(bm, 3, Tokens(1, 9000));
    EXPECT_EQ(bm.Stats().num_evictions, 6);
    EXPECT_EQ(bm.CachedPrefixTokens(follow_up), 0);
    ExpectValid(bm);
}

TEST(BlockManagerWindowTest, PrefixHitReferencesOnlyTheWindowsBlocks) {
    BlockManager bm = Make(64, {0, 8});
    const std::vector<int32_t> prompt = Tokens(24);
    MustAllocate(bm, 1, prompt);
    bm.MarkComputed(1, 24);
    bm.Free(1);
    std::vector<int32_t> follow_up = prompt;
    follow_up.insert(follow_up.end(), {5, 6, 7});
    EXPECT_EQ(MustAllocate(bm, 2, follow_up), 24);
    // Group 0 references all 6 cached blocks and one new; group 1 only blocks 4 and 5 (positions
    // 17..23, what the query at 24 reads) and one new.
    EXPECT_EQ(bm.NumReleasedBlocks(2, 1), 4);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(bm.BlockTable(2, 1)[i], kNoBlock);
    EXPECT_EQ(bm.NumHeldBlocks(2), 7 + 3);
    // The computed tokens then continue the chains of both groups.
    bm.MarkComputed(2, 27);
    Decode(bm, 2, 5);  // 32 tokens: 8 full blocks published in each group
    bm.Free(2);
    ExpectValid(bm);
    std::vector<int32_t> third = follow_up;
    third.insert(third.end(), {7, 7, 7, 7, 7, 9});
    EXPECT_EQ(bm.CachedPrefixTokens(third), 32);
    EXPECT_EQ(bm.num_available_blocks(), 64);
}

// A model whose only group is windowed (Mistral): the group is the anchor, its chain must be
// cached whole, and its blocks before the window are still not referenced.
TEST(BlockManagerWindowTest, WindowedAnchor) {
    BlockManager bm = Make(32, {8});
    const std::vector<int32_t> prompt = Tokens(24);
    MustAllocate(bm, 1, prompt);
    bm.MarkComputed(1, 24);
    EXPECT_EQ(bm.NumReleasedBlocks(1, 0), 4);
    EXPECT_EQ(bm.NumHeldBlocks(1), 2);
    bm.Free(1);
    std::vector<int32_t> follow_up = prompt;
    follow_up.push_back(1);
    EXPECT_EQ(MustAllocate(bm, 2, follow_up), 24);
    EXPECT_EQ(bm.NumHeldBlocks(2), 3);
    bm.Free(2);
    EXPECT_EQ(bm.num_available_blocks(), 32);
}

TEST(BlockManagerWindowTest, AdmissionCountsEveryGroup) {
    // 8 tokens: 2 blocks a group, 3 groups = 6, and 3 for the next decode (a full last block).
    BlockManager bm = Make(8, {0, 8, 8});
    EXPECT_FALSE(bm.CanAllocate(SequenceRequest{1, Tokens(8)}));
    BlockManager roomy = Make(9, {0, 8, 8});
    EXPECT_TRUE(roomy.CanAllocate(SequenceRequest{1, Tokens(8)}));
    MustAllocate(roomy, 1, Tokens(8));
    EXPECT_EQ(roomy.NumBlocksForNextDecode(), 3);
    EXPECT_TRUE(roomy.CanAppend(1, 1));
    EXPECT_FALSE(roomy.CanAppend(1, 5));  // 2 more blocks in each of 3 groups
}

TEST(BlockManagerWindowTest, ForkCopiesTheSharedPartialBlockOfEveryGroup) {
    BlockManager bm = Make(64, {0, 8});
    MustAllocate(bm, 1, Tokens(6));
    bm.MarkComputed(1, 6);
    bm.Fork(1, 2);
    ExpectValid(bm);
    const BlockId shared0 = bm.BlockTable(1, 0)[1];
    const BlockId shared1 = bm.BlockTable(1, 1)[1];
    AppendResult r = bm.AppendSlot(2, 3);
    ASSERT_TRUE(r.copy.has_value());
    EXPECT_EQ(r.copy->src_block, shared0);
    ASSERT_EQ(r.group_copies.size(), 1u);
    EXPECT_EQ(r.group_copies[0].src_block, shared1);
    EXPECT_EQ(bm.BlockTable(2, 1)[1], r.group_copies[0].dst_block);
    ExpectValid(bm);
    // The parent's window moves on alone; the shared first block stays the child's.
    Decode(bm, 1, 10);
    EXPECT_GT(bm.NumReleasedBlocks(1, 1), 0);
    EXPECT_EQ(bm.NumReleasedBlocks(2, 1), 0);
    EXPECT_EQ(bm.RefCount(bm.BlockTable(2, 1)[0]), 1);
    bm.Free(1);
    bm.Free(2);
    ExpectValid(bm);
    EXPECT_EQ(bm.num_available_blocks(), 64);
    EXPECT_EQ(bm.Stats().num_used_blocks, 0);
}

TEST(BlockManagerWindowTest, PinHoldsTheWindowsBlocks) {
    BlockManagerConfig c;
    c.num_blocks = 64;
    c.block_size = 4;
    c.watermark = 0.0;
    c.min_pinned_tokens = 0;
    c.max_pinned_fraction = 1.0;
    c.group_windows = {0, 8};
    BlockManager bm(c);
    const std::vector<int32_t> prompt = Tokens(24);
    MustAllocate(bm, 1, prompt);
    bm.MarkComputed(1, 24);
    const PinResult pin = bm.Pin(1, 24, std::chrono::seconds(60));
    ASSERT_EQ(pin.outcome, PinResult::Outcome::kPinned);
    EXPECT_EQ(pin.pinned_tokens, 24);
    // The anchor's 6 blocks and the 2 the window reads at position 24, even though group 1's
    // table had already let go of its first 4.
    EXPECT_EQ(bm.num_pinned_blocks(), 8);
    ExpectValid(bm);
    bm.Free(1);
    ExpectValid(bm);
    std::vector<int32_t> follow_up = prompt;
    follow_up.push_back(1);
    EXPECT_EQ(bm.PinnedPrefixTokens(follow_up), 24);
    EXPECT_EQ(bm.Stats().num_pinned_idle_blocks, 8);
    EXPECT_EQ(bm.Stats().num_cached_blocks, 4);  // group 1's first four: evictable
}

// The measurement: Gemma 3 27B (tests/kv/configs, 62 layers: 10 global, 52 with a 1024
// window) at a 32,768-token context, bf16, tp 1, block 16. KV bytes a sequence holds once its
// whole context is computed, against the capacity planner's figures.
TEST(BlockManagerWindowTest, Gemma3At32kHoldsThePlannersSlidingWindowBytes) {
    Result<ArchConfig> arch =
        ReadArchConfig(std::string(KVSHARD_SOURCE_DIR) + "/tests/kv/configs/gemma-3-27b-it.json");
    ASSERT_TRUE(arch.ok()) << arch.status().ToString();
    constexpr int64_t kContext = 32768;
    constexpr int64_t kBlock = 16;
    PlannerInput in;
    in.context_tokens = kContext;
    in.block_size = kBlock;
    Result<CapacityPlan> plan = PlanCapacity(*arch, in);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(plan->kv_bytes_per_token, 507904);  // the seed's all-global figure

    Result<KvCacheGroups> groups = MakeKvCacheGroups(LayerWindows(*arch));
    ASSERT_TRUE(groups.ok()) << groups.status().ToString();
    EXPECT_EQ(groups->layers_per_group, 2);  // gcd(10, 52)
    ASSERT_EQ(groups->num_groups(), 31);     // 5 global, 26 windowed
    const int64_t bytes_per_token_per_layer = plan->kv_bytes_per_token / arch->num_layers;
    const int64_t bytes_per_block = groups->layers_per_group * bytes_per_token_per_layer * kBlock;

    // Admitted as the scheduler admits a 32,767-token prompt: chunked prefill of 512 tokens a
    // step, then decode to the full context.
    auto run = [&](std::vector<int64_t> windows, int64_t block_bytes) {
        BlockManagerConfig c;
        c.num_blocks = 31 * (kContext / kBlock) + 64;
        c.block_size = kBlock;
        c.watermark = 0.0;
        c.group_windows = std::move(windows);
        BlockManager bm(c);
        const std::vector<int32_t> prompt = Tokens(kContext - 1, 7);
        EXPECT_TRUE(bm.CanAllocate(SequenceRequest{1, prompt}));
        bm.Allocate(SequenceRequest{1, prompt});
        for (int64_t done = 512; done < kContext - 1; done += 512) bm.MarkComputed(1, done);
        bm.MarkComputed(1, kContext - 1);
        bm.AppendSlot(1, 3);
        bm.MarkComputed(1, kContext);
        EXPECT_TRUE(bm.CheckInvariants().ok());
        const int64_t bytes = bm.NumHeldBlocks(1) * block_bytes;
        bm.Free(1);
        EXPECT_EQ(bm.num_available_blocks(), c.num_blocks);
        return bytes;
    };
    const int64_t windowed = run(groups->BlockManagerWindows(), bytes_per_block);
    const int64_t all_global = run({}, plan->kv_bytes_per_token * kBlock);
    std::printf("[ Gemma 3 27B, 32k ] held %lld B per sequence with windows, %lld B without; "
                "planner: %lld B windowed, %lld B all-global\n",
                static_cast<long long>(windowed), static_cast<long long>(all_global),
                static_cast<long long>(plan->kv_bytes_per_sequence_real),
                static_cast<long long>(plan->kv_bytes_per_sequence));
    // Within one block per group of the planner's figure (here exactly equal: the context and
    // the window are whole blocks).
    EXPECT_LE(std::llabs(windowed - plan->kv_bytes_per_sequence_real),
              groups->num_groups() * bytes_per_block);
    EXPECT_EQ(windowed, plan->kv_bytes_per_sequence_real);
    EXPECT_EQ(all_global, plan->kv_bytes_per_sequence);
    EXPECT_EQ(all_global, 507904LL * kContext);
    EXPECT_EQ(windowed, 8192LL * (10 * kContext + 52 * 1024));
}

}  // namespace
}  // namespace kvshard::kv
