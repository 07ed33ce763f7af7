// Per-position decode step times after a gap: how the batch-1 decode steps right after something
// else ran (another sequence's prefill, an idle pause, a walk over unrelated memory) compare with
// the steps that follow them. `kvshard bench-engine --steps-after` prints them (docs/benchmarks.md,
// "Decode steps after a prefill (session 6)"); MeasureThroughput never prefills between decode
// steps, so its averages do not show what a served decode step right after a prompt costs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "worker/model_runner.h"
#include "worker/tp_group.h"

namespace kvshard {

// What runs between two rounds of measured decode steps.
enum class StepGap {
    kNone,     // nothing: the rounds follow each other (the flat baseline)
    kPrefill,  // a prompt of another sequence, prefilled in one step (a served mix)
    kIdle,     // the rank threads sleep (an idle server between requests)
    kSpin,     // the rank threads busy-wait as long (the cores kept busy, nothing read)
    // As long, a decode step of the decoding sequence's first position (its KV rewritten with the
    // same values) every kWarmEveryMs, sleeping between: the weights and KV kept in use.
    kWarm,
    kEvict,  // the rank threads read through a buffer of their own (caches filled with other data)
};

std::string_view StepGapName(StepGap gap);
// "none", "prefill", "idle", "spin", "warm" or "evict"; InvalidArgument naming the value otherwise.
Result<StepGap> ParseStepGap(std::string_view name);

// kWarm's period.
constexpr double kWarmEveryMs = 10;

struct StepsAfterGapConfig {
    // The decoding sequence's prompt (prefilled once); each round decodes positions context ..
    // context + steps - 1 again (the same tokens, its KV rewritten), so every round attends over
    // the same context.
    int64_t context = 256;
    int64_t steps = 16;  // decode steps measured after each gap
    // Gaps taken in turn, one round each per repeat, so the kinds are interleaved.
    std::vector<StepGap> gaps = {StepGap::kPrefill, StepGap::kNone};
    int64_t prefill_tokens = 256;              // kPrefill: the other sequence's prompt
    double idle_ms = 200;                      // kIdle
    int64_t evict_bytes = int64_t{256} << 20;  // kEvict: read by each rank's thread
    int64_t repeats = 20;  // rounds of each gap measured (after one unmeasured round of each)
};

struct StepPositionFigures {
    StepGap gap = StepGap::kNone;
    std::vector<double> step_ms;       // median over repeats of step i after the gap
    std::vector<double> minor_faults;  // median minor page faults of the process in step i
    double gap_ms = 0;                 // median time of the gap itself
    // The tokens each round decoded (greedy); the same in every round and after every gap, or
    // MeasureStepsAfterGap fails.
    std::vector<int32_t> tokens;
};

// Runs the rounds on `runner` (tp 1) and returns one figure per gap kind, in config.gaps' order.
// Internal error when a round decodes other tokens than the first (a gap changed the decoding
// sequence's KV). InvalidArgument for non-positive sizes or a pool/context too small for two
// sequences of max(context + steps, prefill_tokens) tokens. Tensor parallel: every rank of an
// instance calls this with the same config at the same time; each times its own steps.
Result<std::vector<StepPositionFigures>> MeasureStepsAfterGap(ModelRunner& runner,
                                                              const StepsAfterGapConfig& config);

// The same on every rank of an embedded group at once; rank 0's figures.
Result<std::vector<StepPositionFigures>> MeasureStepsAfterGap(TpGroup& group,
                                                              const StepsAfterGapConfig& config);

// Tokens each of the two sequences takes: the runner's max_context must hold them, and its pool
// two sequences of them in every KV cache group (what the caller sizes RunnerOptions from).
int64_t StepsAfterGapTokensPerSequence(const StepsAfterGapConfig& config);

}  // namespace kvshard
