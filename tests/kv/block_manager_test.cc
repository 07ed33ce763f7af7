// BlockManager: every API path, table-driven where there is a table. The randomized test is in
// block_manager_random_test.cc.
#include "kv/block_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "tests/kv/block_manager_test_util.h"

namespace kvshard::kv {
namespace {

BlockManager Make(int64_t num_blocks, int64_t block_size = 4, double watermark = 0.0,
                  bool prefix_caching = true) {
    BlockManagerConfig c;
    c.num_blocks = num_blocks;
    c.block_size = block_size;
    c.watermark = watermark;
    c.enable_prefix_caching = prefix_caching;
    return BlockManager(c);
}

TEST(BlockManagerConfigTest, Validate) {
    struct Case {
        int64_t num_blocks;
        int64_t block_size;
        double watermark;
        const char* error;  // substring, nullptr: valid
    };
    const Case cases[] = {
        {1, 1, 0.0, nullptr},
        {1024, 16, 0.01, nullptr},
        {0, 16, 0.0, "num_blocks"},
        {-3, 16, 0.0, "num_blocks"},
        {int64_t{1} << 32, 16, 0.0, "num_blocks"},
        {8, 0, 0.0, "block_size"},
        {8, 16, -0.1, "watermark"},
        {8, 16, 1.0, "watermark"},
    };
    for (const Case& c : cases) {
        BlockManagerConfig cfg{c.num_blocks, c.block_size, c.watermark, true};
        Status s = cfg.Validate();
        if (c.error == nullptr) {
            EXPECT_TRUE(s.ok()) << s.ToString();
            EXPECT_TRUE(BlockManager::Create(cfg).ok());
        } else {
            EXPECT_FALSE(s.ok());
            EXPECT_NE(s.message().find(c.error), std::string::npos) << s.message();
            EXPECT_FALSE(BlockManager::Create(cfg).ok());
        }
    }
}

TEST(BlockManagerTest, AllocateGivesCeilBlocksAndSlots) {
    struct Case {
        int64_t prompt_len;
        int64_t blocks;
    };
    const Case cases[] = {{1, 1}, {3, 1}, {4, 1}, {5, 2}, {8, 2}, {9, 3}, {40, 10}};
    for (const Case& c : cases) {
        BlockManager bm = Make(16, 4);
        std::vector<int32_t> prompt = Tokens(c.prompt_len);
        EXPECT_EQ(MustAllocate(bm, 7, prompt), 0);
        std::span<const BlockId> table = bm.BlockTable(7);
        ASSERT_EQ(static_cast<int64_t>(table.size()), c.blocks) << "len " << c.prompt_len;
        EXPECT_EQ(bm.NumTokens(7), c.prompt_len);
        std::vector<int64_t> slots = bm.SlotMapping(7, 0, c.prompt_len);
        for (int64_t p = 0; p < c.prompt_len; ++p) {
            EXPECT_EQ(slots[p], table[p / 4] * 4 + p % 4);
            EXPECT_EQ(bm.Slot(7, p), slots[p]);
        }
        BlockManagerStats st = bm.Stats();
        EXPECT_EQ(st.num_used_blocks, c.blocks);
        EXPECT_EQ(st.num_free_blocks, 16 - c.blocks);
        EXPECT_EQ(st.stored_tokens, c.prompt_len);
        EXPECT_EQ(st.allocated_slots, c.blocks * 4);
        EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), bm.TokenIds(7).begin()));
    }
}

TEST(BlockManagerTest, CanAllocateRejectsEmptyDuplicateAndTooLong) {
    BlockManager bm = Make(4, 4);
    std::vector<int32_t> empty;
    EXPECT_FALSE(bm.CanAllocate({1, empty}));
    std::vector<int32_t> too_long = Tokens(17);
    EXPECT_FALSE(bm.CanAllocate({1, too_long}));
    std::vector<int32_t> p = Tokens(3);
    MustAllocate(bm, 1, p);
    EXPECT_FALSE(bm.CanAllocate({1, p})) << "seq id 1 exists";
}

// The reservation: after admission every running sequence can take its next decode slot, plus
// the watermark.
TEST(BlockManagerTest, AdmissionReservesNextDecodeBlocksAndWatermark) {
    struct Case {
        int64_t num_blocks;
        double watermark;
        int64_t running_len;  // one running sequence of this length (0: none)
        int64_t prompt_len;
        bool fits;
    };
    const Case cases[] = {
        // 4 blocks of 4. A 13-token prompt takes 4 blocks, its next token fits in place.
        {4, 0.0, 0, 13, true},
        // A 16-token prompt takes 4 blocks and its first decode token needs a fifth.
        {4, 0.0, 0, 16, false},
        {5, 0.0, 0, 16, true},
        // Running sequence of 4 tokens (1 full block) needs a block for its next token.
        {4, 0.0, 4, 9, false},  // 1 + 3 + 1 reserved > 4
        {4, 0.0, 4, 7, true},   // 1 + 2 + 1 reserved == 4
        {4, 0.0, 4, 8, false},  // ... and the new prompt's own next token needs one more
        {4, 0.0, 3, 11, true},  // running partial: no reservation; 1 + 3 == 4
        // Watermark 0.25 of 8 blocks = 2 blocks kept.
        {8, 0.25, 0, 23, true},   // 6 blocks + 2
        {8, 0.25, 0, 24, false},  // 6 blocks + 2 + 1 for its next token
        {8, 0.25, 0, 25, false},  // 7 blocks + 2
    };
    for (const Case& c : cases) {
        BlockManager bm = Make(c.num_blocks, 4, c.watermark);
        if (c.running_len > 0) MustAllocate(bm, 1, Tokens(c.running_len, 0));
        std::vector<int32_t> p = Tokens(c.prompt_len, 5000);
        EXPECT_EQ(bm.CanAllocate({2, p}), c.fits)
            << "blocks " << c.num_blocks << " watermark " << c.watermark << " running "
            << c.running_len << " prompt " << c.prompt_len;
    }
}

TEST(BlockManagerTest, AppendSlotsCrossesBlockBoundaries) {
    BlockManager bm = Make(8, 4);
    MustAllocate(bm, 1, Tokens(3));
    std::span<const BlockId> t0 = bm.BlockTable(1);
    const BlockId first = t0[0];
    AppendResult r = bm.AppendSlot(1, 42);  // position 3: last slot of block 0
    ASSERT_EQ(r.slots.size(), 1u);
    EXPECT_EQ(r.slots[0], first * 4 + 3);
    EXPECT_FALSE(r.copy.has_value());
    std::vector<int32_t> more = {43, 44, 45, 46, 47};  // positions 4..8: block 1 full, block 2
    ASSERT_TRUE(bm.CanAppend(1, 5));
    r = bm.AppendSlots(1, more);
    std::span<const BlockId> t = bm.BlockTable(1);
    ASSERT_EQ(t.size(), 3u);
    EXPECT_EQ(r.slots,
              (std::vector<int64_t>{t[1] * 4, t[1] * 4 + 1, t[1] * 4 + 2, t[1] * 4 + 3, t[2] * 4}));
    EXPECT_EQ(bm.NumTokens(1), 9);
    EXPECT_EQ(bm.TokenIds(1)[8], 47);
    EXPECT_TRUE(bm.AppendSlots(1, {}).slots.empty());
    EXPECT_TRUE(bm.CheckInvariants().ok());
}

TEST(BlockManagerTest, CanAppendCountsNewBlocks) {
    BlockManager bm = Make(3, 4);
    MustAllocate(bm, 1, Tokens(6));  // 2 blocks, 1 free
    struct Case {
        int64_t n;
        bool fits;
    };
    for (const Case& c : {Case{0, true}, Case{2, true}, Case{6, true}, Case{7, false}}) {
        EXPECT_EQ(bm.CanAppend(1, c.n), c.fits) << c.n;
    }
}

TEST(BlockManagerTest, ForkSharesBlocksAndCopiesPartialBlockOnWrite) {
    BlockManager bm = Make(8, 4);
    MustAllocate(bm, 1, Tokens(6));  // blocks [A full, B 2/4]
    const std::vector<BlockId> parent_table(bm.BlockTable(1).begin(), bm.BlockTable(1).end());
    bm.Fork(1, 2);
    EXPECT_TRUE(bm.CheckInvariants().ok());
    EXPECT_EQ(std::vector<BlockId>(bm.BlockTable(2).begin(), bm.BlockTable(2).end()), parent_table);
    EXPECT_EQ(bm.RefCount(parent_table[0]), 2);
    EXPECT_EQ(bm.RefCount(parent_table[1]), 2);
    EXPECT_EQ(bm.Stats().num_used_blocks, 2);
    EXPECT_EQ(bm.Stats().stored_tokens, 6) << "shared blocks count once";
    EXPECT_EQ(bm.NumBlocksForNextDecode(), 2) << "each side may need a copy";

    // The child writes first: it gets a private copy of B, and the parent keeps B.
    ASSERT_TRUE(bm.CanAppend(2, 1));
    AppendResult r = bm.AppendSlot(2, 99);
    ASSERT_TRUE(r.copy.has_value());
    EXPECT_EQ(r.copy->src_block, parent_table[1]);
    const BlockId copy = r.copy->dst_block;
    EXPECT_NE(copy, parent_table[1]);
    EXPECT_EQ(bm.BlockTable(2)[1], copy);
    EXPECT_EQ(r.slots, (std::vector<int64_t>{copy * 4 + 2}));
    EXPECT_EQ(bm.RefCount(parent_table[1]), 1);
    EXPECT_EQ(bm.RefCount(copy), 1);
    EXPECT_EQ(bm.RefCount(parent_table[0]), 2) << "full blocks stay shared";
    // The parent now owns B alone: it writes in place, no copy.
    r = bm.AppendSlot(1, 77);
    EXPECT_FALSE(r.copy.has_value());
    EXPECT_EQ(r.slots, (std::vector<int64_t>{parent_table[1] * 4 + 2}));
    EXPECT_EQ(bm.Stats().stored_tokens, 4 + 3 + 3);
    EXPECT_TRUE(bm.CheckInvariants().ok());

    bm.Free(1);
    EXPECT_EQ(bm.RefCount(parent_table[0]), 1);
    EXPECT_EQ(bm.RefCount(parent_table[1]), 0);
    bm.Free(2);
    EXPECT_EQ(bm.Stats().num_used_blocks, 0);
    EXPECT_TRUE(bm.CheckInvariants().ok());
}

// At a block boundary nothing is partial: both sides start new blocks, no copy.
TEST(BlockManagerTest, ForkAtBlockBoundaryNeedsNoCopy) {
    BlockManager bm = Make(8, 4);
    MustAllocate(bm, 1, Tokens(8));
    bm.Fork(1, 2);
    for (SeqId s : {SeqId{1}, SeqId{2}}) {
        AppendResult r = bm.AppendSlot(s, 5);
        EXPECT_FALSE(r.copy.has_value());
        ASSERT_EQ(bm.BlockTable(s).size(), 3u);
        EXPECT_EQ(r.slots, (std::vector<int64_t>{bm.BlockTable(s)[2] * 4}));
    }
    EXPECT_NE(bm.BlockTable(1)[2], bm.BlockTable(2)[2]);
    EXPECT_EQ(bm.BlockTable(1)[1], bm.BlockTable(2)[1]);
    EXPECT_TRUE(bm.CheckInvariants().ok());
}

// One slot left in the shared block: the copy and the new block are both needed.
TEST(BlockManagerTest, CopyOnWriteThenSpillIntoNewBlock) {
    BlockManager bm = Make(5, 4);
    MustAllocate(bm, 1, Tokens(7));  // [full, 3/4]
    bm.Fork(1, 2);
    EXPECT_TRUE(bm.CanAppend(1, 2));    // copy + 1 new block; 3 free
    EXPECT_FALSE(bm.CanAppend(1, 10));  // copy + 3 new blocks > 3
    AppendResult r = bm.AppendSlots(1, std::vector<int32_t>{1, 2});
    ASSERT_TRUE(r.copy.has_value());
    std::span<const BlockId> t = bm.BlockTable(1);
    ASSERT_EQ(t.size(), 3u);
    EXPECT_EQ(r.slots, (std::vector<int64_t>{t[1] * 4 + 3, t[2] * 4}));
    EXPECT_EQ(r.copy->dst_block, t[1]);
    EXPECT_TRUE(bm.CheckInvariants().ok());
}

TEST(BlockManagerTest, ForkCopiesCachedTokenCount) {
    BlockManager bm = Make(16, 4);
    std::vector<int32_t> p = Tokens(9);
    MustAllocate(bm, 1, p);
    bm.MarkComputed(1, 9);
    EXPECT_EQ(MustAllocate(bm, 2, p), 8);
    bm.Fork(2, 3);
    EXPECT_EQ(bm.NumCachedTokens(3), 8);
}

// ---- Prefix caching ----

TEST(BlockManagerPrefixTest, HitsNeedMarkComputedAndStopAtFirstMismatch) {
    const std::vector<int32_t> base = Tokens(12);  // three full blocks of 4
    struct Case {
        const char* name;
        std::vector<int32_t> prompt;
        int64_t cached;
    };
    std::vector<int32_t> second_differs = base;
    second_differs[5] = -1;
    std::vector<int32_t> first_differs = base;
    first_differs[0] = -1;
    const Case cases[] = {
        {"same prompt: all but the last block (one token must be computed)", base, 8},
        {"longer prompt", Concat(base, Tokens(3, 7)), 12},
        {"prompt one token past a block", Concat(base, {1}), 12},
        {"shorter prompt", Tokens(6), 4},
        {"one block and one token", Tokens(5), 4},
        {"exactly one block: nothing left to compute otherwise", Tokens(4), 0},
        {"second block differs", second_differs, 4},
        {"first block differs: later equal blocks have another prefix", first_differs, 0},
    };
    for (const Case& c : cases) {
        BlockManager bm = Make(32, 4);
        MustAllocate(bm, 1, base);
        EXPECT_EQ(bm.CachedPrefixTokens(c.prompt), 0) << "not computed yet";
        bm.MarkComputed(1, 12);
        EXPECT_EQ(bm.CachedPrefixTokens(c.prompt), c.cached) << c.name;
        EXPECT_EQ(MustAllocate(bm, 2, c.prompt), c.cached) << c.name;
        EXPECT_EQ(bm.NumCachedTokens(2), c.cached) << c.name;
        for (int64_t i = 0; i < c.cached / 4; ++i) {
            EXPECT_EQ(bm.BlockTable(2)[i], bm.BlockTable(1)[i]) << c.name;
            EXPECT_EQ(bm.RefCount(bm.BlockTable(1)[i]), 2) << c.name;
        }
        const BlockManagerStats st = bm.Stats();
        EXPECT_EQ(st.prompt_tokens, 12 + static_cast<int64_t>(c.prompt.size()));
        EXPECT_EQ(st.prompt_tokens_from_cache, c.cached);
    }
}

TEST(BlockManagerPrefixTest, MarkComputedPublishesOnlyFullComputedBlocks) {
    BlockManager bm = Make(32, 4);
    std::vector<int32_t> p = Tokens(11);
    MustAllocate(bm, 1, p);
    bm.MarkComputed(1, 5);  // one full block computed
    EXPECT_EQ(bm.Stats().num_published_blocks, 1);
    EXPECT_EQ(bm.CachedPrefixTokens(p), 4);
    bm.MarkComputed(1, 11);  // blocks 0, 1 full; block 2 partial
    EXPECT_EQ(bm.Stats().num_published_blocks, 2);
    EXPECT_EQ(bm.CachedPrefixTokens(p), 8);
    bm.AppendSlot(1, 5);  // block 2 now full, but not computed
    EXPECT_EQ(bm.Stats().num_published_blocks, 2);
    bm.MarkComputed(1, 12);
    EXPECT_EQ(bm.Stats().num_published_blocks, 3);
    // Generated tokens are cached too: a follow-up turn that repeats them hits.
    std::vector<int32_t> turn2 = Concat(Concat(p, {5}), Tokens(2, 9000));
    EXPECT_EQ(bm.CachedPrefixTokens(turn2), 12);
    EXPECT_TRUE(bm.CheckInvariants().ok());
}

TEST(BlockManagerPrefixTest, DisabledCachingNeverHits) {
    BlockManager bm = Make(32, 4, 0.0, /*prefix_caching=*/false);
    std::vector<int32_t> p = Tokens(12);
    MustAllocate(bm, 1, p);
    bm.MarkComputed(1, 12);
    EXPECT_EQ(bm.CachedPrefixTokens(p), 0);
    EXPECT_EQ(MustAllocate(bm, 2, p), 0);
    bm.Free(1);
    EXPECT_EQ(bm.Stats().num_cached_blocks, 0);
    EXPECT_EQ(bm.Stats().prompt_tokens, 0);
}

TEST(BlockManagerPrefixTest, FreeKeepsPublishedFullBlocksCached) {
    BlockManager bm = Make(8, 4);
    MustAllocate(bm, 1, Tokens(10));  // [full, full, 2/4]
    bm.MarkComputed(1, 10);
    bm.Free(1);
    BlockManagerStats st = bm.Stats();
    EXPECT_EQ(st.num_cached_blocks, 2);
    EXPECT_EQ(st.num_free_blocks, 6);
    EXPECT_EQ(st.num_used_blocks, 0);
    EXPECT_EQ(bm.num_available_blocks(), 8);
    // A later prompt with the same start revives them.
    EXPECT_EQ(MustAllocate(bm, 2, Tokens(10)), 8);
    st = bm.Stats();
    EXPECT_EQ(st.num_cached_blocks, 0);
    EXPECT_EQ(st.num_used_blocks, 3);
    EXPECT_DOUBLE_EQ(st.hit_rate, 8.0 / 20.0);
}

// Two prompts admitted before either was computed: both compute the block; the first published
// wins, the second's copy is freed (not cached) when its sequence ends, and chains continue.
TEST(BlockManagerPrefixTest, TwinBlocksArePublishedOnce) {
    BlockManager bm = Make(16, 4);
    std::vector<int32_t> p = Tokens(9);
    MustAllocate(bm, 1, p);
    MustAllocate(bm, 2, p);
    bm.MarkComputed(1, 9);
    bm.MarkComputed(2, 9);
    EXPECT_EQ(bm.Stats().num_published_blocks, 2);
    bm.AppendSlots(2, Tokens(3, 50));  // seq 2's block 2 becomes full: [8, 50, 51, 52]
    bm.MarkComputed(2, 12);
    EXPECT_EQ(bm.Stats().num_published_blocks, 3);
    std::vector<int32_t> follow = Concat(p, Tokens(4, 50));  // 13 tokens
    EXPECT_EQ(bm.CachedPrefixTokens(follow), 12) << "chain continues through seq 1's twin blocks";
    EXPECT_TRUE(bm.CheckInvariants().ok());
    bm.Free(2);
    // seq 2's private twins of blocks 0, 1 are free; its published block 2 is cached.
    EXPECT_EQ(bm.Stats().num_cached_blocks, 1);
    EXPECT_EQ(bm.Stats().num_used_blocks, 3);
    bm.Free(1);
    EXPECT_EQ(bm.Stats().num_cached_blocks, 3);
    EXPECT_EQ(bm.CachedPrefixTokens(follow), 12);
    EXPECT_TRUE(bm.CheckInvariants().ok());
}

TEST(BlockManagerPrefixTest, HitOnReferencedBlockCostsNoAvailableBlock) {
    BlockManager bm = Make(4, 4);
    std::vector<int32_t> p = Tokens(9);  // 3 blocks
    MustAllocate(bm, 1, p);
    bm.MarkComputed(1, 9);
    // 1 block left. The same prompt hits 2 referenced blocks and needs 1 new one.
    EXPECT_TRUE(bm.CanAllocate({2, p}));
    std::vector<int32_t> other = Tokens(9, 500);
    EXPECT_FALSE(bm.CanAllocate({3, other}));
}

TEST(BlockManagerPrefixTest, HitOnCachedBlockTakesItFromAvailable) {
    BlockManager bm = Make(4, 4);
    std::vector<int32_t> p = Tokens(9);
    MustAllocate(bm, 1, p);
    bm.MarkComputed(1, 9);
    bm.Free(1);  // 2 cached, 2 free
    EXPECT_EQ(bm.num_available_blocks(), 4);
    // 13 tokens: hits the 2 cached blocks and needs 2 new ones: exactly the 4 available.
    std::vector<int32_t> q = Concat(Tokens(8), Tokens(5, 700));
    EXPECT_TRUE(bm.CanAllocate({2, q}));
    std::vector<int32_t> r = Tokens(17, 900);  // 5 blocks: never
    EXPECT_FALSE(bm.CanAllocate({2, r}));
    EXPECT_EQ(MustAllocate(bm, 2, q), 8);
    EXPECT_EQ(bm.num_available_blocks(), 0);
}

// ---- Eviction ----

TEST(BlockManagerEvictionTest, LeastRecentlyReleasedFirstAndTailBlocksFirst) {
    BlockManager bm = Make(6, 2);
    // Seq 1: blocks a0 a1 (full), seq 2: blocks b0 b1 (full), each with a one-token tail block.
    MustAllocate(bm, 1, Tokens(5, 100));
    MustAllocate(bm, 2, Tokens(5, 200));
    bm.MarkComputed(1, 5);
    bm.MarkComputed(2, 5);
    const BlockId a0 = bm.BlockTable(1)[0], a1 = bm.BlockTable(1)[1];
    const BlockId b0 = bm.BlockTable(2)[0], b1 = bm.BlockTable(2)[1];
    bm.Free(1);  // released a1 then a0
    bm.Free(2);  // then b1, b0
    EXPECT_EQ(bm.prefix_cache().EvictionOrder(), (std::vector<BlockId>{a1, a0, b1, b0}));
    EXPECT_EQ(bm.Stats().num_cached_blocks, 4);
    EXPECT_EQ(bm.Stats().num_free_blocks, 2);

    // Touch seq 1's prefix again: a0 and a1 leave the list, and come back as most recent.
    MustAllocate(bm, 3, Tokens(5, 100));
    EXPECT_EQ(bm.NumCachedTokens(3), 4);
    bm.Free(3);
    EXPECT_EQ(bm.prefix_cache().EvictionOrder(), (std::vector<BlockId>{b1, b0, a1, a0}));

    // A 5-block prompt of new tokens: 2 free blocks first, then evicts b1, b0, a1 in that order.
    MustAllocate(bm, 4, Tokens(9, 300));
    EXPECT_EQ(bm.Stats().num_evictions, 3);
    EXPECT_EQ(bm.prefix_cache().EvictionOrder(), (std::vector<BlockId>{a0}));
    EXPECT_TRUE(bm.prefix_cache().IsCached(a0));
    EXPECT_FALSE(bm.prefix_cache().IsCached(b0));
    EXPECT_EQ(bm.CachedPrefixTokens(Tokens(5, 200)), 0);
    EXPECT_EQ(bm.CachedPrefixTokens(Tokens(5, 100)), 2) << "a0 survives; a1 was evicted";
}

TEST(BlockManagerEvictionTest, BlockInUseIsNeverEvicted) {
    BlockManager bm = Make(4, 2);
    MustAllocate(bm, 1, Tokens(5, 100));  // 3 blocks, published 2
    bm.MarkComputed(1, 5);
    // Only 1 block is available; a prompt needing 2 cannot evict seq 1's published blocks.
    std::vector<int32_t> p = Tokens(3, 900);
    EXPECT_FALSE(bm.CanAllocate({2, p}));
    EXPECT_FALSE(bm.CanAppend(1, 4));
    EXPECT_EQ(bm.prefix_cache().num_evictable(), 0);
    EXPECT_EQ(bm.prefix_cache().num_cached(), 2);
}

// ---- Preemption ----

TEST(BlockManagerTest, NeedsPreemptionWhenRunningSequencesCannotAllGrow) {
    BlockManager bm = Make(4, 2);
    MustAllocate(bm, 1, Tokens(3, 0));   // 2 blocks, next token in place
    MustAllocate(bm, 2, Tokens(1, 10));  // 1 block, next token in place
    EXPECT_EQ(bm.NumBlocksForNextDecode(), 0);
    EXPECT_FALSE(bm.NeedsPreemption());
    bm.AppendSlot(1, 1);  // seq 1 full at a boundary
    bm.AppendSlot(2, 1);  // seq 2 full at a boundary
    EXPECT_EQ(bm.NumBlocksForNextDecode(), 2);
    EXPECT_EQ(bm.num_available_blocks(), 1);
    EXPECT_TRUE(bm.NeedsPreemption());
    EXPECT_TRUE(bm.CanAppend(1, 1)) << "one of them can still go on";
    bm.Free(2);  // preempt seq 2 (recompute later)
    EXPECT_FALSE(bm.NeedsPreemption());
    bm.AppendSlot(1, 2);
    EXPECT_TRUE(bm.CheckInvariants().ok());
}

TEST(BlockManagerStatsTest, UtilizationIsStoredTokensOverAllocatedSlots) {
    BlockManager bm = Make(16, 4);
    EXPECT_DOUBLE_EQ(bm.Stats().utilization, 1.0);
    MustAllocate(bm, 1, Tokens(5));      // 2 blocks, 5 tokens
    MustAllocate(bm, 2, Tokens(3, 50));  // 1 block, 3 tokens
    BlockManagerStats st = bm.Stats();
    EXPECT_EQ(st.stored_tokens, 8);
    EXPECT_EQ(st.allocated_slots, 12);
    EXPECT_DOUBLE_EQ(st.utilization, 8.0 / 12.0);
    EXPECT_EQ(st.num_sequences, 2);
    EXPECT_EQ(st.num_free_blocks + st.num_used_blocks + st.num_cached_blocks, st.num_blocks);
}

TEST(BlockManagerDeathTest, CommitWithoutRoomFailsFast) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    BlockManager bm = Make(2, 4);
    std::vector<int32_t> p = Tokens(12);
    EXPECT_DEATH(bm.Allocate({1, p}), "CanAllocate");
    std::vector<int32_t> q = Tokens(8);
    EXPECT_TRUE(bm.CanAllocate({1, q}) == false);  // needs a block for its next token too
    std::vector<int32_t> r = Tokens(7);
    bm.Allocate({1, r});
    EXPECT_DEATH(bm.AppendSlots(1, Tokens(2)), "blocks available");
    EXPECT_DEATH(bm.Free(99), "unknown seq 99");
    EXPECT_DEATH(bm.Fork(1, 1), "exists");
}

// Workers restarted with empty KV pools: what the cache held is gone, what a live sequence
// references stays.
TEST(BlockManagerTest, DropCachedBlocksFreesOnlyUnreferencedCachedBlocks) {
    BlockManager bm = Make(8);
    const std::vector<int32_t> a = Tokens(8), b = Tokens(8, 5000);
    MustAllocate(bm, 1, a);
    bm.MarkComputed(1, 8);
    MustAllocate(bm, 2, b);
    bm.MarkComputed(2, 8);
    bm.Free(1);  // its 2 full blocks stay cached
    ASSERT_EQ(bm.Stats().num_cached_blocks, 2);
    const int64_t b_hit = bm.CachedPrefixTokens(b);
    ASSERT_GT(bm.CachedPrefixTokens(a), 0);
    ASSERT_GT(b_hit, 0);

    EXPECT_EQ(bm.DropCachedBlocks(), 2);
    EXPECT_TRUE(bm.CheckInvariants().ok()) << bm.CheckInvariants().ToString();
    EXPECT_EQ(bm.Stats().num_cached_blocks, 0);
    EXPECT_EQ(bm.CachedPrefixTokens(a), 0);
    EXPECT_EQ(bm.CachedPrefixTokens(b), b_hit);  // seq 2 still holds its published blocks
    EXPECT_EQ(MustAllocate(bm, 3, a), 0);     // recomputed, not served from lost KV
}

}  // namespace
}  // namespace kvshard::kv
