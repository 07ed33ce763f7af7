#include "coordinator/engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/engine_state.h"

namespace kvshard {

Status InstanceEngine::Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink) {
    return SubmitWithHandoff(std::move(request), std::move(sink), nullptr, 0);
}

Status ValidateCacheBreakpoints(const std::vector<CacheBreakpoint>& breakpoints,
                                int64_t prompt_tokens) {
    constexpr size_t kMaxBreakpoints = 4;
    constexpr int64_t kMaxTtlMs = 24 * 3'600'000;
    if (breakpoints.size() > kMaxBreakpoints) {
        return InvalidArgument("cache_breakpoints: at most " + std::to_string(kMaxBreakpoints) +
                               " per request, got " + std::to_string(breakpoints.size()));
    }
    int64_t last = 0;
    for (size_t i = 0; i < breakpoints.size(); ++i) {
        const CacheBreakpoint& b = breakpoints[i];
        const std::string at = "cache_breakpoints[" + std::to_string(i) + "]";
        if (b.prefix_tokens < 1 || b.prefix_tokens > prompt_tokens) {
            return InvalidArgument(at + ".prefix_tokens must be in 1.." +
                                   std::to_string(prompt_tokens) + " (the prompt), got " +
                                   std::to_string(b.prefix_tokens));
        }
        if (b.prefix_tokens <= last) {
            return InvalidArgument(at +
                                   ".prefix_tokens must grow: " + std::to_string(b.prefix_tokens) +
                                   " after " + std::to_string(last));
        }
        if (b.ttl_ms < 1 || b.ttl_ms > kMaxTtlMs) {
            return InvalidArgument(at + ".ttl_ms must be in 1.." + std::to_string(kMaxTtlMs) +
                                   ", got " + std::to_string(b.ttl_ms));
        }
        last = b.prefix_tokens;
    }
    return Status::Ok();
}

Status InstanceEngine::ValidateConfig(const InstanceEngineConfig& c) {
    KV_RETURN_IF_ERROR(c.scheduler.Validate());
    KV_RETURN_IF_ERROR(c.blocks.Validate());
    if (c.max_context <= 0) return InvalidArgument("max_context must be positive");
    // A prompt of max_context tokens takes its blocks in every KV cache group before a window
    // releases any.
    const auto groups = std::max<int64_t>(1, static_cast<int64_t>(c.blocks.group_windows.size()));
    const int64_t blocks_for_one =
        groups * ((c.max_context + c.blocks.block_size - 1) / c.blocks.block_size);
    if (blocks_for_one > c.blocks.num_blocks) {
        return InvalidArgument(
            "the KV pool (" + std::to_string(c.blocks.num_blocks) + " blocks of " +
            std::to_string(c.blocks.block_size) +
            (groups > 1 ? " in " + std::to_string(groups) + " KV cache groups" : std::string()) +
            ") cannot hold one sequence of max_context " + std::to_string(c.max_context) +
            " tokens");
    }
    return Status::Ok();
}

InstanceEngine::InstanceEngine(const InstanceEngineConfig& config, const Tokenizer& tokenizer,
                               StepExecutor& executor)
    : config_(config),
      clock_(config.clock != nullptr ? *config.clock : Clock::Real()),
      tokenizer_(tokenizer),
      executor_(executor),
      blocks_(config.blocks),
      scheduler_(config.scheduler, blocks_),
      output_(config.stop_token_ids, config.max_context),
      epoch_(executor.epoch()),
      first_epoch_(epoch_) {
    KV_CHECK(ValidateConfig(config).ok()) << ValidateConfig(config).ToString();
    Publish();
}

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

}  // namespace

InstanceEngine::~InstanceEngine() { Stop(); }

void InstanceEngine::Start() {
    KV_CHECK(!thread_.joinable());
    thread_ = std::thread([this] { Loop(); });
}

void InstanceEngine::Stop() {
    bool was_stopping = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        was_stopping = stopping_;
        stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) {
        thread_.join();
    } else if (!was_stopping) {
        Shutdown();  // stepped by a driver: end its requests here
    }
}

Status InstanceEngine::SubmitWithHandoff(GenerationRequest request,
                                         std::shared_ptr<RequestSink> sink, InstanceEngine* decode,
                                         uint64_t transfer_id) {
    if (decode != nullptr && request.n != 1)
        return InvalidArgument("a handed-off request must have n = 1");
    const auto prompt_len = static_cast<int64_t>(request.prompt_token_ids.size());
    if (prompt_len == 0) return InvalidArgument("the prompt has no tokens");
    if (request.max_tokens < 0) return InvalidArgument("max_tokens must not be negative");
    if (request.num_prompt_logprobs < -1 || request.num_prompt_logprobs > kMaxLogprobs) {
        return InvalidArgument("prompt logprobs must be -1 (none) or 0.." +
                               std::to_string(kMaxLogprobs));
    }
    if (request.n < 1) return InvalidArgument("n must be at least 1");
    if (request.n > config_.scheduler.max_num_seqs) {
        // Its n sequences must run at once, and a step runs at most max_num_seqs.
        return InvalidArgument("n (" + std::to_string(request.n) +
                               ") exceeds the instance's scheduler.max_num_seqs (" +
                               std::to_string(config_.scheduler.max_num_seqs) + ")");
    }
    if (prompt_len + request.max_tokens > config_.max_context) {
        return OutOfRange("the prompt (" + std::to_string(prompt_len) +
                          " tokens) plus max_tokens (" + std::to_string(request.max_tokens) +
                          ") exceed the context of " + std::to_string(config_.max_context) +
                          " tokens");
    }
    for (int32_t t : request.prompt_token_ids) {
        if (t < 0 || t >= tokenizer_.vocab_size())
            return InvalidArgument("token id " + std::to_string(t) + " outside the vocabulary");
    }
    KV_RETURN_IF_ERROR(ValidateCacheBreakpoints(request.cache_breakpoints, prompt_len));
    if (request.grammar != nullptr &&
        !grammar::Constraint(request.grammar, GrammarVocabulary()).AnyAllowed()) {
        return InvalidArgument(
            "the structured output cannot begin with any token of the model's vocabulary");
    }
    if (!executor_.Health().ok()) {
        return Status(StatusCode::kUnavailable,
                      "instance '" + config_.name + "' cannot serve now: its workers are down");
    }
    auto state = std::make_unique<RequestState>();
    state->request = std::move(request);
    state->sink = std::move(sink);
    state->arrival = state->request.arrival.value_or(clock_.Now());
    state->handoff_to = decode;
    state->transfer_id = transfer_id;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_) return Status(StatusCode::kUnavailable, "the engine is shutting down");
        if (num_queued_ >=
            config_.scheduler.max_num_seqs + config_.scheduler.max_waiting_requests) {
            return Status(
                StatusCode::kResourceExhausted,
                "too many requests in flight (" + std::to_string(num_queued_) + "); retry later");
        }
        num_queued_++;
        inbox_.push_back(std::move(state));
    }
    cv_.notify_one();
    return Status::Ok();
}

void InstanceEngine::Abort(const std::string& request_id) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        aborts_.push_back(request_id);
    }
    cv_.notify_one();
}

int64_t InstanceEngine::NumRequests() const {
    std::lock_guard<std::mutex> lock(mu_);
    return num_queued_;
}

Status InstanceEngine::Health() const {
    if (!executor_.Health().ok()) {
        return Status(StatusCode::kUnavailable,
                      "instance '" + config_.name + "': its workers are down");
    }
    std::lock_guard<std::mutex> lock(stats_mu_);
    // A failure of workers that have since been re-formed says nothing about the new ones.
    if (last_step_epoch_ != executor_.epoch()) return Status::Ok();
    return last_step_status_;
}

std::vector<std::string> InstanceEngine::kv_endpoints() const {
    // As configured until the workers are re-formed; then where the new workers listen.
    if (executor_.epoch() == first_epoch_) return config_.kv_endpoints;
    std::vector<std::string> now = executor_.kv_endpoints();
    return now.empty() ? config_.kv_endpoints : now;
}

void InstanceEngine::CheckEpoch() {
    const uint64_t now = executor_.epoch();
    if (now == epoch_) return;
    const int64_t dropped = blocks_.DropCachedBlocks();
    prefix_forced_++;
    spdlog::info("[{}] workers re-formed (epoch {} -> {}): {} cached KV blocks forgotten",
                 config_.name, epoch_, now, dropped);
    epoch_ = now;
}

EngineStats InstanceEngine::Stats() const {
    EngineStats s = snapshot()->stats;
    s.instances[0].up = executor_.Health().ok();  // now, not as of the last step
    return s;
}

// The blocks whose prefix-cache entry the step of `plan` may have added: those its chunks filled
// (OnStepComputed publishes each full block once) and those it received.
static std::vector<kv::BlockId> ComputedBlocks(const StepPlan& plan, int64_t block_size) {
    std::vector<kv::BlockId> out;
    for (const ScheduledSequence& s : plan.sequences) {
        const auto end =
            std::min<int64_t>((s.start_pos + static_cast<int64_t>(s.token_ids.size())) / block_size,
                              static_cast<int64_t>(s.block_table.size()));
        for (int64_t i = s.start_pos / block_size; i < end; ++i)
            out.push_back(s.block_table[static_cast<size_t>(i)]);
    }
    for (const KvRecvOp& op : plan.kv_recvs)
        out.insert(out.end(), op.block_table.begin(), op.block_table.end());
    // A table entry that holds no block (kv::kNoBlock) names nothing the cache can have added.
    std::erase_if(out, [](kv::BlockId b) { return b == kv::kNoBlock; });
    return out;
}

void InstanceEngine::Publish(const StepPlan* computed) {
    auto snap = std::make_shared<EngineSnapshot>();
    snap->version = ++snapshot_version_;
    const SchedulerStats s = scheduler_.Stats();
    const kv::BlockManagerStats b = blocks_.Stats();
    // Entries leave the prefix cache only by eviction or a dropped cache, and pins change only
    // with these counts or a Pin: without any of those, only what a step computed can be new.
    const PrefixChanges changes{b.num_evictions, b.num_pins,     b.num_pinned_blocks,
                                b.pins_expired,  b.pins_refused, prefix_forced_};
    // Evicted blocks are logged by the block manager: an eviction alone compares those only (a full
    // cache evicts every step, and comparing all blocks then cost O(num_blocks) per step).
    std::optional<std::vector<kv::BlockId>> uncached = blocks_.TakeUncachedBlocks();
    PrefixChanges others = changes;
    others.evictions = prefix_changes_.evictions;
    // (ComputedBlocks names group 0's blocks only: with KV cache groups, every block is read.)
    if (snapshot_version_ == 1 || others != prefix_changes_ || !uncached ||
        blocks_.num_groups() > 1) {
        snap->prefix = prefix_index_.Update(blocks_);
    } else {
        std::vector<kv::BlockId> changed = std::move(*uncached);
        if (computed != nullptr) {
            const std::vector<kv::BlockId> c = ComputedBlocks(*computed, blocks_.block_size());
            changed.insert(changed.end(), c.begin(), c.end());
        }
        snap->prefix =
            changed.empty() ? prefix_index_.last() : prefix_index_.UpdateBlocks(blocks_, changed);
    }
    prefix_changes_ = changes;
    EngineStats& st = snap->stats;
    st.instances = {{config_.name, config_.pool, executor_.Health().ok()}};
    st.num_running = s.num_running;
    st.num_waiting = s.num_waiting;
    st.kv_cache_usage = b.num_blocks > 0 ? double(b.num_used_blocks) / double(b.num_blocks) : 0.0;
    st.prefix_cache_queries_tokens = b.prompt_tokens;
    st.prefix_cache_hits_tokens = b.prompt_tokens_from_cache;
    st.num_preemptions = s.num_preemptions;
    st.pinned_blocks = b.num_pinned_blocks;
    st.pin_hits_total = b.pin_hits;
    st.pins_expired_total = b.pins_expired;
    st.pins_refused_total = b.pins_refused;
    st.cache_configs = {{config_.name, config_.blocks.block_size, b.num_blocks,
                         config_.blocks.enable_prefix_caching}};
    snap->blocks = b;
    snapshot_.store(std::move(snap));
}

// The tokens min_tokens holds back: every token that would end the choice (EOS and the like,
// unless the request ignores them, and its own stop_token_ids), by increasing id.
static std::vector<int32_t> MinTokensBans(const GenerationRequest& req,
                                          const std::vector<int32_t>& eos_ids) {
    std::vector<int32_t> ids = req.stop_token_ids;
    if (!req.ignore_eos) ids.insert(ids.end(), eos_ids.begin(), eos_ids.end());
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    return ids;
}

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
    delta->finish_reason = reason;
}

void InstanceEngine::CompleteIfDone(const std::string& request_id) {
    auto it = requests_.find(request_id);
    if (it == requests_.end() || it->second->num_finished < it->second->request.n) return;
    RequestState& r = *it->second;
    r.usage.cached_tokens = r.choices[0]->num_cached_tokens;
    ObserveFinished(r);
    r.sink->OnFinish(r.usage, Status::Ok());
    requests_.erase(it);
    std::lock_guard<std::mutex> lock(mu_);
    num_queued_--;
}

void InstanceEngine::MakePins(RequestState& r) {
    r.pins_made = true;
    if (config_.role == InstanceRole::kDecode) return;  // pins live where prompts are computed
    prefix_forced_++;                                   // the next publish reads every block's pins
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
        if (r.request.max_tokens > 0) r.usage.completion_tokens++;
        ObserveToken(r, index);
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
        r.sink->OnFinish(r.usage, status);
        requests_.erase(id);
        std::lock_guard<std::mutex> lock(mu_);
        num_queued_--;
    }
}

bool InstanceEngine::HasWorkLocked() const {
    return !inbox_.empty() || !aborts_.empty() || !handoffs_in_.empty() ||
           !handoffs_done_.empty() || !discards_.empty() || scheduler_.HasWork();
}

bool InstanceEngine::HasWork() const {
    std::lock_guard<std::mutex> lock(mu_);
    return HasWorkLocked();
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
        has_discards = !discards_.empty();
    }
    if (!scheduler_.HasWork() && !has_discards) return std::nullopt;
    StepPlan plan = scheduler_.Schedule();
    ObserveScheduled(plan);
    AddTransferOps(&plan);
    AddTokenMasks(&plan);
    // Nothing fits now (every waiting prompt needs blocks that running sequences hold and nothing
    // is running): cannot happen with a validated config, but the caller must not spin on it.
    if (plan.sequences.empty() && plan.block_copies.empty() && plan.kv_discards.empty())
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

void InstanceEngine::Loop() {
    for (;;) {
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [&] { return stopping_ || HasWorkLocked(); });
            if (stopping_) break;
        }
        if (!RunStep() && scheduler_.HasWork()) {
            // Work that cannot run now: wait for something to change rather than spin.
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait_for(lock, std::chrono::milliseconds(10));
        }
    }
    Shutdown();
}

void InstanceEngine::Shutdown() {
    // Finish what is left.
    DrainInbox();
    StepPlan none;
    FailAll(none, Status(StatusCode::kUnavailable, "the server is shutting down"),
            /*stopping=*/true);
    Publish();
}

}  // namespace kvshard
