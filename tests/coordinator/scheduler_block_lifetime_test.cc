// What holds a sequence's blocks and when they come back: an abort mid-prefill, a detached
// sequence (a handoff in flight) until it is reattached or released, prompt-caching pins that lapse
// only when nothing else could run, and a sliding window's blocks released as decode advances.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <span>
#include <vector>

#include "coordinator/scheduler.h"
#include "tests/coordinator/scheduler_harness.h"

namespace kvshard::scheduler_test {
namespace {

TEST(SchedulerTest, AbortMidPrefillReleasesTheSequence) {
    // 3 blocks; a budget of 4. Seq 1 (10 tokens) takes all 3 blocks, so seq 2 (4 tokens, a block
    // and one more for its next decode) waits until seq 1's blocks come back.
    struct Case {
        const char* name;
        int steps_computed;     // steps of seq 1 computed before it is removed
        bool during_a_step;     // removed after Schedule() of one more step, before its results
        int64_t num_computed;   // seq 1's KV when it ends
        int64_t cached_blocks;  // its full computed blocks stay in the prefix cache
    };
    const Case cases[] = {
        {"after its first chunk", 1, false, 4, 1},
        {"during its first chunk", 0, true, 0, 0},  // OnStepComputed skips it: nothing published
        {"after two chunks", 2, false, 8, 2},
        {"during its second chunk", 1, true, 4, 1},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.name);
        Harness h({.max_num_seqs = 4, .max_num_batched_tokens = 4}, 3, true);
        Sequence* s1 = h.Add(1, PromptTokens(1, 10), 1);
        h.Add(2, PromptTokens(2, 4), 1);
        for (int i = 0; i < c.steps_computed; ++i) {
            const StepPlan p = h.Schedule();
            ASSERT_EQ(Chunks(p), (std::vector<Chunk>{{1, 4 * i, 4, F}}));  // seq 2 cannot fit
            h.Compute(p);
        }
        if (c.during_a_step) {
            const StepPlan p = h.Schedule();
            h.scheduler().Remove(s1);
            h.Compute(p);
        } else {
            h.scheduler().Remove(s1);
        }
        EXPECT_EQ(s1->status, SequenceStatus::kFinished);
        EXPECT_EQ(s1->num_computed, c.num_computed);
        EXPECT_FALSE(h.blocks().HasSequence(1));
        EXPECT_EQ(h.blocks().Stats().num_used_blocks, 0);
        EXPECT_EQ(h.blocks().Stats().num_cached_blocks, c.cached_blocks);
        EXPECT_EQ(h.blocks().Stats().num_free_blocks, 3 - c.cached_blocks);

        const StepPlan next = h.Schedule();
        EXPECT_EQ(next.released_seq_ids, std::vector<int64_t>{1});
        EXPECT_EQ(Chunks(next), (std::vector<Chunk>{{2, 0, 4, T}}));  // the freed blocks
        h.Compute(next);
        EXPECT_FALSE(h.scheduler().HasWork());
        EXPECT_EQ(h.Schedule().released_seq_ids, std::vector<int64_t>{2});  // reported once
        EXPECT_TRUE(h.Schedule().released_seq_ids.empty());
        ExpectNoBlockHeld(h.blocks());
    }
}

TEST(SchedulerTest, DetachedSequenceKeepsItsBlocksUntilReattachOrRelease) {
    for (const bool reattach : {true, false}) {
        SCOPED_TRACE(reattach ? "reattach" : "release");
        Harness h({.max_num_seqs = 4, .max_num_batched_tokens = 16}, 16, true);
        Sequence* s1 = h.Add(1, PromptTokens(1, 6), 3);
        h.Add(2, PromptTokens(2, 3), 3);
        const StepPlan first = h.Schedule();
        ASSERT_EQ(Chunks(first), (std::vector<Chunk>{{1, 0, 6, T}, {2, 0, 3, T}}));
        h.Compute(first);  // s1: 7 tokens, 6 computed
        const std::vector<int32_t> s1_blocks = first.sequences[0].block_table;  // 2 blocks

        h.scheduler().Detach(s1);
        EXPECT_EQ(h.scheduler().Stats().num_running, 1);
        EXPECT_EQ(h.scheduler().Stats().num_waiting, 0);
        // Two steps without seq 1; seq 2's decodes (positions 3, 4) take a 2nd block at 4.
        const StepPlan second = h.Schedule();
        EXPECT_EQ(Chunks(second), (std::vector<Chunk>{{2, 3, 1, T}}));
        h.Compute(second);
        const StepPlan third = h.Schedule();
        EXPECT_EQ(Chunks(third), (std::vector<Chunk>{{2, 4, 1, T}}));
        h.Compute(third);  // seq 2's 3rd token: finished
        ASSERT_TRUE(h.blocks().HasSequence(1));
        const std::span<const kv::BlockId> held = h.blocks().BlockTable(1);
        EXPECT_EQ(std::vector<int32_t>(held.begin(), held.end()), s1_blocks);
        EXPECT_EQ(h.blocks().NumTokens(1), 6);  // the token sampled before Detach has no slot yet
        EXPECT_EQ(h.blocks().Stats().num_used_blocks, 2);  // seq 1's, seq 2 is gone
        EXPECT_FALSE(h.scheduler().HasWork());

        if (reattach) {
            h.scheduler().Reattach(s1);
            const StepPlan p = h.Schedule();
            // Continues with the token it sampled before Detach, in its own blocks.
            EXPECT_EQ(Chunks(p), (std::vector<Chunk>{{1, 6, 1, T}}));
            EXPECT_EQ(p.released_seq_ids, std::vector<int64_t>{2});
            ASSERT_EQ(p.sequences.size(), 1u);
            EXPECT_EQ(p.sequences[0].block_table, s1_blocks);
            h.Compute(p);
            const StepPlan q = h.Schedule();
            EXPECT_EQ(Chunks(q), (std::vector<Chunk>{{1, 7, 1, T}}));
            h.Compute(q);  // seq 1's 3rd token
        } else {
            h.scheduler().ReleaseDetached(1);
            EXPECT_FALSE(h.blocks().HasSequence(1));
            const StepPlan p = h.Schedule();
            EXPECT_TRUE(p.sequences.empty());
            EXPECT_EQ(p.released_seq_ids, (std::vector<int64_t>{2, 1}));
        }
        EXPECT_FALSE(h.scheduler().HasWork());
        ExpectNoBlockHeld(h.blocks());
    }
}

// A sequence back from a failed handoff resumes in admission order: its decode comes before the
// chunk of a prompt admitted while it was away, which would otherwise take the whole budget
// (budget 8: seq 3's 20-token prompt needs three chunks).
TEST(SchedulerTest, ReattachedSequenceDecodesBeforeLaterPrefills) {
    Harness h({.max_num_seqs = 4, .max_num_batched_tokens = 8}, 16, true);
    Sequence* s1 = h.Add(1, PromptTokens(1, 4), 4);
    h.Compute(h.Schedule());  // seq 1 prefilled, first token sampled
    h.scheduler().Detach(s1);
    h.Add(3, PromptTokens(3, 20), 1);
    const StepPlan first = h.Schedule();
    EXPECT_EQ(Chunks(first), (std::vector<Chunk>{{3, 0, 8, F}}));
    h.Compute(first);
    h.scheduler().Reattach(s1);
    const StepPlan next = h.Schedule();
    // seq 1 decodes its position 4, then seq 3 takes the 7 tokens left of the budget.
    EXPECT_EQ(Chunks(next), (std::vector<Chunk>{{1, 4, 1, T}, {3, 8, 7, F}}));
}

// Prompt-caching pins hold blocks out of admission within their share, but never keep work from
// running: with nothing running, a waiting prompt that does not fit beside the pins makes the
// oldest lapse; with something running, the prompt waits and the pins hold.
// 16 blocks, all of which pins may hold; a 32-token prefix pinned (8 blocks) by seq 99.
void PinEightBlocks(kv::BlockManager& bm) {
    const std::vector<int32_t> prefix = PromptTokens(99, 32);
    bm.Allocate({99, prefix});
    bm.MarkComputed(99, 32);
    ASSERT_EQ(bm.Pin(99, 32, std::chrono::seconds(300)).pinned_tokens, 32);
    bm.Free(99);
    ASSERT_EQ(bm.num_available_blocks(), 8);
}

TEST(SchedulerTest, PinsLapseOnlyWhenNothingElseCouldRun) {
    {
        Harness h({.max_num_seqs = 8, .max_num_batched_tokens = 64}, 16, true, 1.0);
        PinEightBlocks(h.blocks());
        // 40 tokens: 10 blocks, 8 available, nothing running.
        h.Add(1, PromptTokens(1, 40), 1);
        const StepPlan plan = h.Schedule();
        EXPECT_EQ(Chunks(plan), (std::vector<Chunk>{{1, 0, 40, T}}));
        EXPECT_EQ(h.blocks().Stats().pins_refused, 1);
        EXPECT_EQ(h.blocks().num_pins(), 0);
        h.Compute(plan);
        ExpectNoBlockHeld(h.blocks());
    }
    {
        Harness h({.max_num_seqs = 8, .max_num_batched_tokens = 64}, 16, true, 1.0);
        PinEightBlocks(h.blocks());
        // Seq 1 (3 blocks) runs; seq 2 (6 blocks) does not fit beside it and the pin: it waits.
        h.Add(1, PromptTokens(1, 12), 2);
        h.Add(2, PromptTokens(2, 24), 1);
        StepPlan plan = h.Schedule();
        EXPECT_EQ(Chunks(plan), (std::vector<Chunk>{{1, 0, 12, T}}));
        h.Compute(plan);
        plan = h.Schedule();
        EXPECT_EQ(Chunks(plan), (std::vector<Chunk>{{1, 12, 1, T}}));
        h.Compute(plan);  // seq 1 is done: its blocks are back
        plan = h.Schedule();
        EXPECT_EQ(Chunks(plan), (std::vector<Chunk>{{2, 0, 24, T}}));
        h.Compute(plan);
        EXPECT_EQ(h.blocks().num_pins(), 1);
        EXPECT_EQ(h.blocks().Stats().pins_refused, 0);
        ExpectNoBlockHeld(h.blocks());
    }
}

// Sliding-window KV (kv/block_manager.h "KV cache groups"): a windowed sequence decodes far past
// what its pool could hold for every position, and its blocks out of the window go back as each
// step is computed.
TEST(SchedulerTest, WindowedGroupReleasesBlocksAsDecodeAdvances) {
    for (bool caching : {false, true}) {
        SCOPED_TRACE(caching ? "prefix caching" : "no prefix caching");
        // Window 8, block 4: the query at p reads from p - 7, at most 3 blocks (+ 1 new).
        Harness h({.max_num_seqs = 2, .max_num_batched_tokens = 8}, 5, caching, 0.5, {8});
        Sequence* seq = h.Add(1, PromptTokens(1, 10), 40);  // 50 tokens: 13 blocks all-global
        while (h.scheduler().HasWork()) {
            const StepPlan plan = h.Schedule();
            h.Compute(plan);
            if (!h.blocks().HasSequence(1)) continue;
            const int64_t computed = seq->num_computed;
            EXPECT_EQ(h.blocks().NumReleasedBlocks(1, 0),
                      std::max<int64_t>(0, computed - 8 + 1) / kBlockSize)
                << "after " << computed << " tokens";
            EXPECT_LE(h.blocks().NumHeldBlocks(1), 4);
        }
        EXPECT_EQ(seq->num_generated, 40);
        EXPECT_EQ(h.scheduler().Stats().num_preemptions, 0);
        ExpectNoBlockHeld(h.blocks());
    }
}

}  // namespace
}  // namespace kvshard::scheduler_test
