// The per-request result file of `kvshard bench --result-file PATH`: JSON lines, one per request
// in dataset order, with what the report is computed from, so a user can recompute its figures
// (or others) from the raw measurements:
//
//   {"index": 0, "ok": true, "error": null, "start_ms": 1.2, "prompt_tokens": 31,
//    "dataset_prompt_tokens": 31, "max_tokens": 64, "output_tokens": 64, "ttft_ms": 20.5,
//    "itl_ms": [3.1, ...], "tpot_ms": 3.2, "e2el_ms": 222.0, "cached_tokens": null}
//
// Times in milliseconds; start_ms from the run's start. The report's TTFT, TPOT, ITL and E2E are
// the lines with "ok": true (ttft_ms, tpot_ms where not null, every itl_ms, e2el_ms). Counts the
// server or dataset did not give are null (prompt_tokens: usage.prompt_tokens;
// dataset_prompt_tokens: measured by the dataset, sharegpt only). A failed request has its error,
// its E2E (to the failure) and ttft_ms null when no text arrived.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common/status.h"
#include "loadgen/bench_runner.h"
#include "loadgen/dataset.h"

namespace kvshard::loadgen {

// One line, without its newline.
std::string ResultLine(size_t index, const BenchPrompt& prompt, const RequestOutcome& outcome);

// Writes every request's line to `path` (replacing the file). REQUIRES: run.outcomes has one
// outcome per prompt. InvalidArgument naming the path when it cannot be written.
Status WriteResultFile(const std::string& path, const std::vector<BenchPrompt>& prompts,
                       const BenchRun& run);

}  // namespace kvshard::loadgen
