// BlockManager pins (prompt caching): pinned prefixes survive LRU eviction until their TTL on the
// manager's time (SetTime: no sleeping), reads refresh the TTL, the pinned share stays within
// max_pinned_fraction with the least recently used pins lapsing first, and every state change
// keeps the block accounting consistent (CheckInvariants).
#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <vector>

#include "kv/block_manager.h"
#include "tests/kv/block_manager_test_util.h"

namespace kvshard::kv {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

BlockManager Make(int64_t num_blocks, double max_pinned_fraction = 0.5,
                  int64_t min_pinned_tokens = 8) {
    BlockManagerConfig c;
    c.num_blocks = num_blocks;
    c.block_size = 4;
    c.watermark = 0.0;
    c.max_pinned_fraction = max_pinned_fraction;
    c.min_pinned_tokens = min_pinned_tokens;
    return BlockManager(c);
}

Clock::time_point At(int64_t ms) { return Clock::time_point(milliseconds(ms)); }

void ExpectOk(const BlockManager& bm) {
    const Status s = bm.CheckInvariants();
    EXPECT_TRUE(s.ok()) << s.ToString();
}

// Admits `prompt` as `id`, computes it whole (publishing its full blocks) and returns the tokens
// served from the cache.
int64_t RunPrompt(BlockManager& bm, SeqId id, const std::vector<int32_t>& prompt) {
    SequenceRequest r{id, prompt};
    EXPECT_TRUE(bm.CanAllocate(r)) << "seq " << id;
    if (!bm.CanAllocate(r)) return -1;
    const int64_t cached = bm.Allocate(r);
    bm.MarkComputed(id, static_cast<int64_t>(prompt.size()));
    ExpectOk(bm);
    return cached;
}

// Fills the cache with `count` unrelated 4-block prompts (an eviction storm), each freed at once.
void Storm(BlockManager& bm, SeqId first_id, int count) {
    for (int i = 0; i < count; ++i) {
        const auto prompt = Tokens(16, 50'000 + 100 * i);
        RunPrompt(bm, first_id + i, prompt);
        bm.Free(first_id + i);
        ExpectOk(bm);
    }
}

TEST(BlockManagerPinTest, ConfigValidatesPinSettings) {
    BlockManagerConfig c{.num_blocks = 8, .block_size = 4};
    c.max_pinned_fraction = 1.5;
    EXPECT_NE(c.Validate().message().find("max_pinned_fraction"), std::string::npos);
    c.max_pinned_fraction = -0.1;
    EXPECT_NE(c.Validate().message().find("max_pinned_fraction"), std::string::npos);
    c.max_pinned_fraction = 1.0;
    c.min_pinned_tokens = -1;
    EXPECT_NE(c.Validate().message().find("min_pinned_tokens"), std::string::npos);
    c.min_pinned_tokens = 0;
    EXPECT_TRUE(c.Validate().ok());
}

TEST(BlockManagerPinTest, PinnedPrefixSurvivesEvictionStormAndLapsesAfterTtl) {
    BlockManager bm = Make(16);
    const auto system = Tokens(16);  // 4 full blocks
    const auto prompt = Concat(system, Tokens(3, 7));
    bm.SetTime(At(0));
    RunPrompt(bm, 1, prompt);
    const PinResult pin = bm.Pin(1, 16, seconds(300));
    EXPECT_EQ(pin.outcome, PinResult::Outcome::kPinned);
    EXPECT_EQ(pin.pinned_tokens, 16);
    bm.Free(1);
    ExpectOk(bm);
    EXPECT_EQ(bm.Stats().num_pinned_blocks, 4);
    EXPECT_EQ(bm.Stats().num_pinned_idle_blocks, 4);
    EXPECT_EQ(bm.num_available_blocks(), 12);  // pinned blocks are not for the taking

    // Unrelated prompts cycle through the other 12 blocks many times over.
    bm.SetTime(At(299'000));
    Storm(bm, 100, 20);
    EXPECT_GT(bm.Stats().num_evictions, 0);
    EXPECT_EQ(bm.CachedPrefixTokens(prompt), 16);
    EXPECT_EQ(bm.PinnedPrefixTokens(prompt), 16);

    // At the TTL the pin lapses: the blocks stay cached (a hit still works) but are evictable.
    EXPECT_EQ(bm.SetTime(At(300'000)), 1);
    ExpectOk(bm);
    EXPECT_EQ(bm.Stats().pins_expired, 1);
    EXPECT_EQ(bm.Stats().num_pinned_blocks, 0);
    EXPECT_EQ(bm.num_available_blocks(), 16);
    EXPECT_EQ(bm.CachedPrefixTokens(prompt), 16);
    EXPECT_EQ(bm.PinnedPrefixTokens(prompt), 0);
    Storm(bm, 200, 4);
    EXPECT_EQ(bm.CachedPrefixTokens(prompt), 0);  // LRU took them this time
}

TEST(BlockManagerPinTest, ReadRefreshesTtl) {
    BlockManager bm = Make(16);
    const auto system = Tokens(16);
    bm.SetTime(At(0));
    RunPrompt(bm, 1, Concat(system, Tokens(2, 7)));
    ASSERT_EQ(bm.Pin(1, 16, seconds(10)).outcome, PinResult::Outcome::kPinned);
    bm.Free(1);

    // A read at 8 s: the pin now lasts until 18 s.
    bm.SetTime(At(8'000));
    EXPECT_EQ(RunPrompt(bm, 2, Concat(system, Tokens(2, 9))), 16);
    bm.Free(2);
    EXPECT_EQ(bm.Stats().pin_hits, 1);
    EXPECT_EQ(bm.SetTime(At(12'000)), 0);
    EXPECT_EQ(bm.Stats().num_pins, 1);
    Storm(bm, 100, 10);
    EXPECT_EQ(bm.CachedPrefixTokens(system), 12);  // (16 - 1) / 4 full blocks may hit
    EXPECT_EQ(bm.SetTime(At(17'999)), 0);
    EXPECT_EQ(bm.SetTime(At(18'000)), 1);
    ExpectOk(bm);

    // A read that covers only part of a pin does not refresh it.
    bm.SetTime(At(20'000));
    RunPrompt(bm, 3, Concat(system, Tokens(2, 7)));
    ASSERT_EQ(bm.Pin(3, 16, seconds(10)).outcome, PinResult::Outcome::kPinned);
    bm.Free(3);
    bm.SetTime(At(25'000));
    auto partial = Tokens(8);
    partial.push_back(1);
    EXPECT_EQ(RunPrompt(bm, 4, partial), 8);
    bm.Free(4);
    EXPECT_EQ(bm.Stats().pin_hits, 2);  // it did read pinned blocks
    EXPECT_EQ(bm.SetTime(At(30'000)), 1);
}

TEST(BlockManagerPinTest, RepinningTheSamePrefixRefreshesIt) {
    BlockManager bm = Make(16);
    const auto prompt = Concat(Tokens(16), Tokens(1, 5));
    bm.SetTime(At(0));
    RunPrompt(bm, 1, prompt);
    ASSERT_EQ(bm.Pin(1, 16, seconds(10)).outcome, PinResult::Outcome::kPinned);
    bm.Free(1);
    bm.SetTime(At(9'000));
    RunPrompt(bm, 2, prompt);
    const PinResult again = bm.Pin(2, 17, seconds(60));  // the breakpoint past the last full block
    EXPECT_EQ(again.outcome, PinResult::Outcome::kRefreshed);
    EXPECT_EQ(again.pinned_tokens, 16);
    bm.Free(2);
    EXPECT_EQ(bm.Stats().num_pins, 1);
    EXPECT_EQ(bm.SetTime(At(68'999)), 0);
    EXPECT_EQ(bm.SetTime(At(69'000)), 1);
    ExpectOk(bm);
}

TEST(BlockManagerPinTest, ShortPrefixesAndDisabledCachingAreNotPinned) {
    BlockManager bm = Make(16, 0.5, /*min_pinned_tokens=*/12);
    RunPrompt(bm, 1, Tokens(20));
    EXPECT_EQ(bm.Pin(1, 11, seconds(1)).outcome, PinResult::Outcome::kTooShort);
    EXPECT_EQ(bm.Pin(1, 12, seconds(1)).pinned_tokens, 12);
    // A breakpoint past the computed blocks pins what is published.
    BlockManager bm2 = Make(16);
    const auto twenty = Tokens(20);
    SequenceRequest r{1, twenty};
    bm2.Allocate(r);
    EXPECT_EQ(bm2.Pin(1, 20, seconds(1)).outcome, PinResult::Outcome::kNothingCached);
    bm2.MarkComputed(1, 9);
    EXPECT_EQ(bm2.Pin(1, 20, seconds(1)).pinned_tokens, 8);

    BlockManagerConfig c{.num_blocks = 16, .block_size = 4, .enable_prefix_caching = false};
    c.min_pinned_tokens = 0;
    BlockManager off(c);
    SequenceRequest r2{1, twenty};
    off.Allocate(r2);
    off.MarkComputed(1, 20);
    EXPECT_EQ(off.Pin(1, 20, seconds(1)).outcome, PinResult::Outcome::kDisabled);
    EXPECT_EQ(off.Stats().num_pins, 0);
}

TEST(BlockManagerPinTest, PinnedShareStaysWithinBoundOldestLapseFirst) {
    // 20 blocks, at most 10 pinned: three 4-block prefixes cannot all be pinned.
    BlockManager bm = Make(20, 0.5);
    EXPECT_EQ(bm.max_pinned_blocks(), 10);
    std::vector<std::vector<int32_t>> prefixes;
    for (int i = 0; i < 3; ++i) prefixes.push_back(Tokens(16, 1000 * (i + 1)));
    for (int i = 0; i < 3; ++i) {
        bm.SetTime(At(1000 * i));
        RunPrompt(bm, i + 1, Concat(prefixes[static_cast<size_t>(i)], Tokens(1, 9)));
        EXPECT_EQ(bm.Pin(i + 1, 16, seconds(300)).outcome, PinResult::Outcome::kPinned);
        bm.Free(i + 1);
        ExpectOk(bm);
        EXPECT_LE(bm.num_pinned_blocks(), bm.max_pinned_blocks());
    }
    // The first (least recently used) lapsed early for the third.
    EXPECT_EQ(bm.Stats().pins_refused, 1);
    EXPECT_EQ(bm.Stats().num_pins, 2);
    EXPECT_EQ(bm.PinnedPrefixTokens(Concat(prefixes[0], Tokens(1))), 0);
    EXPECT_EQ(bm.PinnedPrefixTokens(Concat(prefixes[1], Tokens(1))), 16);

    // A read of the second makes the third the oldest: the next pin takes the third's room.
    bm.SetTime(At(5000));
    RunPrompt(bm, 10, Concat(prefixes[1], Tokens(1, 9)));
    bm.Free(10);
    bm.SetTime(At(6000));
    RunPrompt(bm, 11, Concat(prefixes[0], Tokens(1, 9)));
    EXPECT_EQ(bm.Pin(11, 16, seconds(300)).outcome, PinResult::Outcome::kPinned);
    bm.Free(11);
    EXPECT_EQ(bm.PinnedPrefixTokens(Concat(prefixes[1], Tokens(1))), 16);
    EXPECT_EQ(bm.PinnedPrefixTokens(Concat(prefixes[2], Tokens(1))), 0);
    EXPECT_EQ(bm.Stats().pins_refused, 2);

    // A prefix longer than the whole share is refused and lets no other pin lapse.
    RunPrompt(bm, 12, Tokens(47, 90'000));  // 11 full blocks
    const PinResult big = bm.Pin(12, 47, seconds(300));
    EXPECT_EQ(big.outcome, PinResult::Outcome::kNoRoom);
    EXPECT_EQ(big.pinned_tokens, 0);
    EXPECT_EQ(bm.Stats().num_pins, 2);
    EXPECT_EQ(bm.Stats().pins_refused, 3);
    bm.Free(12);
    ExpectOk(bm);
}

TEST(BlockManagerPinTest, NestedBreakpointsShareBlocksAndKeepTheirOwnPins) {
    BlockManager bm = Make(20, 0.5);
    const auto prompt = Tokens(40);  // 10 blocks
    RunPrompt(bm, 1, prompt);
    EXPECT_EQ(bm.Pin(1, 16, seconds(10)).pinned_tokens, 16);
    // Growing past the share would need 10 blocks: the shorter pin is part of it, so nothing
    // lapses for it and it fits exactly.
    EXPECT_EQ(bm.Pin(1, 40, seconds(100)).pinned_tokens, 40);
    EXPECT_EQ(bm.Stats().num_pins, 2);
    EXPECT_EQ(bm.num_pinned_blocks(), 10);
    bm.Free(1);
    ExpectOk(bm);
    EXPECT_EQ(bm.SetTime(At(10'000)), 1);  // the short pin lapses; its blocks stay pinned by the long one
    EXPECT_EQ(bm.num_pinned_blocks(), 10);
    EXPECT_EQ(bm.SetTime(At(100'000)), 1);
    EXPECT_EQ(bm.num_pinned_blocks(), 0);
    ExpectOk(bm);
}

TEST(BlockManagerPinTest, AdmissionCountsPinnedBlocksAsUnavailableAndCanLapseThem) {
    // 16 blocks, all of them may be pinned: a pinned prefix fills half the pool.
    BlockManager bm = Make(16, 1.0);
    RunPrompt(bm, 1, Tokens(32));
    ASSERT_EQ(bm.Pin(1, 32, seconds(300)).outcome, PinResult::Outcome::kPinned);
    bm.Free(1);
    // A 9-block prompt does not fit in the 8 blocks left...
    const auto big_prompt = Tokens(36, 70'000);
    SequenceRequest big{2, big_prompt};
    EXPECT_FALSE(bm.CanAllocate(big));
    // ...until the pin lapses (what the scheduler does when nothing else runs).
    EXPECT_TRUE(bm.LapseOldestPin());
    EXPECT_FALSE(bm.LapseOldestPin());
    EXPECT_EQ(bm.Stats().pins_refused, 1);
    EXPECT_TRUE(bm.CanAllocate(big));
    bm.Allocate(big);
    ExpectOk(bm);

    // A hit on a pinned prefix costs no available block.
    BlockManager bm2 = Make(16, 1.0);
    RunPrompt(bm2, 1, Tokens(32));
    ASSERT_EQ(bm2.Pin(1, 32, seconds(300)).outcome, PinResult::Outcome::kPinned);
    bm2.Free(1);
    const auto reuse_prompt = Concat(Tokens(32), Tokens(29, 5));  // 8 cached + 8 new blocks
    SequenceRequest reuse{2, reuse_prompt};
    EXPECT_TRUE(bm2.CanAllocate(reuse));
    EXPECT_EQ(bm2.Allocate(reuse), 32);
    ExpectOk(bm2);
    bm2.Free(2);
    ExpectOk(bm2);
}

TEST(BlockManagerPinTest, DropCachedBlocksDropsPins) {
    BlockManager bm = Make(16);
    RunPrompt(bm, 1, Tokens(17));
    ASSERT_EQ(bm.Pin(1, 16, seconds(300)).outcome, PinResult::Outcome::kPinned);
    bm.Free(1);
    EXPECT_EQ(bm.DropCachedBlocks(), 4);
    ExpectOk(bm);
    const BlockManagerStats st = bm.Stats();
    EXPECT_EQ(st.num_pins, 0);
    EXPECT_EQ(st.num_free_blocks, 16);
    EXPECT_EQ(st.pins_expired + st.pins_refused, 0);
}

TEST(BlockManagerPinTest, TwinBlocksPinThePublishedCopy) {
    BlockManager bm = Make(32);
    const auto prompt = Concat(Tokens(16), Tokens(2, 3));
    // Both admitted before either is computed: the second's blocks are private twins.
    SequenceRequest a{1, prompt}, b{2, prompt};
    bm.Allocate(a);
    bm.Allocate(b);
    bm.MarkComputed(1, 18);
    bm.MarkComputed(2, 18);
    const PinResult pin = bm.Pin(2, 16, seconds(300));
    EXPECT_EQ(pin.pinned_tokens, 16);
    for (BlockId blk : bm.BlockTable(1).subspan(0, 4)) EXPECT_EQ(bm.PinCount(blk), 1);
    for (BlockId blk : bm.BlockTable(2).subspan(0, 4)) EXPECT_EQ(bm.PinCount(blk), 0);
    bm.Free(1);
    bm.Free(2);
    ExpectOk(bm);
    EXPECT_EQ(bm.Stats().num_pinned_idle_blocks, 4);
}

}  // namespace
}  // namespace kvshard::kv
