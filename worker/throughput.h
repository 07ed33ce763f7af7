// Throughput measurement of one ModelRunner: prefill and decode tokens/s at a given batch size.
// Used by `kvshard bench-engine` (and scripts/bench-engine, which runs llama.cpp beside it).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "worker/model_runner.h"
#include "worker/tp_group.h"

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
    // Share of the decode time spent inside collectives on this rank (median; 0 at tp 1).
    double decode_comm_fraction = 0;
};

// Runs `runs` times: prefill `batch` sequences of `prompt_tokens` deterministic pseudo-random
// tokens in one Forward call, then `decode_tokens` steps of one token per sequence (the argmax of
// the previous step). The runner's cache is left empty.
// Tensor parallel: every rank of an instance calls this with the same config at the same time
// (its own thread, or its own MPI process). The loops stay in lockstep because every rank sees
// the same logits and picks the same argmax; each rank times its own steps.
Result<ThroughputFigures> MeasureThroughput(ModelRunner& runner, const ThroughputConfig& config);

// The same on every rank of an embedded group at once; rank 0's figures.
Result<ThroughputFigures> MeasureThroughput(TpGroup& group, const ThroughputConfig& config);

}  // namespace kvshard
