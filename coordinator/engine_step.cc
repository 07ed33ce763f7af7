// InstanceEngine's step (engine.h): PlanStep takes the inbox and asks the scheduler for a plan;
// CompleteStep applies the executor's result — the scheduler's bookkeeping, then each sampled
// token through the output stage (detokenize, stop checks, deltas) — or fails the step's
// requests. The engine's lifecycle (threads, Submit, stats) is engine.cc; handoffs are
// engine_handoff.cc; latencies engine_latency.cc.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/engine.h"
#include "coordinator/engine_state.h"

namespace kvshard {

namespace {

// What a client is told when its request failed on the workers: the code, in kvshard's words.
// The cause (ranks, peer addresses, the worker's own message) goes to the log.
Status ClientStatus(const std::string& instance, const Status& cause) {
    switch (cause.code()) {
        case StatusCode::kUnavailable:
            return Status(StatusCode::kUnavailable,
                          "instance '" + instance + "' lost its workers while running the request");
        case StatusCode::kDeadlineExceeded:
            return Status(StatusCode::kUnavailable,
                          "instance '" + instance + "' did not finish a step in time");
        default:
            return Status(StatusCode::kInternal,
                          "instance '" + instance + "' failed to run the request's step");
    }
}

std::vector<int32_t> MinTokensBans(const GenerationRequest& req,
                                   const std::vector<int32_t>& eos_ids) {
    std::vector<int32_t> ids = req.stop_token_ids;
    if (!req.ignore_eos) ids.insert(ids.end(), eos_ids.begin(), eos_ids.end());
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    return ids;
}

}  // namespace

void InstanceEngine::Admit(std::unique_ptr<RequestState> state) {
    RequestState& r = *state;
    const GenerationRequest& req = r.request;
    for (int i = 0; i < req.n; ++i) {
        auto seq = std::make_unique<Sequence>();
        seq->seq_id = next_seq_id_++;
        seq->token_ids = req.prompt_token_ids;
        seq->num_prompt_tokens = static_cast<int64_t>(req.prompt_token_ids.size());
        seq->sampling = req.sampling;
        seq->sampling.seed = req.sampling.seed + static_cast<uint64_t>(i);
        if (req.sampling.min_tokens > 0) {
            seq->sampling.min_tokens_banned_ids = MinTokensBans(req, config_.stop_token_ids);
        }
        seq->num_top_logprobs = req.num_top_logprobs;
        seq->num_prompt_logprobs = req.num_prompt_logprobs;
        by_seq_[seq->seq_id] = {&r, i};
        r.streams.push_back(std::make_unique<TextStream>(
            tokenizer_, req.stop, req.prompt_token_ids.back(),
            TextStreamOptions{req.include_stop_str_in_output, req.skip_special_tokens}));
        r.choices.push_back(std::move(seq));
        if (req.grammar != nullptr) {
            r.constraints.push_back(
                std::make_unique<grammar::Constraint>(req.grammar, GrammarVocabulary()));
        }
    }
    for (int i = 1; i < req.n; ++i)
        r.choices[0]->fork_children.push_back(r.choices[static_cast<size_t>(i)].get());
    r.finished.assign(static_cast<size_t>(req.n), false);
    r.usage.prompt_tokens = static_cast<int64_t>(req.prompt_token_ids.size());
    scheduler_.AddWaiting(r.choices[0].get());
    const std::string id = req.request_id;
    spdlog::debug("request {}: {} prompt tokens, n={}, max_tokens={}", id, r.usage.prompt_tokens,
                  req.n, req.max_tokens);
    requests_[id] = std::move(state);
}

void InstanceEngine::DrainInbox() {
    std::deque<std::unique_ptr<RequestState>> inbox;
    std::vector<std::string> aborts;
    std::deque<std::unique_ptr<Handoff>> handoffs_in;
    std::deque<FinishedHandoff> handoffs_done;
    {
        std::lock_guard<std::mutex> lock(mu_);
        inbox.swap(inbox_);
        aborts.swap(aborts_);
        handoffs_in.swap(handoffs_in_);
        handoffs_done.swap(handoffs_done_);
    }
    for (auto& state : inbox) Admit(std::move(state));
    for (auto& done : handoffs_done)
        ResumeHandoff(done.transfer_id, std::move(done.returned), done.status);
    for (const std::string& id : aborts) {
        auto it = requests_.find(id);
        if (it == requests_.end()) {
            // Perhaps on its way here from a prefill instance: remembered for AdmitHandoff.
            unknown_aborts_.push_back(id);
            if (unknown_aborts_.size() > 1024) unknown_aborts_.pop_front();
            continue;
        }
        RequestState& r = *it->second;
        r.aborted = true;
        for (int i = 0; i < r.request.n; ++i) {
            if (r.finished[static_cast<size_t>(i)]) continue;
            GenerationDelta d;
            d.index = i;
            FinishChoice(r, i, FinishReason::kAbort, &d);
            r.sink->OnDelta(d);
        }
        CompleteIfDone(id);
    }
    for (auto& h : handoffs_in) AdmitHandoff(std::move(h));
}

void InstanceEngine::FinishChoice(RequestState& r, int index, FinishReason reason,
                                  GenerationDelta* delta) {
    Sequence* seq = r.choices[static_cast<size_t>(index)].get();
    scheduler_.Remove(seq);
    by_seq_.erase(seq->seq_id);
    r.finished[static_cast<size_t>(index)] = true;
    r.num_finished++;
    r.last_finish = reason;
    delta->finish_reason = reason;
}

void InstanceEngine::CompleteIfDone(const std::string& request_id) {
    auto it = requests_.find(request_id);
    if (it == requests_.end() || it->second->num_finished < it->second->request.n) return;
    RequestState& r = *it->second;
    r.usage.cached_tokens = r.choices[0]->num_cached_tokens;
    ObserveFinished(r, Status::Ok());
    r.sink->OnFinish(r.usage, Status::Ok());
    requests_.erase(it);
    std::lock_guard<std::mutex> lock(mu_);
    num_queued_--;
}

void InstanceEngine::MakePins(RequestState& r) {
    r.pins_made = true;
    if (config_.role == PoolRole::kDecode) return;  // pins live where prompts are computed
    prefix_forced_++;                               // the next publish reads every block's pins
    const Sequence& seq = *r.choices[0];
    int64_t pinned = 0;
    for (const CacheBreakpoint& b : r.request.cache_breakpoints) {
        const kv::PinResult p =
            blocks_.Pin(seq.seq_id, b.prefix_tokens, std::chrono::milliseconds(b.ttl_ms));
        pinned = std::max(pinned, p.pinned_tokens);
    }
    // Written by this request: the pinned prefix less what it read from the cache.
    r.usage.cache_creation_tokens = std::max<int64_t>(0, pinned - seq.num_cached_tokens);
}

void InstanceEngine::CollectPromptLogprobs(const PromptLogprobs& scored) {
    auto where = by_seq_.find(scored.seq_id);
    if (where == by_seq_.end()) return;  // aborted during the step
    RequestState& r = *where->second.first;
    if (r.request.num_prompt_logprobs < 0 || r.prompt_logprobs_sent) return;
    // Chunks arrive in prompt order; a recompute after preemption repeats positions held here.
    for (size_t i = 0; i < scored.tokens.size(); ++i) {
        const int64_t pos = scored.first_pos + static_cast<int64_t>(i);
        if (pos == 1 + static_cast<int64_t>(r.prompt_logprobs.size()))
            r.prompt_logprobs.push_back(scored.tokens[i]);
    }
    if (static_cast<int64_t>(r.prompt_logprobs.size()) + 1 < r.usage.prompt_tokens) return;
    GenerationDelta d;
    d.prompt_logprobs = std::move(r.prompt_logprobs);
    r.prompt_logprobs_sent = true;
    r.sink->OnDelta(d);
}

void InstanceEngine::HandleResult(const StepPlan& plan, const StepResult& result) {
    // Failed receives leave the scheduler before OnStepComputed (their blocks hold no KV and
    // must not be published to the prefix cache).
    HandleTransfers(plan, result);
    scheduler_.OnStepComputed(plan);
    blocks_.SetTime(clock_.Now());
    // Before the tokens: a request's prompt logprobs precede its first token.
    for (const PromptLogprobs& scored : result.prompt_logprobs) CollectPromptLogprobs(scored);
    std::vector<std::string> to_hand_off;
    for (const SampledToken& t : result.tokens) {
        auto where = by_seq_.find(t.seq_id);
        if (where == by_seq_.end()) continue;  // aborted during the step
        RequestState& r = *where->second.first;
        const int index = where->second.second;
        Sequence* seq = r.choices[static_cast<size_t>(index)].get();
        if (r.request.max_tokens > 0) {
            // A generated token (max_tokens 0 drops the one sampled after the prompt).
            r.usage.completion_tokens++;
            ObserveToken(r, index);
        }
        // A sampler created for this sequence elsewhere (after a handoff) continues this stream.
        if (t.rng_state != 0) seq->sampling.seed = t.rng_state;
        // The prompt is computed and published: pin its breakpoints (before the choice may
        // finish and free its blocks).
        if (index == 0 && !r.pins_made && !r.request.cache_breakpoints.empty() &&
            seq->num_computed >= seq->num_prompt_tokens) {
            MakePins(r);
        }
        TokenOutcome out =
            output_.OnToken(r.request, index, t, *r.streams[static_cast<size_t>(index)],
                            seq->num_generated, seq->num_tokens());
        if (out.append) scheduler_.AppendToken(seq, t.token_id);
        if (!r.constraints.empty() && out.append && !out.finish) {
            grammar::Constraint& c = *r.constraints[static_cast<size_t>(index)];
            if (!c.Accept(t.token_id)) {
                // The mask allowed it; a worker that ignored the mask would get here.
                spdlog::error("request {}: sampled token {} outside its grammar",
                              r.request.request_id, t.token_id);
                out.delta.text += r.streams[static_cast<size_t>(index)]->Finish();
                out.finish = FinishReason::kAbort;
            } else if (c.state().Finished() && c.state().CanEnd()) {
                // Complete and nothing may follow: end here rather than wait for an end token.
                out.delta.text += r.streams[static_cast<size_t>(index)]->Finish();
                out.finish = FinishReason::kStop;
            } else if (!c.AnyAllowed()) {
                // No token of the vocabulary continues the text: it cannot be completed.
                out.delta.text += r.streams[static_cast<size_t>(index)]->Finish();
                out.finish = FinishReason::kLength;
            }
        }
        if (out.finish) FinishChoice(r, index, *out.finish, &out.delta);
        r.sink->OnDelta(out.delta);
        if (r.handoff_to != nullptr) {
            if (r.num_finished == 0) {
                to_hand_off.push_back(r.request.request_id);
            } else {
                // Done with the first token: the KV sent to the decode instance is not needed.
                r.handoff_to->DiscardTransfer(r.transfer_id);
                r.handoff_to = nullptr;
            }
        }
        CompleteIfDone(r.request.request_id);
    }
    for (const std::string& id : to_hand_off) HandOff(*requests_.at(id));
}

void InstanceEngine::FailAll(const StepPlan& plan, const Status& cause, bool stopping) {
    if (requests_.empty()) return;
    if (stopping) {
        spdlog::warn("[{}] {}: ending {} requests", config_.name, cause.message(),
                     requests_.size());
    } else {
        spdlog::error("[{}] step {}: {}; failing {} requests", config_.name, plan.step_id,
                      cause.ToString(), requests_.size());
    }
    // What the clients are told: the cause in kvshard's words, or the shutdown as it is.
    const Status status = stopping ? cause : ClientStatus(config_.name, cause);
    std::vector<std::string> ids;
    for (const auto& [id, r] : requests_) ids.push_back(id);
    for (const std::string& id : ids) {
        RequestState& r = *requests_[id];
        if (r.handoff_from != nullptr && r.num_finished == 0) {
            // Back to the prefill instance: it still holds the KV if it never arrived here, and
            // recomputes it otherwise.
            ReturnHandoff(id, status);
            continue;
        }
        for (int i = 0; i < r.request.n; ++i) {
            if (r.finished[static_cast<size_t>(i)]) continue;
            Sequence* seq = r.choices[static_cast<size_t>(i)].get();
            scheduler_.Remove(seq);
            by_seq_.erase(seq->seq_id);
        }
        ObserveFinished(r, status);
        r.sink->OnFinish(r.usage, status);
        requests_.erase(id);
        std::lock_guard<std::mutex> lock(mu_);
        num_queued_--;
    }
}

std::optional<StepPlan> InstanceEngine::PlanStep() {
    std::optional<StepPlan> plan = Plan();
    Publish();  // admissions and evictions change the prefix cache too
    return plan;
}

std::optional<StepPlan> InstanceEngine::Plan() {
    CheckEpoch();
    plan_epoch_ = epoch_;
    blocks_.SetTime(clock_.Now());  // pins past their TTL lapse before this step's admissions
    DrainInbox();
    bool has_discards = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        has_discards = !discards_.empty() || !readies_.empty();
    }
    if (!scheduler_.HasWork() && !has_discards) return std::nullopt;
    StepPlan plan = scheduler_.Schedule();
    ObserveScheduled(plan);
    AddTransferOps(&plan);
    AddTokenMasks(&plan);
    // Nothing fits now (every waiting prompt needs blocks that running sequences hold and nothing
    // is running): cannot happen with a validated config, but the caller must not spin on it.
    if (plan.sequences.empty() && plan.block_copies.empty() && plan.kv_discards.empty() &&
        plan.kv_ready.empty())
        return std::nullopt;
    return plan;
}

std::shared_ptr<const grammar::Vocabulary> InstanceEngine::GrammarVocabulary() {
    std::lock_guard<std::mutex> lock(grammar_vocab_mu_);
    if (grammar_vocab_ == nullptr) {
        std::vector<std::string> bytes(static_cast<size_t>(tokenizer_.vocab_size()));
        for (int32_t id = 0; id < tokenizer_.vocab_size(); ++id) {
            if (!tokenizer_.IsControl(id))
                bytes[static_cast<size_t>(id)] = tokenizer_.TokenBytes(id);
        }
        grammar_vocab_ =
            std::make_shared<grammar::Vocabulary>(std::move(bytes), config_.stop_token_ids);
    }
    return grammar_vocab_;
}

void InstanceEngine::AddTokenMasks(StepPlan* plan) {
    for (ScheduledSequence& s : plan->sequences) {
        if (!s.sample) continue;
        auto where = by_seq_.find(s.seq_id);
        if (where == by_seq_.end()) continue;
        RequestState& r = *where->second.first;
        if (r.constraints.empty()) continue;
        s.allowed_tokens = r.constraints[static_cast<size_t>(where->second.second)]->Mask();
    }
}

void InstanceEngine::CompleteStep(const StepPlan& plan, Result<StepResult> result) {
    num_steps_++;
    if (result.ok() && executor_.epoch() != plan_epoch_) {
        // Re-formed between planning and running: the plan's cached blocks are not on the new
        // workers.
        result = Status(StatusCode::kUnavailable, "the workers were re-formed during the step");
    }
    const Status status = !result.ok() ? result.status() : StepError(*result);
    {
        std::lock_guard<std::mutex> lock(stats_mu_);
        last_step_status_ = status.ok() ? status : ClientStatus(config_.name, status);
        last_step_epoch_ = plan_epoch_;
    }
    if (!status.ok()) {
        FailAll(plan, status);
        Publish();
    } else {
        if (config_.observer != nullptr) {
            int64_t num_tokens = 0;
            for (const ScheduledSequence& s : plan.sequences)
                num_tokens += static_cast<int64_t>(s.token_ids.size());
            if (num_tokens > 0) config_.observer->OnStepTokens(num_tokens);
        }
        HandleResult(plan, *result);
        Publish(&plan);
    }
}

bool InstanceEngine::RunStep() {
    std::optional<StepPlan> plan = PlanStep();
    if (!plan) return false;
    CompleteStep(*plan, executor_.Execute(*plan));
    return true;
}

}  // namespace kvshard
