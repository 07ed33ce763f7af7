// The scheduler's forks (n > 1 choices): the children share the prompt's blocks and sample from
// its last token, count toward max_num_seqs, and copy the shared partial block on write (in every
// KV cache group).
#include <gtest/gtest.h>

#include <vector>

#include "coordinator/scheduler.h"
#include "tests/coordinator/scheduler_harness.h"

namespace kvshard::scheduler_test {
namespace {

TEST(SchedulerTest, ForksShareThePromptAndSampleFromItsLastToken) {
    // Children of request 1 are seqs 11, 12. The parent prefills all but the last prompt token;
    // then the children are forked (sharing every block) and all compute that last token.
    const Scenario cases[] = {
        {"n=3, 6 tokens: the shared last block is partial, 2 copies when they diverge",
         {.seqs = 4, .budget = 16, .blocks = 16},
         {{.len = 6, .max_tokens = 2, .n = 3}},
         {
             {{{1, 0, 5, F}}},                                // all but the last prompt token
             {{{1, 5, 1, T}, {11, 5, 1, T}, {12, 5, 1, T}}},  // forked: same slot, no copy
             // Each appends its own token into the shared partial block: the first two get a
             // private copy, the third is then its only holder.
             {{{1, 6, 1, T}, {11, 6, 1, T}, {12, 6, 1, T}}, 2},
         }},
        {"n=2, 8 tokens: the last block is full, the next tokens start new blocks",
         {.seqs = 4, .budget = 16, .blocks = 16},
         {{.len = 8, .max_tokens = 2, .n = 2}},
         {
             {{{1, 0, 7, F}}},
             {{{1, 7, 1, T}, {11, 7, 1, T}}},
             {{{1, 8, 1, T}, {11, 8, 1, T}}, 0},
         }},
        {"n=2, 1 token: forked at admission",
         {.seqs = 4, .budget = 16, .blocks = 16},
         {{.len = 1, .max_tokens = 2, .n = 2}},
         {
             {{{1, 0, 1, T}, {11, 0, 1, T}}},     // nothing to prefill before the fork
             {{{1, 1, 1, T}, {11, 1, 1, T}}, 1},  // block 0 (1 token) is shared: 1 copy
         }},
        {"n=2, 10 tokens over a budget of 4",
         {.seqs = 4, .budget = 4, .blocks = 16},
         {{.len = 10, .max_tokens = 2, .n = 2}},
         {
             {{{1, 0, 4, F}}},
             {{{1, 4, 4, F}}},
             {{{1, 8, 1, F}}},  // up to the last prompt token: 9 - 8 = 1
             {{{1, 9, 1, T}, {11, 9, 1, T}}},
             {{{1, 10, 1, T}, {11, 10, 1, T}}, 1},  // 10 % 4 = 2 tokens in a shared block
         }},
    };
    for (const Scenario& c : cases) RunScenario(c);
}

// scheduler.h: max_num_seqs is "running sequences at once", fork children included: a request of
// n choices is admitted only when n more sequences may run (here seq 2, n = 2, waits for seq 1 to
// finish, as 1 + 2 > max_num_seqs = 2). Harness::CheckPlan asserts num_running <= max_num_seqs
// after every Schedule(). (The engine refuses n > max_num_seqs at Submit.)
TEST(SchedulerTest, ForkChildrenCountTowardMaxNumSeqs) {
    Harness h({.max_num_seqs = 2, .max_num_batched_tokens = 8}, 64, true);
    h.Add(1, PromptTokens(1, 3), 3);
    h.Add(2, PromptTokens(2, 3), 2, /*n=*/2);
    for (int step = 0; step < 20 && h.scheduler().HasWork(); ++step) {
        SCOPED_TRACE("step " + std::to_string(step + 1));
        h.Compute(h.Schedule());
    }
    EXPECT_FALSE(h.scheduler().HasWork());
    EXPECT_EQ(h.Find(21)->num_generated, 2);
    ExpectNoBlockHeld(h.blocks());
}

TEST(SchedulerTest, ForkCopyOnWriteCopiesTheSharedPartialBlock) {
    Harness h({.max_num_seqs = 4, .max_num_batched_tokens = 16}, 16, true);
    h.Add(1, PromptTokens(1, 6), 2, 3);
    h.Compute(h.Schedule());  // the parent's first 5 tokens
    const StepPlan fork = h.Schedule();
    ASSERT_EQ(fork.sequences.size(), 3u);
    // Forked: the three share both blocks (6 tokens = a full block and a partial one).
    const std::vector<int32_t> shared = fork.sequences[0].block_table;
    ASSERT_EQ(shared.size(), 2u);
    for (const ScheduledSequence& s : fork.sequences) {
        EXPECT_EQ(s.block_table, shared) << "seq " << s.seq_id;
        EXPECT_EQ(s.slot_mapping, fork.sequences[0].slot_mapping) << "seq " << s.seq_id;
    }
    EXPECT_EQ(h.blocks().RefCount(shared[0]), 3);
    EXPECT_EQ(h.blocks().RefCount(shared[1]), 3);
    EXPECT_EQ(h.blocks().Stats().num_used_blocks, 2);
    h.Compute(fork);

    const StepPlan diverge = h.Schedule();
    ASSERT_EQ(diverge.sequences.size(), 3u);
    ASSERT_EQ(diverge.block_copies.size(), 2u);
    // Parent and first child copy the shared partial block into blocks of their own, in plan
    // order; the second child, its last holder, keeps it. The full block stays shared.
    for (size_t i = 0; i < 3; ++i) {
        const ScheduledSequence& s = diverge.sequences[i];
        ASSERT_EQ(s.block_table.size(), 2u);
        EXPECT_EQ(s.block_table[0], shared[0]);
        if (i < 2) {
            EXPECT_EQ(diverge.block_copies[i], (kv::CopyOp{shared[1], s.block_table[1]}));
        } else {
            EXPECT_EQ(s.block_table[1], shared[1]);
        }
    }
    EXPECT_NE(diverge.sequences[0].block_table[1], diverge.sequences[1].block_table[1]);
    EXPECT_EQ(h.blocks().RefCount(shared[0]), 3);
    EXPECT_EQ(h.blocks().RefCount(shared[1]), 1);
    EXPECT_EQ(h.blocks().Stats().num_used_blocks, 4);  // 2 shared + 2 copies
    h.Compute(diverge);                                // each choice's 2nd token: all finished
    EXPECT_FALSE(h.scheduler().HasWork());
    ExpectNoBlockHeld(h.blocks());
}

TEST(SchedulerTest, ForkCopyOnWriteCopiesEveryGroupsPartialBlock) {
    Harness h({.max_num_seqs = 4, .max_num_batched_tokens = 16}, 32, true, 0.5, {0, 8});
    h.Add(1, PromptTokens(1, 6), 3, 2);
    h.Compute(h.Schedule());  // the parent's first 5 tokens
    h.Compute(h.Schedule());  // forked: both compute the last prompt token
    const StepPlan diverge = h.Schedule();
    ASSERT_EQ(diverge.sequences.size(), 2u);
    // The parent copies the shared partial block of both groups; the child, its last holder,
    // keeps them.
    ASSERT_EQ(diverge.block_copies.size(), 2u);
    EXPECT_EQ(diverge.block_copies[0].dst_block, h.blocks().BlockTable(1, 0)[1]);
    EXPECT_EQ(diverge.block_copies[1].dst_block, h.blocks().BlockTable(1, 1)[1]);
    h.Compute(diverge);
    while (h.scheduler().HasWork()) h.Compute(h.Schedule());
    ExpectNoBlockHeld(h.blocks());
}

}  // namespace
}  // namespace kvshard::scheduler_test
