// The contract between the HTTP front end and the engine of an instance (or the router in front
// of several). The front end turns an OpenAI request into a GenerationRequest and reads the
// answer from a RequestSink; it never sees blocks, steps or workers.
//
// Threads: Submit and Abort may be called from any thread (HTTP threads). The engine calls the
// sink from its own engine thread; sink methods must be quick and must not block (push to a queue
// or post to an I/O context). After OnFinish the sink is never called again.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/request.h"
#include "common/status.h"

namespace kvshard {

namespace grammar {
class Grammar;
}

// A prompt-caching breakpoint (Anthropic's cache_control, and the same extension field on the
// OpenAI routes; docs/prompt-caching.md): the full KV blocks of the prompt's first
// `prefix_tokens` tokens stay in the instance's prefix cache until `ttl_ms` after this request
// last read or wrote them (the engine's clock), instead of being left to LRU eviction.
struct CacheBreakpoint {
    int64_t prefix_tokens = 0;  // 1..prompt length: where the cached prefix ends
    int64_t ttl_ms = 300'000;   // 5 minutes, or 3,600,000 for Anthropic's "1h"
    friend bool operator==(const CacheBreakpoint&, const CacheBreakpoint&) = default;
};

struct GenerationRequest {
    std::string request_id;
    std::vector<int32_t> prompt_token_ids;  // tokenized by the front end (chat template applied)
    SamplingParams sampling;                // with n > 1, choice i uses seed + i
    // 0: the prompt is computed (and scored, with num_prompt_logprobs) and every choice ends
    // with kLength without a token (the loglikelihood call: echo + logprobs + max_tokens 0).
    int64_t max_tokens = 16;
    std::vector<std::string> stop;  // stop strings; the text ends before them
    bool ignore_eos = false;
    // More tokens that end a choice (vLLM's stop_token_ids), whatever ignore_eos says. A stop
    // token that is not a control token joins the text, as in vLLM.
    std::vector<int32_t> stop_token_ids;
    bool include_stop_str_in_output = false;  // the text ends after a matched stop string
    bool skip_special_tokens = true;          // false: control tokens' text is output too
    int n = 1;                      // choices sharing the prompt (blocks shared, copy on write)
    int32_t num_top_logprobs = -1;  // -1: none; 0: the chosen token's; k: also the top k
    // Prompt logprobs (vLLM's prompt_logprobs, echo with logprobs): -1: none; k (at most
    // kMaxLogprobs): every prompt token but the first is scored with the top k alternatives and
    // delivered in one delta (GenerationDelta.prompt_logprobs) before any token of any choice.
    // Such a request computes its whole prompt (no prefix-cache hit).
    int32_t num_prompt_logprobs = -1;
    // At most 4, in increasing prefix_tokens order (the front end checks both).
    std::vector<CacheBreakpoint> cache_breakpoints;
    // Structured outputs (grammar/): every choice's text is held to this grammar — each step
    // samples only tokens that keep it alive, and a choice whose text is complete and can go no
    // further ends there with kStop. Null: unconstrained.
    std::shared_ptr<const grammar::Grammar> grammar;
    // When the request arrived, on the engine's clock (Engine::clock): the front end's time of
    // reading it, from which the engine measures time to first token and end-to-end latency
    // (EngineObserver). Unset: when Submit is called.
    std::optional<Clock::time_point> arrival;
};

// Some new output of one choice. Text is UTF-8 complete and never part of a stop string.
struct GenerationDelta {
    int index = 0;  // choice
    std::string text;
    std::vector<int32_t> token_ids;
    std::vector<GeneratedTokenLogprob> logprobs;  // one per token id, when requested
    std::optional<FinishReason> finish_reason;  // set on the last delta of this choice
    // Once, on a delta of choice 0 with no tokens, when num_prompt_logprobs >= 0 and the prompt
    // has more than one token: the prompt tokens 1 .. end, in order (token 0 has no logprob).
    std::vector<PromptTokenLogprob> prompt_logprobs;
};

struct GenerationUsage {
    int64_t prompt_tokens = 0;
    int64_t completion_tokens = 0;  // over all choices
    int64_t cached_tokens = 0;      // prompt tokens served from the prefix cache
    // Prompt tokens this request wrote to the cache up to its cache breakpoints (computed here,
    // then pinned). The prompt's tokens = uncached input + cache_creation_tokens + cached_tokens.
    int64_t cache_creation_tokens = 0;
};

class RequestSink {
  public:
    virtual ~RequestSink() = default;
    virtual void OnDelta(const GenerationDelta& delta) = 0;
    // The request is over: every choice finished (status OK), or it failed (the status says why:
    // ResourceExhausted when the queue is full, OutOfRange when it cannot fit the context, ...).
    virtual void OnFinish(const GenerationUsage& usage, const Status& status) = 0;
};

// How a request ended, as the engine that ended it saw it (the decode instance after a
// handoff), for the per-request metrics vLLM's dashboards read. Every request the engine took
// ends once: finished (every choice ended, aborts included) or failed. Times are seconds on the
// engine's clock, from the request's one arrival time (GenerationRequest::arrival). The phases
// follow vLLM's: queue = arrival -> first scheduled in a step; prefill = first scheduled -> first
// generated token; decode = first -> last generated token (of any choice); inference = prefill +
// decode. A request that never got a token (aborted while waiting) has prefill and decode 0 and
// its queue time up to its end.
struct FinishedRequestStats {
    double e2e_seconds = 0.0;  // arrival -> end
    double queue_seconds = 0.0;
    double prefill_seconds = 0.0;
    double decode_seconds = 0.0;
    double inference_seconds = 0.0;
    // "stop", "length" or "abort" (the last choice to end says), or "error" when it failed.
    std::string finished_reason = "abort";
    bool failed = false;  // ended by an error status (the phases are then not observed)
    int64_t prompt_tokens = 0;
    int64_t generation_tokens = 0;  // over all choices
    int64_t cache_creation_tokens = 0;
    int n = 1;
    int64_t max_tokens = 0;
};

// What an engine reports for the metrics (coordinator/metrics.h ServerMetrics), called from
// engine threads (must be thread-safe and quick). The engine is the one owner of a request's
// latencies: it measures them once, on its clock, from the request's arrival; the front end
// only reads them here.
class EngineObserver {
  public:
    virtual ~EngineObserver() = default;
    // The request's first generated token (of any choice): seconds since its arrival.
    virtual void OnFirstToken(const std::string& pool, double seconds_since_arrival) = 0;
    // Each later generated token: seconds since its choice's previous token.
    virtual void OnInterToken(const std::string& pool, double seconds) = 0;
    // A KV handoff completed: bytes moved (all ranks) and seconds from the prefill step's end to
    // the end of the decode step that received it.
    virtual void OnKvTransfer(int64_t bytes, double seconds) = 0;
    // A KV handoff failed with `status` (the worker's code and message); the request continues
    // on the prefill instance.
    virtual void OnKvTransferFailed(const Status& status) = 0;
    // A step ran: the tokens it computed (prompt chunks plus one per decoding sequence).
    virtual void OnStepTokens(int64_t /*num_tokens*/) {}
    // A request ended (see FinishedRequestStats).
    virtual void OnRequestFinished(const FinishedRequestStats& /*stats*/) {}
};

// The KV pair path's pairs as the engines see them (kv_transfer.path: nccl with worker
// processes; serve gives its cli/kv_pair_replan.h KvPairPlan). Called on the engine threads of
// both instances of a pair: must be thread-safe and quick.
class KvPairHealth {
  public:
    virtual ~KvPairHealth() = default;
    // A transfer from `prefill` to `decode` failed and a worker said that its pairs with the
    // other instance, the ones that carry transfers from `pairs_first_transfer` on, are down
    // (TransferFailure::pairs_down).
    virtual void OnPairsDown(const std::string& prefill, const std::string& decode,
                             uint64_t pairs_first_transfer, const Status& why) = 0;
    // A transfer from `prefill` reached `decode` over the pairs.
    virtual void OnPairsTransferred(const std::string& prefill, const std::string& decode) = 0;
};

// Whether one instance can serve now (kvshard:instance_up).
struct InstanceUp {
    std::string instance;
    std::string pool;
    bool up = true;
};

// One instance's KV cache as configured (kvshard:cache_config_info).
struct CacheConfigInfo {
    std::string instance;
    int64_t block_size = 0;  // token slots per block
    int64_t num_blocks = 0;  // in the pool of each rank
    bool enable_prefix_caching = false;
};

struct EngineStats {
    std::vector<InstanceUp> instances;           // one per instance behind this engine
    std::vector<CacheConfigInfo> cache_configs;  // one per instance
    int64_t num_running = 0;
    int64_t num_waiting = 0;
    double kv_cache_usage = 0.0;  // used blocks / all blocks, 0..1
    int64_t prefix_cache_queries_tokens = 0;
    int64_t prefix_cache_hits_tokens = 0;
    int64_t num_preemptions = 0;  // sequences preempted (their KV recomputed later), since start
    // Prompt-caching pins (CacheBreakpoint), summed over instances.
    int64_t pinned_blocks = 0;       // blocks pinned now
    int64_t pin_hits_total = 0;      // requests that read a pinned prefix
    int64_t pins_expired_total = 0;  // pins that lapsed at their TTL
    int64_t pins_refused_total = 0;  // pins not made, or lapsed early, for lack of room
};

class Engine {
  public:
    virtual ~Engine() = default;
    // Queues a request. Errors that can be told at once (prompt longer than the context, a full
    // queue) are returned here and the sink is not called.
    virtual Status Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink) = 0;
    // Stops a request (a client went away); its blocks are freed within one step. Unknown ids are
    // ignored. The sink gets OnFinish with FinishReason kAbort deltas.
    virtual void Abort(const std::string& request_id) = 0;
    virtual EngineStats Stats() const = 0;
    // Largest prompt + max_tokens the engine accepts.
    virtual int64_t max_context() const = 0;
    // OK while the engine can serve requests; otherwise why not (e.g. its workers died). GET
    // /health answers 503 with this message.
    virtual Status Health() const { return Status::Ok(); }
    // What the engine reads arrival and token times from; the front end stamps arrivals with it.
    virtual const Clock& clock() const { return Clock::Real(); }
};

}  // namespace kvshard
