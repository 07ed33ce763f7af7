// The step log of `kvshard serve --step-log FILE`: one JSON line per serving step, the points
// `kvshard simulate --device cpu --profile FILE` fits its CPU cost model to (sim/cost_model.h
// CpuProfile, docs/simulate.md "The CPU profile"):
//
//   {"instance": "mixed-0", "prefill_tokens": 512, "decode_seqs": 3, "kv_tokens": 1807,
//    "prefill_pairs": 131328, "cached_chunks": 1, "multi_row": 1, "decodes_since_prefill": 0,
//    "prefill_step": 1, "seconds": 0.231, "execute_seconds": 0.214, "start_clock_s": 81234.5617}
//
// prefill_tokens, decode_seqs, kv_tokens, prefill_pairs and cached_chunks count the plan as
// CostModel::Cost does (a sequence computing one token after a non-empty context decodes;
// kv_tokens sums every sequence's context after the step; prefill_pairs sums q x start_pos +
// q (q + 1) / 2 over the prefilling sequences; cached_chunks counts those with start_pos > 0
// whose sequence the previous step did not hold: a suffix after a prefix-cache hit; multi_row is
// 1 when prefill_tokens + decode_seqs >= 2, the matmuls' multi-row path; decodes_since_prefill
// numbers a decode-only step among those since the instance's last step with a prefill chunk,
// logged or not, 1 for the first, and is 0 for a step with a prefill chunk; prefill_step is 1
// when prefill_tokens > 0). `seconds` is
// the step's CYCLE: from the start of its Execute to the start of the next step's, while the engine
// stayed busy. That is what the simulator's event loop charges a step (the next step is planned the
// moment the previous one ends), and it holds what a pure forward pass lacks: the engine's output
// stage (detokenization, stop checks, stream deltas), the sinks handing chunks to HTTP threads,
// planning the next step and every other thread that competes for the cores meanwhile.
// `execute_seconds` is the workers' part alone, for reference.
//
// A step is written only when its cycle was measured: the next step must continue one of its
// sequences (a decode or the next prefill chunk), which the engine plans without waiting for new
// work. The last step of a busy period (every sequence finished; the engine may have slept until
// the next arrival) has no such successor and is not written, nor is the last step before
// shutdown.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/step_executor.h"
#include "common/clock.h"
#include "common/status.h"

namespace kvshard {

// A step's contents, as the CPU profile counts them.
struct StepShape {
    int64_t prefill_tokens = 0;
    int64_t decode_seqs = 0;
    int64_t kv_tokens = 0;
    int64_t prefill_pairs = 0;  // causal (query, key) pairs of the prefill chunks
    int64_t cached_chunks = 0;  // prefill chunks after a context not computed by the last step
    int64_t multi_row = 0;      // 1: two or more rows (prefill tokens + decoding sequences)
    int64_t prefill_step = 0;   // 1: a prefill chunk (prefill_tokens > 0)
    // Set by StepLogExecutor, which sees every step (ShapeOfStep leaves it 0): see above.
    int64_t decodes_since_prefill = 0;
};
// `previous_seq_ids` (sorted): the sequences of the step before `plan` on the same instance.
StepShape ShapeOfStep(const StepPlan& plan, const std::vector<int64_t>& previous_seq_ids = {});

struct StepLogPoint {
    std::string instance;
    StepShape shape;
    double seconds = 0;          // the cycle (see above)
    double execute_seconds = 0;  // Execute alone
    // The step's start on the log's clock, in seconds since its epoch (the real clock is
    // steady_clock: CLOCK_MONOTONIC on Linux, the clock of `kvshard bench --trace-out`'s
    // sent_clock_s), so steps can be lined up with the requests a client sent meanwhile.
    double start_clock_s = 0;
};
// One line, without its newline.
std::string StepLogLine(const StepLogPoint& point);

// The open file every instance writes to.
// Thread-safety: Write may be called from any thread (each instance's engine thread does).
class StepLog {
  public:
    // Creates or truncates `path`. InvalidArgument naming the path when it cannot be written.
    static Result<std::unique_ptr<StepLog>> Open(const std::string& path);
    ~StepLog();
    StepLog(const StepLog&) = delete;
    StepLog& operator=(const StepLog&) = delete;

    // Writes and flushes one line (a crash or kill loses no step already written).
    void Write(const StepLogPoint& point);

  private:
    explicit StepLog(std::FILE* file) : file_(file) {}
    std::mutex mu_;
    std::FILE* file_;  // owned; writes guarded by mu_
};

// A StepExecutor that runs every step on `inner` and logs it to `log`. Everything else is
// forwarded. Ownership: `inner`, `log` and `clock` are not owned and must outlive it.
// Thread-safety: Execute from one thread at a time (the engine's), as StepExecutor requires.
class StepLogExecutor : public StepExecutor {
  public:
    StepLogExecutor(StepExecutor& inner, StepLog& log, std::string instance,
                    const Clock& clock = Clock::Real());

    Result<StepResult> Execute(const StepPlan& plan) override;
    Status Health() const override { return inner_.Health(); }
    uint64_t epoch() const override { return inner_.epoch(); }
    std::vector<std::string> kv_endpoints() const override { return inner_.kv_endpoints(); }

  private:
    StepExecutor& inner_;
    StepLog& log_;
    const std::string instance_;
    const Clock& clock_;
    // The previous step, written once the next one shows whether the engine stayed busy.
    bool has_previous_ = false;
    StepShape previous_shape_;
    std::vector<int64_t> previous_seq_ids_;  // sorted
    Clock::time_point previous_start_;
    double previous_execute_s_ = 0;
    int64_t decodes_since_prefill_ = 0;  // of the last step executed (StepShape)
};

}  // namespace kvshard
