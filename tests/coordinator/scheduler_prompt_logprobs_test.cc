// The scheduler's part in prompt logprobs (Sequence.num_prompt_logprobs): each chunk of such a
// prompt asks the workers to score the prompt tokens its rows predict, handing over the first
// token of the next chunk; the request computes its whole prompt even where the prefix cache holds
// it; once it has generated (a recompute after preemption) it asks no more. Real BlockManager,
// no model: the plans are checked field by field.
#include <gtest/gtest.h>

#include <vector>

#include "coordinator/scheduler.h"

namespace kvshard {
namespace {

constexpr int64_t kBlockSize = 4;

Sequence MakeSequence(int64_t id, int64_t len, int32_t prompt_logprobs) {
    Sequence s;
    s.seq_id = id;
    for (int64_t k = 0; k < len; ++k) s.token_ids.push_back(static_cast<int32_t>(100 + k));
    s.num_prompt_tokens = len;
    s.num_prompt_logprobs = prompt_logprobs;
    return s;
}

struct Rig {
    explicit Rig(int64_t budget)
        : blocks(
              kv::BlockManagerConfig{.num_blocks = 64, .block_size = kBlockSize, .watermark = 0.0}),
          scheduler({.max_num_seqs = 4, .max_num_batched_tokens = budget}, blocks) {}
    // Runs one step as the engine does: the plan's chunks are computed, sampled rows get token 7.
    StepPlan Step() {
        StepPlan plan = scheduler.Schedule();
        scheduler.OnStepComputed(plan);
        for (const ScheduledSequence& s : plan.sequences) {
            if (!s.sample) continue;
            for (Sequence* q : all) {
                if (q->seq_id == s.seq_id) scheduler.AppendToken(q, 7);
            }
        }
        return plan;
    }
    kv::BlockManager blocks;
    Scheduler scheduler;
    std::vector<Sequence*> all;
};

TEST(SchedulerPromptLogprobs, EveryChunkScoresTheTokensItsRowsPredict) {
    Rig rig(/*budget=*/4);
    Sequence seq = MakeSequence(1, 10, /*prompt_logprobs=*/3);
    rig.all = {&seq};
    rig.scheduler.AddWaiting(&seq);
    // Chunks of 4, 4, 2: rows 0..3 score tokens 1..4 (token 4 is the next chunk's first).
    struct Want {
        int64_t start_pos;
        int32_t next_prompt_token;
    };
    for (const Want& want : {Want{0, 104}, Want{4, 108}, Want{8, -1}}) {
        const StepPlan plan = rig.Step();
        ASSERT_EQ(plan.sequences.size(), 1u);
        const ScheduledSequence& s = plan.sequences[0];
        EXPECT_EQ(s.start_pos, want.start_pos);
        EXPECT_EQ(s.num_prompt_logprobs, 3);
        EXPECT_EQ(s.next_prompt_token, want.next_prompt_token) << "start " << s.start_pos;
    }
    // Decoding: nothing of the prompt is left to score.
    const StepPlan decode = rig.Step();
    ASSERT_EQ(decode.sequences.size(), 1u);
    EXPECT_EQ(decode.sequences[0].num_prompt_logprobs, -1);
}

TEST(SchedulerPromptLogprobs, OtherRequestsScoreNothing) {
    Rig rig(/*budget=*/16);
    Sequence plain = MakeSequence(1, 6, /*prompt_logprobs=*/-1);
    rig.all = {&plain};
    rig.scheduler.AddWaiting(&plain);
    const StepPlan plan = rig.Step();
    ASSERT_EQ(plan.sequences.size(), 1u);
    EXPECT_EQ(plan.sequences[0].num_prompt_logprobs, -1);
    EXPECT_EQ(plan.sequences[0].next_prompt_token, -1);
}

TEST(SchedulerPromptLogprobs, SkipsThePrefixCacheHit) {
    Rig rig(/*budget=*/16);
    // The first request publishes its prompt's two full blocks.
    Sequence warm = MakeSequence(1, 9, -1);
    rig.all = {&warm};
    rig.scheduler.AddWaiting(&warm);
    rig.Step();
    rig.scheduler.Remove(&warm);
    // The same prompt again: a plain request starts after the 8 cached tokens...
    Sequence hit = MakeSequence(2, 9, -1);
    rig.all = {&hit};
    rig.scheduler.AddWaiting(&hit);
    StepPlan plan = rig.Step();
    ASSERT_EQ(plan.sequences.size(), 1u);
    EXPECT_EQ(plan.sequences[0].start_pos, 8);
    EXPECT_EQ(hit.num_cached_tokens, 8);
    rig.scheduler.Remove(&hit);
    // ... one asking for prompt logprobs computes (and scores) all of it.
    Sequence scored = MakeSequence(3, 9, 0);
    rig.all = {&scored};
    rig.scheduler.AddWaiting(&scored);
    plan = rig.Step();
    ASSERT_EQ(plan.sequences.size(), 1u);
    EXPECT_EQ(plan.sequences[0].start_pos, 0);
    EXPECT_EQ(plan.sequences[0].token_ids.size(), 9u);
    EXPECT_EQ(plan.sequences[0].num_prompt_logprobs, 0);
    EXPECT_EQ(scored.num_cached_tokens, 0);
}

TEST(SchedulerPromptLogprobs, ARecomputeAfterGeneratingScoresNothing) {
    Rig rig(/*budget=*/16);
    Sequence seq = MakeSequence(1, 5, 2);
    rig.all = {&seq};
    rig.scheduler.AddWaiting(&seq);
    rig.Step();  // the prompt, scored; token 7 appended
    ASSERT_EQ(seq.num_generated, 1);
    // Preempted (as ReserveSlots would): recomputed from position 0, prompt and output.
    rig.scheduler.Remove(&seq);
    Sequence again = seq;
    again.seq_id = 2;
    again.num_computed = 0;
    again.status = SequenceStatus::kWaiting;
    rig.all = {&again};
    rig.scheduler.AddWaiting(&again);
    const StepPlan plan = rig.Step();
    ASSERT_EQ(plan.sequences.size(), 1u);
    // Its scores were reported: the cache serves the first block again, and nothing is scored.
    EXPECT_EQ(plan.sequences[0].start_pos, 4);
    EXPECT_EQ(plan.sequences[0].token_ids.size(), 2u);
    EXPECT_EQ(plan.sequences[0].num_prompt_logprobs, -1);
}

}  // namespace
}  // namespace kvshard
