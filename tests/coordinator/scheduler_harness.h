// The scheduler tests' harness (tests/coordinator/scheduler_*_test.cc): the Scheduler with a real
// kv::BlockManager and a fake executor that "computes" each plan the way
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
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "coordinator/scheduler.h"

namespace kvshard::scheduler_test {

inline constexpr int64_t kBlockSize = 4;

// One row of a plan: a sequence's chunk of consecutive positions.
struct Chunk {
    int64_t seq_id;
    int64_t start_pos;
    int64_t num_tokens;
    bool sample;
    friend bool operator==(const Chunk&, const Chunk&) = default;
};

inline std::ostream& operator<<(std::ostream& os, const Chunk& c) {
    return os << "{seq " << c.seq_id << ", start " << c.start_pos << ", n " << c.num_tokens
              << (c.sample ? ", sample}" : ", no sample}");
}

inline std::vector<Chunk> Chunks(const StepPlan& plan) {
    std::vector<Chunk> out;
    for (const ScheduledSequence& s : plan.sequences) {
        out.push_back({s.seq_id, s.start_pos, static_cast<int64_t>(s.token_ids.size()), s.sample});
    }
    return out;
}

// The row samples (T), or is a prefill chunk that does not end the prompt, or a fork parent's (F).
inline constexpr bool T = true;
inline constexpr bool F = false;

// A request of a scenario. Requests get seq ids 1, 2, ... in list order; the fork children of
// request p (n > 1) get 10 * p + 1, 10 * p + 2, ... Prompt token k of request p is 1000 * p + k,
// so no two requests share a prefix.
struct Prompt {
    int64_t len;
    int64_t max_tokens;  // each choice is finished (Removed) once it generated this many
    int n = 1;
    int64_t arrives_at_step = 1;  // AddWaiting just before the Schedule() of this step
};

inline std::vector<int32_t> PromptTokens(int64_t request, int64_t len) {
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
inline void ExpectNoBlockHeld(const kv::BlockManager& blocks) {
    const kv::BlockManagerStats st = blocks.Stats();
    EXPECT_EQ(st.num_used_blocks, 0);
    EXPECT_EQ(st.num_sequences, 0);
    EXPECT_EQ(st.num_free_blocks + st.num_cached_blocks + st.num_pinned_idle_blocks, st.num_blocks);
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

inline void RunScenario(const Scenario& sc) {
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

}  // namespace kvshard::scheduler_test
