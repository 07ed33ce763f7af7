#include "coordinator/scheduler.h"

#include <algorithm>
#include <string>

namespace kvshard {

Scheduler::Scheduler(const SchedulerConfig& config, kv::BlockManager& blocks)
    : config_(config), blocks_(blocks) {
    KV_CHECK(config.Validate().ok()) << config.Validate().ToString();
}

void Scheduler::AddWaiting(Sequence* seq) {
    seq->status = SequenceStatus::kWaiting;
    for (Sequence* child : seq->fork_children) child->status = SequenceStatus::kPendingFork;
    waiting_.push_back(seq);
}

void Scheduler::Preempt(Sequence* seq) {
    // Recompute later: drop the blocks and start over from the first token. A parent with pending
    // forks keeps them; its children were never placed.
    blocks_.Free(seq->seq_id);
    seq->num_computed = 0;
    seq->status = SequenceStatus::kWaiting;
    seq->num_preemptions++;
    num_preemptions_++;
    running_.erase(std::find(running_.begin(), running_.end(), seq));
    waiting_.push_front(seq);
}

bool Scheduler::ReserveSlots(size_t i, StepPlan* plan) {
    Sequence* seq = running_[i];
    const int64_t missing = seq->num_tokens() - blocks_.NumTokens(seq->seq_id);
    if (missing <= 0) return true;
    while (!blocks_.CanAppend(seq->seq_id, missing)) {
        // Alone and out of blocks: preempting itself frees nothing another sequence needs, so
        // the pins that hold the rest lapse first (oldest first).
        if (running_.size() == 1 && blocks_.LapseOldestPin()) continue;
        Sequence* victim = running_.back();
        Preempt(victim);
        if (victim == seq) return false;
    }
    const std::span<const int32_t> new_tokens =
        std::span<const int32_t>(seq->token_ids)
            .subspan(static_cast<size_t>(blocks_.NumTokens(seq->seq_id)));
    kv::AppendResult r = blocks_.AppendSlots(seq->seq_id, new_tokens);
    if (r.copy) plan->block_copies.push_back(*r.copy);
    plan->block_copies.insert(plan->block_copies.end(), r.group_copies.begin(),
                              r.group_copies.end());
    return true;
}

void Scheduler::ForkChildren(Sequence* parent) {
    for (Sequence* child : parent->fork_children) {
        blocks_.Fork(parent->seq_id, child->seq_id);
        child->num_computed = parent->num_computed;
        child->num_cached_tokens = parent->num_cached_tokens;
        child->status = SequenceStatus::kRunning;
        running_.push_back(child);
    }
    parent->fork_children.clear();
}

// Prompt logprobs need the logits of every prompt position: computed, not read from the cache.
// Once the sequence has generated they have been reported (a recompute after preemption skips
// them).
static bool WantsPromptLogprobs(const Sequence& seq) {
    return seq.num_prompt_logprobs >= 0 && seq.num_generated == 0;
}

void Scheduler::AddChunk(Sequence* seq, int64_t n, StepPlan* plan) {
    ScheduledSequence s;
    s.seq_id = seq->seq_id;
    s.start_pos = seq->num_computed;
    s.token_ids.assign(seq->token_ids.begin() + s.start_pos,
                       seq->token_ids.begin() + s.start_pos + n);
    const std::span<const kv::BlockId> table = blocks_.BlockTable(seq->seq_id);
    s.block_table.assign(table.begin(), table.end());
    s.slot_mapping = blocks_.SlotMapping(seq->seq_id, s.start_pos, s.start_pos + n);
    for (int64_t g = 1; g < blocks_.num_groups(); ++g) {
        const std::span<const kv::BlockId> group_table = blocks_.BlockTable(seq->seq_id, g);
        s.group_block_tables.emplace_back(group_table.begin(), group_table.end());
        s.group_slot_mappings.push_back(
            blocks_.SlotMapping(seq->seq_id, s.start_pos, s.start_pos + n, g));
    }
    s.sample = seq->fork_children.empty() && s.start_pos + n == seq->num_tokens();
    s.sampling = seq->sampling;
    s.num_top_logprobs = seq->num_top_logprobs;
    const int64_t end = s.start_pos + n;
    if (WantsPromptLogprobs(*seq) && s.start_pos + 1 < seq->num_prompt_tokens) {
        // The chunk's rows predict the prompt tokens at start_pos + 1 .. end; the one at `end`
        // belongs to the next chunk.
        s.num_prompt_logprobs = seq->num_prompt_logprobs;
        s.next_prompt_token =
            end < seq->num_prompt_tokens ? seq->token_ids[static_cast<size_t>(end)] : -1;
    }
    if (s.sample && NeedsTokenHistory(s.sampling)) {
        s.history = seq->token_ids;
        s.history_prompt_tokens = seq->num_prompt_tokens;
    }
    plan->sequences.push_back(std::move(s));
}

StepPlan Scheduler::Schedule() {
    StepPlan plan;
    plan.step_id = next_step_id_++;
    int64_t budget = config_.max_num_batched_tokens;

    // Parents whose prompt (but its last token) is computed fork their children now.
    for (size_t i = 0; i < running_.size(); ++i) {
        Sequence* seq = running_[i];
        if (!seq->fork_children.empty() && seq->num_computed == seq->target_computed())
            ForkChildren(seq);
    }
    // Running sequences: decodes need a slot for their last sampled token (preempting from the
    // back when blocks run out); unfinished prefills continue with the next chunk.
    for (size_t i = 0; i < running_.size();) {
        Sequence* seq = running_[i];
        if (!ReserveSlots(i, &plan)) continue;  // seq itself was preempted; running_[i] moved on
        const int64_t want = seq->target_computed() - seq->num_computed;
        const int64_t n = std::min(want, budget);
        if (n > 0) {
            AddChunk(seq, n, &plan);
            budget -= n;
        }
        ++i;
    }
    // Admissions, first come first served: stop at the first prompt that does not fit.
    while (!waiting_.empty() && budget > 0) {
        Sequence* seq = waiting_.front();
        // A request with n choices runs as n sequences once its children fork.
        const auto width = static_cast<int64_t>(1 + seq->fork_children.size());
        if (static_cast<int64_t>(running_.size()) + width > config_.max_num_seqs) break;
        kv::SequenceRequest req{.seq_id = seq->seq_id,
                                .prompt_token_ids = seq->token_ids,
                                .skip_prefix_cache = WantsPromptLogprobs(*seq),
                                .incoming_tokens = seq->num_incoming_tokens};
        bool fits = blocks_.CanAllocate(req);
        // Nothing running will free blocks: pins are all that keep this prompt out, and a pin
        // never blocks admission for good. The oldest lapse until it fits.
        while (!fits && running_.empty() && blocks_.LapseOldestPin())
            fits = blocks_.CanAllocate(req);
        if (!fits) break;
        waiting_.pop_front();
        const int64_t cached = blocks_.Allocate(req);
        seq->admitted_cached_tokens = cached;
        seq->num_computed = std::max(cached, seq->num_incoming_tokens);
        if (seq->num_preemptions == 0 && seq->num_incoming_tokens == 0)
            seq->num_cached_tokens = cached;
        seq->status = SequenceStatus::kRunning;
        running_.push_back(seq);
        if (!seq->fork_children.empty() && seq->num_computed == seq->target_computed()) {
            // Nothing to prefill before the fork (a one-token prompt, or all but the last cached).
            ForkChildren(seq);
        }
        const int64_t n = std::min(seq->target_computed() - seq->num_computed, budget);
        if (n > 0) {
            AddChunk(seq, n, &plan);
            budget -= n;
        }
    }
    // Children forked at admission compute the last prompt token in this step too.
    for (Sequence* seq : running_) {
        if (budget <= 0) break;
        const bool planned =
            std::any_of(plan.sequences.begin(), plan.sequences.end(),
                        [&](const ScheduledSequence& s) { return s.seq_id == seq->seq_id; });
        const int64_t want = seq->target_computed() - seq->num_computed;
        if (!planned && want > 0) {
            const int64_t n = std::min(want, budget);
            AddChunk(seq, n, &plan);
            budget -= n;
        }
    }
    plan.released_seq_ids = std::move(released_);
    released_.clear();
    return plan;
}

void Scheduler::OnStepComputed(const StepPlan& plan) {
    for (const ScheduledSequence& s : plan.sequences) {
        auto it = std::find_if(running_.begin(), running_.end(),
                               [&](const Sequence* q) { return q->seq_id == s.seq_id; });
        if (it == running_.end()) continue;  // removed meanwhile (aborted)
        Sequence* seq = *it;
        seq->num_computed = s.start_pos + static_cast<int64_t>(s.token_ids.size());
        blocks_.MarkComputed(seq->seq_id, seq->num_computed);
    }
}

void Scheduler::AppendToken(Sequence* seq, int32_t token_id) {
    KV_CHECK(seq->status == SequenceStatus::kRunning) << "seq " << seq->seq_id;
    seq->token_ids.push_back(token_id);
    seq->num_generated++;
}

void Scheduler::Remove(Sequence* seq) {
    if (blocks_.HasSequence(seq->seq_id)) blocks_.Free(seq->seq_id);
    running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), seq), waiting_.end());
    for (Sequence* child : seq->fork_children) child->status = SequenceStatus::kFinished;
    seq->fork_children.clear();
    seq->status = SequenceStatus::kFinished;
    released_.push_back(seq->seq_id);
}

void Scheduler::Detach(Sequence* seq) {
    KV_CHECK(seq->status == SequenceStatus::kRunning && seq->fork_children.empty())
        << "seq " << seq->seq_id;
    running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
}

void Scheduler::Reattach(Sequence* seq) {
    KV_CHECK(blocks_.HasSequence(seq->seq_id)) << "seq " << seq->seq_id;
    seq->status = SequenceStatus::kRunning;
    // Back in admission order (ids grow with admission), so its decodes come before the chunks
    // of prompts admitted while it was away.
    auto at = std::find_if(running_.begin(), running_.end(),
                           [&](const Sequence* s) { return s->seq_id > seq->seq_id; });
    running_.insert(at, seq);
}

void Scheduler::ReleaseDetached(int64_t seq_id) {
    if (blocks_.HasSequence(seq_id)) blocks_.Free(seq_id);
    released_.push_back(seq_id);
}

SchedulerStats Scheduler::Stats() const {
    return {.num_running = static_cast<int64_t>(running_.size()),
            .num_waiting = static_cast<int64_t>(waiting_.size()),
            .num_preemptions = num_preemptions_};
}

}  // namespace kvshard
