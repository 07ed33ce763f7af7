// InstanceEngine: the engine of one instance — one engine thread that owns the scheduler and the
// block manager, takes requests and aborts through a queue, runs steps on the instance's
// StepExecutor, turns sampled tokens into text (UTF-8 safe, stop strings) and reports to each
// request's sink. The step loop never waits on HTTP I/O: sinks only enqueue.
//
//   loop: drain inbox → plan = scheduler.Schedule() → result = executor.Execute(plan)
//         → scheduler.OnStepComputed(plan) → per sampled token: detokenize, stop checks, deltas
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "comm/step_executor.h"
#include "coordinator/engine_api.h"
#include "coordinator/scheduler.h"
#include "kv/block_manager.h"
#include "model/tokenizer.h"

namespace kvshard {

struct InstanceEngineConfig {
    SchedulerConfig scheduler;
    kv::BlockManagerConfig blocks;
    int64_t max_context = 2048;          // prompt + generated tokens of one sequence
    int64_t max_waiting_requests = 256;  // Submit returns ResourceExhausted beyond this
    std::vector<int32_t> stop_token_ids;  // EOS (and the like); ignored with ignore_eos
};

class InstanceEngine : public Engine {
public:
    // `tokenizer` and `executor` must outlive the engine. Start() launches the engine thread.
    InstanceEngine(const InstanceEngineConfig& config, const Tokenizer& tokenizer, StepExecutor& executor);
    ~InstanceEngine() override;

    static Status ValidateConfig(const InstanceEngineConfig& config);

    void Start();
    // Finishes every request with an Unavailable status and joins the thread.
    void Stop();

    Status Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink) override;
    void Abort(const std::string& request_id) override;
    EngineStats Stats() const override;
    int64_t max_context() const override { return config_.max_context; }

    // Block-manager stats as of the last step (for tests: every block free or cached when idle).
    kv::BlockManagerStats BlockStats() const;
    int64_t num_steps() const { return num_steps_.load(); }

private:
    struct RequestState;

    void Loop();
    void DrainInbox();
    void Admit(std::unique_ptr<RequestState> state);
    void HandleResult(const StepPlan& plan, const StepResult& result);
    void FinishChoice(RequestState& r, int index, FinishReason reason, GenerationDelta* delta);
    void CompleteIfDone(const std::string& request_id);
    void FailAll(const StepPlan& plan, const Status& status);
    void PublishStats();

    const InstanceEngineConfig config_;
    const Tokenizer& tokenizer_;
    StepExecutor& executor_;
    kv::BlockManager blocks_;
    Scheduler scheduler_;

    // Engine-thread state.
    std::unordered_map<std::string, std::unique_ptr<RequestState>> requests_;
    std::unordered_map<int64_t, std::pair<RequestState*, int>> by_seq_;  // seq id -> (request, choice)
    int64_t next_seq_id_ = 1;

    // Inbox: guarded by mu_.
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::unique_ptr<RequestState>> inbox_;
    std::vector<std::string> aborts_;
    bool stopping_ = false;
    int64_t num_queued_ = 0;  // submitted, not yet finished (guarded by mu_)

    // Published by the engine thread after each step.
    mutable std::mutex stats_mu_;
    EngineStats stats_;
    kv::BlockManagerStats block_stats_;
    std::atomic<int64_t> num_steps_{0};

    std::thread thread_;
};

}  // namespace kvshard
