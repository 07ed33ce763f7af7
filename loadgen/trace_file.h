// The request trace of `kvshard bench --trace-out PATH`: the requests the run actually sent, as
// the JSON lines `kvshard simulate --dataset trace --trace PATH` replays (sim/workload.h
// ReadTrace), so a simulation sees the same lengths and arrival times as the measured run:
//
//   {"arrival_s": 0.413, "prompt_len": 612, "output_len": 32}
//   {"arrival_s": 1.052, "prompt_len": 431, "output_len": 32, "prefix_group": 1, "prefix_len": 402}
//
// arrival_s is when the request was sent, from the run's start; prompt_len is the server's
// usage.prompt_tokens; output_len the tokens it generated (usage.completion_tokens). Prompts
// that share a prefix (shared-prefix) carry the group (their order of first appearance) and the
// prefix's tokens as the server's /tokenize counts them (with the BOS the completions route
// adds). Only requests that completed are written: a failed one has no counted lengths.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "loadgen/bench_runner.h"
#include "loadgen/dataset.h"
#include "loadgen/sharegpt.h"

namespace kvshard::loadgen {

struct TraceLineFields {
    double arrival_s = 0;
    int64_t prompt_len = 0;
    int64_t output_len = 0;
    int64_t prefix_group = -1;  // -1: none
    int64_t prefix_len = 0;
};
// One line, without its newline.
std::string TraceLine(const TraceLineFields& fields);

// The trace's lines for a finished run, in the order sent. `count_tokens` is asked once per
// distinct prefix. Errors: Unavailable when a completed request's usage lacked
// prompt_tokens (the simulator needs the server's count), a counter's error.
// REQUIRES: run.outcomes has one outcome per prompt.
Result<std::vector<TraceLineFields>> MakeTrace(const std::vector<BenchPrompt>& prompts,
                                               const BenchRun& run,
                                               const TokenCounter& count_tokens);

// Writes the lines to `path` (replacing the file); InvalidArgument naming the path when it
// cannot be written.
Status WriteTraceFile(const std::string& path, const std::vector<TraceLineFields>& lines);

}  // namespace kvshard::loadgen
