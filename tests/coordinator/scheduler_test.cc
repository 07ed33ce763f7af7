// Scheduler with a real kv::BlockManager and a fake executor that "computes" each plan the way
// InstanceEngine::HandleResult drives the scheduler: OnStepComputed(plan), then for every row that
// samples, AppendToken and, once the choice has its max_tokens, Remove. No model, no threads.
//
// Most tests are tables of scenarios: the prompts, and for every step the plan the scheduler must
// emit as (seq, start_pos, tokens, sample) rows, with a comment saying why each number is what it
// is. Every plan is also checked against the contract that holds in all of them (budget,
// max_num_seqs, slots consistent with the block table, tokens equal to the sequence's).
// Block size is 4 and the watermark 0 throughout, so block counts can be worked out by hand:
// CanAllocate admits a prompt if, after taking ceil(len / 4) blocks, the free + cached blocks left
// cover one block for every running sequence whose next decode token starts a block (the new one
// included: a prompt of 4, 8, ... tokens).
#include "coordinator/scheduler.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace kvshard {
namespace {

constexpr int64_t kBlockSize = 4;

// One row of a plan: a sequence's chunk of consecutive positions.
struct Chunk {
    int64_t seq_id;
    int64_t start_pos;
    int64_t num_tokens;
    bool sample;
    friend bool operator==(const Chunk&, const Chunk&) = default;
};

std::ostream& operator<<(std::ostream& os, const Chunk& c) {
    return os << "{seq " << c.seq_id << ", start " << c.start_pos << ", n " << c.num_tokens
              << (c.sample ? ", sample}" : ", no sample}");
}

std::vector<Chunk> Chunks(const StepPlan& plan) {
    std::vector<Chunk> out;
    for (const ScheduledSequence& s : plan.sequences) {
        out.push_back({s.seq_id, s.start_pos, static_cast<int64_t>(s.token_ids.size()), s.sample});
    }
    return out;
}

constexpr bool T = true;   // the row samples
constexpr bool F = false;  // a prefill chunk that does not end the prompt (or a fork parent's)

// A request of a scenario. Requests get seq ids 1, 2, ... in list order; the fork children of
// request p (n > 1) get 10 * p + 1, 10 * p + 2, ... Prompt token k of request p is 1000 * p + k,
// so no two requests share a prefix.
struct Prompt {
    int64_t len;
    int64_t max_tokens;  // each choice is finished (Removed) once it generated this many
    int n = 1;
    int64_t arrives_at_step = 1;  // AddWaiting just before the Schedule() of this step
};

std::vector<int32_t> PromptTokens(int64_t request, int64_t len) {
    std::vector<int32_t> t;
    for (int64_t k = 0; k < len; ++k) t.push_back(static_cast<int32_t>(1000 * request + k));
    return t;
}

// The scheduler, its block manager, the sequences (owned here, as the engine owns them) and the
// fake executor.
class Harness {
  public:
    Harness(const SchedulerConfig& sched, int64_t num_blocks, bool prefix_caching,
            double max_pinned_fraction = 0.5, std::vector<int64_t> group_windows = {})
        : blocks_(kv::BlockManagerConfig{.num_blocks = num_blocks,
                                         .block_size = kBlockSize,
                                         .watermark = 0.0,
                                         .enable_prefix_caching = prefix_caching,
                                         .max_pinned_fraction = max_pinned_fraction,
                                         .min_pinned_tokens = 0,
                                         .group_windows = std::move(group_windows)}),
          scheduler_(sched, blocks_),
          config_(sched) {}

    // Queues a request of `n` choices with `prompt`; returns the first choice (the fork parent).
    Sequence* Add(int64_t seq_id, const std::vector<int32_t>& prompt, int64_t max_tokens,
                  int n = 1) {
        Sequence* parent = Make(seq_id, prompt, max_tokens);
        for (int c = 1; c < n; ++c)
            parent->fork_children.push_back(Make(10 * seq_id + c, prompt, max_tokens));
        scheduler_.AddWaiting(parent);
        return parent;
    }

    // Schedule() and the checks every plan must pass.
    StepPlan Schedule() {
        StepPlan plan = scheduler_.Schedule();
        CheckPlan(plan);
        return plan;
    }

    // The fake executor, in HandleResult's order: the KV of every chunk is written, then each
    // sampling row's token is appended and a choice that reached max_tokens is finished.
    void Compute(const StepPlan& plan) {
        scheduler_.OnStepComputed(plan);
        for (const ScheduledSequence& s : plan.sequences) {
            if (!s.sample) continue;
            Sequence* seq = Find(s.seq_id);
            if (seq == nullptr || seq->status != SequenceStatus::kRunning) continue;  // aborted
            // Distinct per sequence and step, so forks diverge.
            scheduler_.AppendToken(
                seq, static_cast<int32_t>(100000 + 100 * seq->seq_id + seq->num_generated));
            if (seq->num_generated >= max_tokens_.at(seq->seq_id)) scheduler_.Remove(seq);
        }
    }

    Sequence* Find(int64_t seq_id) {
        auto it = seqs_.find(seq_id);
        return it == seqs_.end() ? nullptr : it->second.get();
    }
    std::vector<int64_t> PreemptionCounts() const {
        std::vector<int64_t> v;
        for (const auto& [id, s] : seqs_) v.push_back(s->num_preemptions);
        return v;
    }
    std::vector<int64_t> SeqIds() const {
        std::vector<int64_t> v;
        for (const auto& [id, s] : seqs_) v.push_back(id);
        return v;
    }

    Scheduler& scheduler() { return scheduler_; }
    kv::BlockManager& blocks() { return blocks_; }

  private:
    Sequence* Make(int64_t seq_id, const std::vector<int32_t>& prompt, int64_t max_tokens) {
        auto seq = std::make_unique<Sequence>();
        seq->seq_id = seq_id;
        seq->token_ids = prompt;
        seq->num_prompt_tokens = static_cast<int64_t>(prompt.size());
        max_tokens_[seq_id] = max_tokens;
        Sequence* p = seq.get();
        seqs_[seq_id] = std::move(seq);
        return p;
    }

    // What holds for every plan, whatever the scenario.
    void CheckPlan(const StepPlan& plan) {
        EXPECT_EQ(plan.step_id, ++last_step_id_);
        int64_t total = 0;
        std::set<int64_t> ids;
        for (const ScheduledSequence& s : plan.sequences) {
            SCOPED_TRACE("seq " + std::to_string(s.seq_id));
            EXPECT_TRUE(ids.insert(s.seq_id).second) << "scheduled twice";
            const auto n = static_cast<int64_t>(s.token_ids.size());
            EXPECT_GT(n, 0);
            total += n;
            Sequence* seq = Find(s.seq_id);
            ASSERT_NE(seq, nullptr);
            EXPECT_EQ(seq->status, SequenceStatus::kRunning);
            // A chunk continues where the sequence's KV ends and stays inside its tokens.
            EXPECT_EQ(s.start_pos, seq->num_computed);
            ASSERT_LE(s.start_pos + n, seq->num_tokens());
            EXPECT_EQ(s.token_ids, std::vector<int32_t>(seq->token_ids.begin() + s.start_pos,
                                                        seq->token_ids.begin() + s.start_pos + n));
            EXPECT_EQ(s.sample, seq->fork_children.empty() && s.start_pos + n == seq->num_tokens());
            // Slots lie in the block table: slot = block * block_size + offset.
            ASSERT_EQ(static_cast<int64_t>(s.slot_mapping.size()), n);
            ASSERT_GE(static_cast<int64_t>(s.block_table.size()),
                      (s.start_pos + n + kBlockSize - 1) / kBlockSize);
            for (int64_t k = 0; k < n; ++k) {
                const int64_t pos = s.start_pos + k;
                EXPECT_EQ(
                    s.slot_mapping[static_cast<size_t>(k)],
                    int64_t{s.block_table[static_cast<size_t>(pos / kBlockSize)]} * kBlockSize +
                        pos % kBlockSize)
                    << "position " << pos;
            }
        }
        EXPECT_LE(total, config_.max_num_batched_tokens) << "token budget exceeded";
        EXPECT_LE(static_cast<int64_t>(plan.sequences.size()), config_.max_num_seqs);
        EXPECT_LE(scheduler_.Stats().num_running, config_.max_num_seqs);
        const Status inv = blocks_.CheckInvariants();
        EXPECT_TRUE(inv.ok()) << inv.ToString();
    }

    kv::BlockManager blocks_;
    Scheduler scheduler_;
    SchedulerConfig config_;
    std::map<int64_t, std::unique_ptr<Sequence>> seqs_;
    std::map<int64_t, int64_t> max_tokens_;
    uint64_t last_step_id_ = 0;
};

// Nothing holds a block any more: every block is free or (published) cached.
void ExpectNoBlockHeld(const kv::BlockManager& blocks) {
    const kv::BlockManagerStats st = blocks.Stats();
    EXPECT_EQ(st.num_used_blocks, 0);
    EXPECT_EQ(st.num_sequences, 0);
    EXPECT_EQ(st.num_free_blocks + st.num_cached_blocks + st.num_pinned_idle_blocks,
              st.num_blocks);
    const Status inv = blocks.CheckInvariants();
    EXPECT_TRUE(inv.ok()) << inv.ToString();
}

// One step of a scenario, written {{chunks...}, copies, {released...}, {preempted...}}.
struct StepExpect {
    std::vector<Chunk> chunks;            // the plan's rows, in plan order
    size_t num_block_copies = 0;          // copy-on-write copies in the plan
    std::vector<int64_t> released = {};   // plan.released_seq_ids
    std::vector<int64_t> preempted = {};  // sequences this Schedule() preempted, by seq id
};

struct Setup {
    int64_t seqs;    // SchedulerConfig::max_num_seqs
    int64_t budget;  // SchedulerConfig::max_num_batched_tokens
    int64_t blocks;  // BlockManagerConfig::num_blocks
    bool prefix_caching = true;
};

struct Scenario {
    const char* name;
    Setup setup;
    std::vector<Prompt> prompts;
    std::vector<StepExpect> steps;  // after the last one, the scheduler has no work
    int64_t num_preemptions = 0;
};

void RunScenario(const Scenario& sc) {
    SCOPED_TRACE(sc.name);
    Harness h({.max_num_seqs = sc.setup.seqs, .max_num_batched_tokens = sc.setup.budget},
              sc.setup.blocks, sc.setup.prefix_caching);
    for (size_t i = 0; i < sc.steps.size(); ++i) {
        const int64_t step = static_cast<int64_t>(i) + 1;
        SCOPED_TRACE("step " + std::to_string(step));
        for (size_t p = 0; p < sc.prompts.size(); ++p) {
            const Prompt& pr = sc.prompts[p];
            const auto id = static_cast<int64_t>(p) + 1;
            if (pr.arrives_at_step == step)
                h.Add(id, PromptTokens(id, pr.len), pr.max_tokens, pr.n);
        }
        ASSERT_TRUE(h.scheduler().HasWork());
        const std::vector<int64_t> ids = h.SeqIds();
        const std::vector<int64_t> before = h.PreemptionCounts();
        const StepPlan plan = h.Schedule();
        const std::vector<int64_t> after = h.PreemptionCounts();
        std::vector<int64_t> preempted;
        for (size_t k = 0; k < ids.size(); ++k) {
            if (after[k] > before[k]) preempted.push_back(ids[k]);
        }
        const StepExpect& want = sc.steps[i];
        EXPECT_EQ(Chunks(plan), want.chunks);
        EXPECT_EQ(plan.block_copies.size(), want.num_block_copies);
        EXPECT_EQ(plan.released_seq_ids, want.released);
        EXPECT_EQ(preempted, want.preempted);
        h.Compute(plan);
    }
    EXPECT_FALSE(h.scheduler().HasWork());
    EXPECT_EQ(h.scheduler().Stats().num_preemptions, sc.num_preemptions);
    int64_t per_seq = 0;
    for (int64_t c : h.PreemptionCounts()) per_seq += c;
    EXPECT_EQ(per_seq, sc.num_preemptions);
    ExpectNoBlockHeld(h.blocks());
}

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
}  // namespace kvshard
