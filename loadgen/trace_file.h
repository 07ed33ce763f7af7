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
//
// Each line also carries what the client measured for that request, in milliseconds: ttft_ms
// (sent -> first chunk with text), e2el_ms (sent -> stream ended) and itl_median_ms (the median
// of its gaps between chunks with text; absent for a one-chunk answer) and itl_ms (those gaps, in
// the order received: what a bootstrap of the run's ITL median over tokens resamples,
// scripts/lib/median_bootstrap.py). The simulator reads
// only the request; `kvshard simulate --per-request-out` writes its own figures for the same
// requests, in the same order, so the two can be compared request by request. sent_clock_s is
// when the request was sent on the machine's steady clock (CLOCK_MONOTONIC), the clock of a
// step log's start_clock_s (coordinator/step_log.h) when the server runs on the same machine.
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
    // Measured by the client (see above); negative: not written.
    double ttft_ms = -1;
    double e2el_ms = -1;
    double itl_median_ms = -1;
    std::vector<double> itl_ms = {};  // every gap; empty: not written
    // When it was sent on the machine's steady clock (BenchRun::start_clock_s + arrival_s), to
    // line the request up with a step log written on the same machine; negative: not written.
    double sent_clock_s = -1;
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

// `kvshard simulate --per-request-out PATH`: one JSON line per request, in the order of the
// requests simulated (a trace's are sorted by arrival, as --trace-out writes them, so line i
// answers the trace's line i):
//   {"request": 0, "arrival_s": 0.41, "prompt_len": 612, "ok": true, "output_len": 32,
//    "ttft_ms": 1702.3, "e2el_ms": 2410.9, "itl_median_ms": 23.2, "itl_ms": [22.9, 23.5, ...]}
// with the names and meanings of a trace's measured fields; a failed request (refused, timed
// out) has "ok": false and its "error", and no ttft_ms when it produced no token.
std::string PerRequestLine(size_t index, const RequestOutcome& outcome);
// InvalidArgument naming --per-request-out and the path when it cannot be written.
Status WritePerRequestFile(const std::string& path, const std::vector<RequestOutcome>& outcomes);

}  // namespace kvshard::loadgen
