// InstanceEngine: the engine of one instance — one engine thread that owns the scheduler and the
// block manager, takes requests and aborts through a queue, runs steps on the instance's
// StepExecutor, turns sampled tokens into text (UTF-8 safe, stop strings) and reports to each
// request's sink. The step loop never waits on HTTP I/O: sinks only enqueue.
//
//   step: plan = PlanStep()              take the inbox (requests, aborts, handoffs), then
//                                         scheduler.Schedule() and the plan's transfer ops
//         result = executor.Execute(plan)
//         CompleteStep(plan, result)      scheduler.OnStepComputed(plan), then per sampled token:
//                                         detokenize, stop checks, deltas, latency observations
// Start() runs steps on the engine's own thread whenever there is work. Without Start(), a driver
// runs them itself (RunStep, or PlanStep / CompleteStep around its own executor): `kvshard
// simulate` does, on a VirtualClock, and so do tests that must not sleep.
//
// Disaggregated serving (DESIGN.md data flow, step 6; docs/disaggregation.md). An instance has a
// role. A prefill instance takes requests that the router gave a decode instance to hand off to:
// the plan of the prompt's last chunk carries a KvSendOp (the workers send the KV to the decode
// instance's transports, layer by layer or after the step), the first token goes to the client at
// once, and the request — its sink, text streams and sequence — moves to the decode instance's
// inbox (AcceptHandoff), while the prefill side keeps the blocks. The decode instance admits it
// like a prompt whose KV arrives (Sequence::num_incoming_tokens), allocates its blocks (its own
// prefix-cache hits are skipped), and its next plan carries the KvRecvOp together with the first
// decode step. It then tells the prefill instance (FinishHandoff): done — the prefill side frees
// its blocks, full ones stay in its prefix cache — or failed (a transfer timed out, the decode
// instance failed or stopped) — the request comes back and continues on the prefill instance,
// which still holds its KV. So a request is owned by exactly one engine thread at any time, and
// no block is freed while a transfer may read it.
//
// Prompt caching (docs/prompt-caching.md). When choice 0 of a request with cache breakpoints has
// computed its prompt, each breakpoint's prefix is pinned in the block manager for its TTL (not
// on a decode instance: pins live where prompts are computed), and usage.cache_creation_tokens is
// the longest pinned prefix less the tokens the request read from the cache. Pins lapse on the
// engine's clock: the block manager's time is set from config.clock before each step's
// admissions and before each result is applied.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "comm/step_executor.h"
#include "common/clock.h"
#include "config/engine_config.h"
#include "coordinator/engine_api.h"
#include "coordinator/engine_snapshot.h"
#include "coordinator/output_stage.h"
#include "coordinator/scheduler.h"
#include "kv/block_manager.h"
#include "model/tokenizer.h"

namespace kvshard {

namespace grammar {
class Vocabulary;
}

// A request's prompt-caching breakpoints: at most 4 (as Anthropic allows), prefix_tokens
// increasing within 1..prompt_tokens, ttl_ms within 1 ms..24 h; InvalidArgument naming the
// breakpoint and field otherwise. Submit checks them.
Status ValidateCacheBreakpoints(const std::vector<CacheBreakpoint>& breakpoints,
                                int64_t prompt_tokens);

// The settings of one instance's engine. The scheduler, block and handoff settings are the config
// file's own sections (config/engine_config.h), taken whole: `kvshard serve` sets
// `scheduler = config.scheduler`, `blocks = config.kv_cache` (with the resolved num_blocks and
// the model's group_windows) and `handoff = config.kv_transfer`.
struct InstanceEngineConfig {
    std::string name = "instance-0";  // in logs and metrics
    std::string pool = "default";     // the pool it belongs to (per-pool metrics)
    PoolRole role = PoolRole::kMixed;
    int32_t tp = 1;
    std::vector<std::string> kv_endpoints;  // KV transport endpoint of each rank (handoff only)
    KvTransferConfig handoff;
    EngineObserver* observer = nullptr;  // not owned; may be null
    // The KV pair path (handoff.path nccl, worker processes): told of pairs reported down and
    // of transfers through them. Not owned; may be null.
    KvPairHealth* pair_health = nullptr;
    // max_waiting_requests: Submit returns ResourceExhausted beyond max_num_seqs + it.
    SchedulerConfig scheduler;
    kv::BlockManagerConfig blocks;
    int64_t max_context = 2048;           // prompt + generated tokens of one sequence
    std::vector<int32_t> stop_token_ids;  // EOS (and the like); ignored with ignore_eos
    // What arrival, token and handoff times are read from; null: Clock::Real(). Not owned.
    const Clock* clock = nullptr;
};

class InstanceEngine : public Engine {
  public:
    struct Handoff;  // a request on its way from a prefill instance to a decode instance

    // `tokenizer` and `executor` must outlive the engine. Start() launches the engine thread.
    InstanceEngine(const InstanceEngineConfig& config, const Tokenizer& tokenizer,
                   StepExecutor& executor);
    ~InstanceEngine() override;

    static Status ValidateConfig(const InstanceEngineConfig& config);

    void Start();
    // Finishes every request with an Unavailable status and joins the thread. Without Start(),
    // finishes them on the calling thread.
    void Stop();

    // One step, for a driver that did not Start() the engine (and by the engine thread).
    // PlanStep takes what arrived (requests, aborts, handoffs) and plans the next step; it
    // returns nothing when no step can run now (idle, or nothing fits until something finishes).
    // The plan must then be run and given to CompleteStep with its result before the next
    // PlanStep. RunStep does all three on the engine's executor; false when no step ran.
    std::optional<StepPlan> PlanStep();
    void CompleteStep(const StepPlan& plan, Result<StepResult> result);
    bool RunStep();
    // Requests queued or running, or a handoff or discard to take in (the stepping thread).
    bool HasWork() const;

    Status Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink) override;
    // Submit, and after prefill hand the request to `decode` (a decode instance of this process,
    // which must outlive this engine) under `transfer_id` (unique in the process). n must be 1.
    Status SubmitWithHandoff(GenerationRequest request, std::shared_ptr<RequestSink> sink,
                             InstanceEngine* decode, uint64_t transfer_id);
    // Called by a prefill instance's engine thread: queue a handed-off request. (Returned at
    // once to its source when this engine is stopping.)
    void AcceptHandoff(std::unique_ptr<Handoff> handoff);
    // Called by a decode instance's engine thread: the handoff of `transfer_id` completed
    // (`returned` null) or failed (`returned` holds the request, to continue here).
    void FinishHandoff(uint64_t transfer_id, std::unique_ptr<Handoff> returned,
                       const Status& status);
    // The KV of `transfer_id` will never be received here: drop what the workers staged.
    void DiscardTransfer(uint64_t transfer_id);
    // The KV pair path (kv_transfer.path: nccl), on the sending instance: the receiving instance
    // planned its receive of `transfer_id`; the next plan tells the workers (StepPlan.kv_ready).
    void ReadyTransfer(uint64_t transfer_id);
    // Requests on this instance now: submitted or handed over and not yet finished or handed on,
    // including those not yet taken from the inbox (any thread; the router's load).
    int64_t NumRequests() const;
    // What the engine published at the end of its last PlanStep or CompleteStep (any thread):
    // its prefix cache as the router reads it, and its stats (engine_snapshot.h). Never null.
    std::shared_ptr<const EngineSnapshot> snapshot() const { return snapshot_.load(); }
    const InstanceEngineConfig& config() const { return config_; }
    void Abort(const std::string& request_id) override;
    EngineStats Stats() const override;
    // Unavailable while the executor cannot run steps (a worker died or stalled: noticed by its
    // heartbeats, also while idle, until the workers are re-formed); else the error of the last
    // step if it failed, else OK. The message is for clients: no addresses (the log has them).
    Status Health() const override;
    // The KV endpoints of this instance's ranks: config().kv_endpoints, until the workers are
    // re-formed; then the new workers' (StepExecutor::kv_endpoints).
    std::vector<std::string> kv_endpoints() const;
    int64_t max_context() const override { return config_.max_context; }
    const Clock& clock() const override { return clock_; }

    // Block-manager stats as of the last publish (for tests: every block free or cached when idle).
    kv::BlockManagerStats BlockStats() const { return snapshot()->blocks; }
    int64_t num_steps() const { return num_steps_.load(); }

  private:
    struct RequestState;

    void Loop();
    std::optional<StepPlan> Plan();  // PlanStep without the publish
    void Shutdown();                 // after the last step: ends what is left
    bool HasWorkLocked() const;      // REQUIRES mu_
    void DrainInbox();
    void Admit(std::unique_ptr<RequestState> state);
    // Handoff steps (engine_handoff.cc), all on the engine thread.
    void AddTransferOps(StepPlan* plan);
    void HandleTransfers(const StepPlan& plan, const StepResult& result);
    void HandOff(RequestState& r);
    void AdmitHandoff(std::unique_ptr<Handoff> h);
    void ReturnHandoff(const std::string& request_id, const Status& status);
    void ResumeHandoff(uint64_t transfer_id, std::unique_ptr<Handoff> returned,
                       const Status& status);
    // Latencies (engine_latency.cc), measured here only, from the request's arrival: a
    // generated token of choice `index` (its time to first token or inter-token gap), the first
    // time each request of `plan` is scheduled (its queue time ends), and the request's end
    // (REQUIRES: called once per request, just before its sink's OnFinish; any thread).
    void ObserveToken(RequestState& r, int index);
    void ObserveScheduled(const StepPlan& plan);
    void ObserveFinished(const RequestState& r, const Status& status) const;
    // Pins the request's cache breakpoints on choice 0's computed prompt (not on a decode
    // instance) and sets its usage.cache_creation_tokens.
    void MakePins(RequestState& r);
    void HandleResult(const StepPlan& plan, const StepResult& result);
    // Adds a chunk's scored prompt tokens to its request; sends them once the prompt is whole.
    void CollectPromptLogprobs(const PromptLogprobs& scored);
    void FinishChoice(RequestState& r, int index, FinishReason reason, GenerationDelta* delta);
    void CompleteIfDone(const std::string& request_id);
    // Ends every request with an error: `cause` is logged; clients get it in kvshard's words
    // (ClientStatus), or as it is when `stopping`.
    void FailAll(const StepPlan& plan, const Status& cause, bool stopping = false);
    // Workers re-formed since the last step (a new executor epoch): their KV pools are empty, so
    // the prefix cache forgets its blocks. Engine thread.
    void CheckEpoch();
    // Publishes a new snapshot of the block manager and the stats (the stepping thread), after
    // `computed` ran, if not null.
    void Publish(const StepPlan* computed = nullptr);
    // Structured outputs: the tokenizer's vocabulary as bytes, built on first use. Any thread.
    std::shared_ptr<const grammar::Vocabulary> GrammarVocabulary();
    // Puts each constrained sequence's allowed tokens into `plan`, from its grammar state
    // after its last token (the step loop is synchronous: results are applied before planning).
    void AddTokenMasks(StepPlan* plan);

    const InstanceEngineConfig config_;
    const Clock& clock_;
    const Tokenizer& tokenizer_;
    StepExecutor& executor_;
    kv::BlockManager blocks_;
    Scheduler scheduler_;
    const OutputStage output_;

    // Engine-thread state.
    std::unordered_map<std::string, std::unique_ptr<RequestState>> requests_;
    std::unordered_map<int64_t, std::pair<RequestState*, int>>
        by_seq_;  // seq id -> (request, choice)
    int64_t next_seq_id_ = 1;
    std::mutex grammar_vocab_mu_;
    std::shared_ptr<const grammar::Vocabulary> grammar_vocab_;  // guarded by grammar_vocab_mu_
    uint64_t epoch_ = 0;          // the executor epoch whose workers hold this engine's cached KV
    uint64_t plan_epoch_ = 0;     // epoch_ when the plan in flight was made
    const uint64_t first_epoch_;  // the executor's epoch when the engine was made
    std::unordered_map<uint64_t, int64_t> handed_off_;  // transfer id -> detached seq id
    std::deque<std::string>
        unknown_aborts_;  // recent aborts of ids not here (a handoff in transit)

    // Inbox: guarded by mu_.
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::unique_ptr<RequestState>> inbox_;
    std::vector<std::string> aborts_;
    std::deque<std::unique_ptr<Handoff>> handoffs_in_;
    struct FinishedHandoff {
        uint64_t transfer_id = 0;
        std::unique_ptr<Handoff> returned;
        Status status;
    };
    std::deque<FinishedHandoff> handoffs_done_;
    std::vector<uint64_t> discards_;
    std::vector<uint64_t> readies_;  // ReadyTransfer's, for the next plan
    bool stopping_ = false;
    int64_t num_queued_ = 0;  // submitted, not yet finished (guarded by mu_)

    // Published by the stepping thread: after each PlanStep and CompleteStep (snapshot_), and
    // the outcome of each step (under stats_mu_). No other thread reads blocks_ or scheduler_.
    // The stepping thread's: the index builder, and what tells it whether a full update is due.
    struct PrefixChanges {
        int64_t evictions = 0, pins = 0, pinned_blocks = 0, pins_expired = 0, pins_refused = 0;
        uint64_t forced = 0;
        friend bool operator==(const PrefixChanges&, const PrefixChanges&) = default;
    };
    PrefixIndexBuilder prefix_index_;
    PrefixChanges prefix_changes_;
    uint64_t prefix_forced_ = 0;  // grows with each dropped cache and each Pin call
    uint64_t snapshot_version_ = 0;
    std::atomic<std::shared_ptr<const EngineSnapshot>> snapshot_;
    mutable std::mutex stats_mu_;
    Status last_step_status_;
    uint64_t last_step_epoch_ = 0;  // the epoch last_step_status_ was seen in
    std::atomic<int64_t> num_steps_{0};

    std::thread thread_;
};

}  // namespace kvshard
