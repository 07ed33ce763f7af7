// Scheduler: which sequences run in the next step and which tokens of each — continuous batching
// with a token budget, chunked prefill, FCFS admission when the block manager can hold a prompt,
// and preemption by recompute when running sequences run out of blocks. Pure logic: it emits
// StepPlans and reads StepResults' shape; it never touches tensors or I/O (STYLE.md habit 2).
//
// Order within a step: running sequences first (decodes and unfinished prefills, in admission
// order), then admissions from the waiting queue while the budget, max_num_seqs and blocks allow.
// A prompt longer than the budget is prefilled over several steps, mixed with other decodes.
// Prompt-caching pins (kv/block_manager.h) hold blocks within their share of the pool; they lapse
// early, oldest first, only when nothing could run otherwise: a waiting prompt that does not fit
// while no sequence runs, or a lone running sequence that would preempt itself.
// Prompt logprobs (Sequence.num_prompt_logprobs): such a sequence is admitted without its
// prefix-cache hit (as vLLM does: the cached positions have no logits), and each of its prompt
// chunks asks the workers to score the prompt tokens its rows predict, the first token of the
// next chunk included (ScheduledSequence.next_prompt_token).
// Thread-safety: none; the instance's engine thread owns it.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "comm/step_plan.h"
#include "common/status.h"
#include "config/engine_config.h"  // SchedulerConfig: the file's scheduler: section
#include "coordinator/sequence.h"
#include "kv/block_manager.h"

namespace kvshard {

struct SchedulerStats {
    int64_t num_running = 0;
    int64_t num_waiting = 0;
    int64_t num_preemptions = 0;  // since start
};

class Scheduler {
  public:
    // `blocks` must outlive the scheduler.
    Scheduler(const SchedulerConfig& config, kv::BlockManager& blocks);

    // Queues a sequence (status kWaiting) at the back; its fork_children (kPendingFork) come with
    // it.
    void AddWaiting(Sequence* seq);
    // Builds the next step. Sequences it admits get their blocks (and num_cached_tokens);
    // preempted ones lose theirs and return to the front of the waiting queue.
    StepPlan Schedule();
    // Records that the plan's chunks were computed: num_computed advances and full blocks are
    // published to the prefix cache. Call once per executed plan, before appending sampled tokens.
    void OnStepComputed(const StepPlan& plan);
    // Appends a sampled token to a running sequence (computed by a later step).
    void AppendToken(Sequence* seq, int32_t token_id);
    // Removes a sequence (finished or aborted) wherever it is and frees its blocks; its id is
    // reported in the next plan's released_seq_ids.
    void Remove(Sequence* seq);

    // Disaggregated prefill: takes a running sequence out of scheduling while its KV is handed
    // to a decode instance; it keeps its blocks (the transfer may still read them) and its
    // worker-side state. Reattach puts it back (the handoff failed: it continues here);
    // ReleaseDetached frees its blocks once the receiver has its KV.
    void Detach(Sequence* seq);
    void Reattach(Sequence* seq);
    void ReleaseDetached(int64_t seq_id);

    bool HasWork() const { return !running_.empty() || !waiting_.empty(); }
    SchedulerStats Stats() const;
    const SchedulerConfig& config() const { return config_; }

  private:
    // Makes room for the next tokens of running_[i] by preempting from the back; false when
    // running_[i] itself was preempted.
    bool ReserveSlots(size_t i, StepPlan* plan);
    void Preempt(Sequence* seq);
    void AddChunk(Sequence* seq, int64_t num_tokens, StepPlan* plan);
    void ForkChildren(Sequence* parent);

    SchedulerConfig config_;
    kv::BlockManager& blocks_;
    std::deque<Sequence*> waiting_;
    std::vector<Sequence*> running_;  // admission order
    std::vector<int64_t> released_;
    uint64_t next_step_id_ = 1;
    int64_t num_preemptions_ = 0;
};

}  // namespace kvshard
