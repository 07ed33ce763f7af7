// Throughput measurement of one ModelRunner: prefill and decode tokens/s at a given batch size.
// Used by `kvshard bench-engine` (and scripts/bench-engine, which runs llama.cpp beside it).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "worker/model_runner.h"

namespace kvshard {

struct ThroughputConfig {
    int64_t batch = 1;            // sequences computed together in each step
    int64_t prompt_tokens = 128;  // per sequence, prefilled in one step
    int64_t decode_tokens = 64;   // decode steps after the prefill
    int64_t runs = 3;             // repetitions; figures are medians
};

struct ThroughputFigures {
    double prefill_tokens_per_second = 0;  // batch * prompt_tokens / prefill time (median)
    double decode_tokens_per_second = 0;   // batch * decode_tokens / decode time (median)
    std::vector<double> prefill_runs;      // each run's figure
    std::vector<double> decode_runs;
};

// Runs `runs` times: prefill `batch` sequences of `prompt_tokens` deterministic pseudo-random
// tokens in one Forward call, then `decode_tokens` steps of one token per sequence (the argmax of
// the previous step). The runner's cache is left empty.
Result<ThroughputFigures> MeasureThroughput(ModelRunner& runner, const ThroughputConfig& config);

}  // namespace kvshard
