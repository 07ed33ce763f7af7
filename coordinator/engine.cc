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
    // The KV of the prompts handed off to a decode instance was on the old workers too: their
    // blocks go (before the cache is dropped, so none stays cached), and a handoff that comes
    // back is recomputed here (ResumeHandoff), never decoded from blocks the new workers never
    // wrote.
    const size_t handed_off = handed_off_.size();
    for (const auto& [transfer_id, seq_id] : handed_off_) scheduler_.ReleaseDetached(seq_id);
    handed_off_.clear();
    const int64_t dropped = blocks_.DropCachedBlocks();
    prefix_forced_++;
    spdlog::info(
        "[{}] workers re-formed (epoch {} -> {}): {} cached KV blocks forgotten, {} "
        "handed-off prompts' KV released",
        config_.name, epoch_, now, dropped, handed_off);
    // Every sequence that held blocks had a step fail when the old workers went (FailAll), so
    // none should hold any now: a block still in use names KV the new workers never wrote, and
    // its cache entry stayed. Said loudly, as the recovery tests check that it never happens.
    if (const kv::BlockManagerStats b = blocks_.Stats(); b.num_used_blocks > 0) {
        spdlog::warn(
            "[{}] workers re-formed with {} KV blocks still in use by {} sequences: their KV "
            "is not on the new workers",
            config_.name, b.num_used_blocks, b.num_sequences);
    }
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
bool InstanceEngine::HasWorkLocked() const {
    return !inbox_.empty() || !aborts_.empty() || !handoffs_in_.empty() ||
           !handoffs_done_.empty() || !discards_.empty() || !readies_.empty() ||
           scheduler_.HasWork();
}

bool InstanceEngine::HasWork() const {
    std::lock_guard<std::mutex> lock(mu_);
    return HasWorkLocked();
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
