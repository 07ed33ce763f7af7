// The scheduler's plans, step by step, as tables of scenarios (tests/coordinator/
// scheduler_harness.h): the token budget and chunked prefill, prefix-cache hits, preemption by
// recompute from the back, and first-come-first-served admission.
#include "coordinator/scheduler.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/coordinator/scheduler_harness.h"

namespace kvshard::scheduler_test {
namespace {

TEST(SchedulerTest, TokenBudgetAndChunkedPrefill) {
    const Scenario cases[] = {
        {"a 20-token prompt over a budget of 8",
         {.seqs = 4, .budget = 8, .blocks = 64},
         {{.len = 20, .max_tokens = 2}},
         {
             {{{1, 0, 8, F}}},   // the budget, 8
             {{{1, 8, 8, F}}},   // 8 more
             {{{1, 16, 4, T}}},  // the last 20 - 16 = 4 prompt tokens: the chunk samples
             {{{1, 20, 1, T}}},  // the sampled token, at position 20; the 2nd token ends it
         }},
        {"decodes first, then a new prompt's chunk in what is left",
         {.seqs = 4, .budget = 8, .blocks = 64},
         {{.len = 3, .max_tokens = 3}, {.len = 12, .max_tokens = 3}},
         {
             // seq 1's whole prompt (3), then seq 2 gets the 8 - 3 = 5 left.
             {{{1, 0, 3, T}, {2, 0, 5, F}}},
             // seq 1's decode first; seq 2's remaining 12 - 5 = 7 fit the 8 - 1 = 7 left.
             {{{1, 3, 1, T}, {2, 5, 7, T}}},
             {{{1, 4, 1, T}, {2, 12, 1, T}}},  // seq 1 has its 3 tokens: finished
             {{{2, 13, 1, T}}, 0, {1}},        // seq 2's 3rd token
         }},
        {"a prompt trickles in through what three decodes leave",
         {.seqs = 4, .budget = 4, .blocks = 64},
         {{.len = 1, .max_tokens = 3},
          {.len = 1, .max_tokens = 3},
          {.len = 1, .max_tokens = 3},
          {.len = 6, .max_tokens = 1}},
         {
             // Three 1-token prompts use 3 of the budget of 4; seq 4 gets 1 token.
             {{{1, 0, 1, T}, {2, 0, 1, T}, {3, 0, 1, T}, {4, 0, 1, F}}},
             {{{1, 1, 1, T}, {2, 1, 1, T}, {3, 1, 1, T}, {4, 1, 1, F}}},
             {{{1, 2, 1, T}, {2, 2, 1, T}, {3, 2, 1, T}, {4, 2, 1, F}}},
             // Seqs 1-3 finished: seq 4's remaining 6 - 3 = 3 tokens.
             {{{4, 3, 3, T}}, 0, {1, 2, 3}},
         }},
        {"max_num_seqs caps admissions",
         {.seqs = 2, .budget = 16, .blocks = 64},
         {{.len = 2, .max_tokens = 1}, {.len = 2, .max_tokens = 3}, {.len = 2, .max_tokens = 1}},
         {
             {{{1, 0, 2, T}, {2, 0, 2, T}}},          // seq 3 waits: 2 running = max_num_seqs
             {{{2, 2, 1, T}, {3, 0, 2, T}}, 0, {1}},  // seq 1 finished: seq 3 is admitted
             {{{2, 3, 1, T}}, 0, {3}},
         }},
        {"the second long prompt starts in the first one's last chunk",
         {.seqs = 4, .budget = 8, .blocks = 64},
         {{.len = 10, .max_tokens = 1}, {.len = 10, .max_tokens = 1}},
         {
             {{{1, 0, 8, F}}},
             {{{1, 8, 2, T}, {2, 0, 6, F}}},  // 10 - 8 = 2 for seq 1, 8 - 2 = 6 for seq 2
             {{{2, 6, 4, T}}, 0, {1}},        // seq 2's last 10 - 6 = 4
         }},
        {"a prompt arriving later is admitted after the running decode",
         {.seqs = 4, .budget = 8, .blocks = 64},
         {{.len = 3, .max_tokens = 3}, {.len = 2, .max_tokens = 1, .arrives_at_step = 2}},
         {
             {{{1, 0, 3, T}}},
             {{{1, 3, 1, T}, {2, 0, 2, T}}},  // the running decode, then the new prompt
             {{{1, 4, 1, T}}, 0, {2}},
         }},
    };
    for (const Scenario& c : cases) RunScenario(c);
}

TEST(SchedulerTest, PrefixCacheHitsSkipCachedTokens) {
    // Prompt A (10 tokens: two full blocks and a partial one) runs and finishes; its two full
    // blocks stay in the prefix cache. Prompt B takes A's first `shared` tokens, then others.
    struct Case {
        const char* name;
        int64_t shared;
        int64_t b_len;
        bool prefix_caching;
        int64_t cached;  // B's num_cached_tokens: B is scheduled from there
    };
    const Case cases[] = {
        {"two full blocks shared", 8, 13, true, 8},
        {"the 2nd block differs in its last token", 7, 13, true, 4},
        {"less than a block shared", 3, 13, true, 0},
        // A's third block was partial, never published.
        {"the same prompt", 10, 10, true, 8},
        // At least one token is computed to produce logits: at most (8 - 1) / 4 = 1 block.
        {"exactly A's two full blocks", 8, 8, true, 4},
        {"prefix caching off", 8, 13, false, 0},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.name);
        Harness h({.max_num_seqs = 4, .max_num_batched_tokens = 32}, 16, c.prefix_caching);
        const std::vector<int32_t> a = PromptTokens(1, 10);
        h.Add(1, a, 1);
        const StepPlan pa = h.Schedule();
        ASSERT_EQ(Chunks(pa), (std::vector<Chunk>{{1, 0, 10, T}}));
        EXPECT_EQ(h.Find(1)->num_cached_tokens, 0);
        h.Compute(pa);  // A's 1 token: finished
        ASSERT_EQ(h.Find(1)->status, SequenceStatus::kFinished);

        std::vector<int32_t> b(a.begin(), a.begin() + c.shared);
        for (int64_t k = c.shared; k < c.b_len; ++k) b.push_back(static_cast<int32_t>(5000 + k));
        Sequence* seq_b = h.Add(2, b, 1);
        const StepPlan pb = h.Schedule();
        EXPECT_EQ(Chunks(pb), (std::vector<Chunk>{{2, c.cached, c.b_len - c.cached, T}}));
        EXPECT_EQ(pb.released_seq_ids, std::vector<int64_t>{1});
        EXPECT_EQ(seq_b->num_cached_tokens, c.cached);
        EXPECT_EQ(h.blocks().Stats().prompt_tokens_from_cache, c.prefix_caching ? c.cached : 0);
        // The hits are A's own blocks.
        ASSERT_EQ(pb.sequences.size(), 1u);
        const size_t hit_blocks = static_cast<size_t>(c.cached / kBlockSize);
        ASSERT_GE(pb.sequences[0].block_table.size(), hit_blocks);
        EXPECT_EQ(std::vector<int32_t>(pb.sequences[0].block_table.begin(),
                                       pb.sequences[0].block_table.begin() + hit_blocks),
                  std::vector<int32_t>(pa.sequences[0].block_table.begin(),
                                       pa.sequences[0].block_table.begin() + hit_blocks));
        h.Compute(pb);
        EXPECT_FALSE(h.scheduler().HasWork());
        ExpectNoBlockHeld(h.blocks());
    }
}

TEST(SchedulerTest, PreemptionByRecomputeFromTheBack) {
    // Prefix caching off, so a preempted sequence is recomputed from position 0.
    const Scenario cases[] = {
        {"two sequences, 4 blocks: the second is preempted for the first",
         {.seqs = 4, .budget = 16, .blocks = 4, .prefix_caching = false},
         {{.len = 4, .max_tokens = 6}, {.len = 4, .max_tokens = 7}},
         {
             // Both admitted: seq 1 leaves 3 blocks >= 1 (its own next decode needs a block),
             // seq 2 leaves 2 >= 2 (seq 1's and its own next decode).
             {{{1, 0, 4, T}, {2, 0, 4, T}}},
             {{{1, 4, 1, T}, {2, 4, 1, T}}},  // each takes a 2nd block: 0 free
             {{{1, 5, 1, T}, {2, 5, 1, T}}},
             {{{1, 6, 1, T}, {2, 6, 1, T}}},
             {{{1, 7, 1, T}, {2, 7, 1, T}}},
             // Position 8 needs a 3rd block and none is free: seq 2, the last admitted, is
             // preempted (its 2 blocks freed, seq 1 takes 1). Its 9 tokens need 3 blocks: it
             // waits. Seq 1 gets its 6th token and finishes.
             {{{1, 8, 1, T}}, 0, {}, {2}},
             // Seq 2 recomputes its whole list, 4 prompt + 5 generated tokens, and samples.
             {{{2, 0, 9, T}}, 0, {1}},
             {{{2, 9, 1, T}}},  // its 7th token
         },
         1},
        {"two sequences, 5 blocks: the second preempts itself",
         {.seqs = 4, .budget = 16, .blocks = 5, .prefix_caching = false},
         {{.len = 4, .max_tokens = 6}, {.len = 4, .max_tokens = 7}},
         {
             {{{1, 0, 4, T}, {2, 0, 4, T}}},
             {{{1, 4, 1, T}, {2, 4, 1, T}}},  // 2nd blocks: 1 free
             {{{1, 5, 1, T}, {2, 5, 1, T}}},
             {{{1, 6, 1, T}, {2, 6, 1, T}}},
             {{{1, 7, 1, T}, {2, 7, 1, T}}},
             // Seq 1 takes the last free block; seq 2 finds none and is itself the last admitted.
             {{{1, 8, 1, T}}, 0, {}, {2}},
             {{{2, 0, 9, T}}, 0, {1}},
             {{{2, 9, 1, T}}},
         },
         1},
        {"three sequences: the last admitted goes first, back to the front of the queue",
         {.seqs = 8, .budget = 32, .blocks = 7, .prefix_caching = false},
         {{.len = 4, .max_tokens = 6},
          {.len = 4, .max_tokens = 8},
          {.len = 4, .max_tokens = 7},
          {.len = 4, .max_tokens = 1}},
         {
             // Admissions leave 6 >= 1, 5 >= 2, 4 >= 3 blocks; seq 4 would leave 3 < 4: it waits.
             {{{1, 0, 4, T}, {2, 0, 4, T}, {3, 0, 4, T}}},
             // 2nd blocks: 1 free. Seq 4 would leave 0 < 1 (its own next decode).
             {{{1, 4, 1, T}, {2, 4, 1, T}, {3, 4, 1, T}}},
             {{{1, 5, 1, T}, {2, 5, 1, T}, {3, 5, 1, T}}},
             {{{1, 6, 1, T}, {2, 6, 1, T}, {3, 6, 1, T}}},
             {{{1, 7, 1, T}, {2, 7, 1, T}, {3, 7, 1, T}}},
             // Seq 1 takes the last block; seq 2 needs one: seq 3 (last admitted, not seq 2)
             // is preempted, freeing 2. Waiting is now [3, 4]: seq 3 needs 3 blocks, 1 is free,
             // and seq 4 is not tried past it. Seq 1 finishes (6 tokens), freeing 3.
             {{{1, 8, 1, T}, {2, 8, 1, T}}, 0, {}, {3}},
             // 4 free: seq 3 (9 tokens, 3 blocks, leaves 1 >= 0) is admitted before seq 4, which
             // would then leave 0 < 1.
             {{{2, 9, 1, T}, {3, 0, 9, T}}, 0, {1}},
             {{{2, 10, 1, T}, {3, 9, 1, T}}},  // both finish: seq 2 at 8 tokens, seq 3 at 7
             {{{4, 0, 4, T}}, 0, {2, 3}},
         },
         1},
    };
    for (const Scenario& c : cases) RunScenario(c);
}

TEST(SchedulerTest, AdmissionIsFirstComeFirstServed) {
    const Scenario cases[] = {
        {"all fit: admitted in arrival order",
         {.seqs = 8, .budget = 32, .blocks = 64},
         {{.len = 5, .max_tokens = 1}, {.len = 3, .max_tokens = 1}, {.len = 7, .max_tokens = 1}},
         {
             {{{1, 0, 5, T}, {2, 0, 3, T}, {3, 0, 7, T}}},
         }},
        {"the budget runs out: a later 1-token prompt does not pass the chunked one",
         {.seqs = 8, .budget = 8, .blocks = 64},
         {{.len = 6, .max_tokens = 1}, {.len = 6, .max_tokens = 1}, {.len = 1, .max_tokens = 1}},
         {
             {{{1, 0, 6, T}, {2, 0, 2, F}}},  // 8 - 6 = 2 for seq 2, none for seq 3
             {{{2, 2, 4, T}, {3, 0, 1, T}}, 0, {1}},
         }},
        // 4 blocks. Seq 1 (8 tokens) takes 2 and leaves 2 >= 1. Seq 2 (12 tokens) needs 3: it
        // waits. Seq 3 (2 tokens) would take 1 and leave 1 >= 1 (seq 1's next decode), but it
        // does not pass seq 2.
        {"blocks: a later small prompt that would fit does not pass one that does not",
         {.seqs = 8, .budget = 32, .blocks = 4},
         {{.len = 8, .max_tokens = 1}, {.len = 12, .max_tokens = 1}, {.len = 2, .max_tokens = 1}},
         {
             {{{1, 0, 8, T}}},
             // Seq 1's 2 blocks are back (cached): 4 available; seq 2 leaves 1 >= 1; seq 3 would
             // then leave 0 < 1 (seq 2's next decode starts a block).
             {{{2, 0, 12, T}}, 0, {1}},
             {{{3, 0, 2, T}}, 0, {2}},
         }},
        {"the same, the small prompt arriving while the big one waits",
         {.seqs = 8, .budget = 32, .blocks = 4},
         {{.len = 8, .max_tokens = 2},
          {.len = 12, .max_tokens = 1},
          {.len = 2, .max_tokens = 1, .arrives_at_step = 2}},
         {
             {{{1, 0, 8, T}}},
             // Seq 1's decode takes a 3rd block: 1 left; seq 3 would fit, seq 2 is first.
             {{{1, 8, 1, T}}},
             {{{2, 0, 12, T}}, 0, {1}},
             {{{3, 0, 2, T}}, 0, {2}},
         }},
    };
    for (const Scenario& c : cases) RunScenario(c);
}

}  // namespace
}  // namespace kvshard::scheduler_test
