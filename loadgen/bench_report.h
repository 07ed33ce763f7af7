// The numbers `kvshard bench` reports: throughput, and the mean, median, p90 and p99 of
//   TTFT  time to first token: request sent -> first chunk with text
//   TPOT  time per output token after the first: (E2E - TTFT) / (output tokens - 1), per request
//   ITL   inter-token latency: every gap between consecutive chunks with text
//   E2E   end-to-end latency: request sent -> stream ended
// in milliseconds, and goodput: requests per second that met every given SLO.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "loadgen/bench_runner.h"

namespace kvshard::loadgen {

// --slo ttft_ms=500,tpot_ms=50[,e2el_ms=...]
struct Slo {
    std::optional<double> ttft_ms;
    std::optional<double> tpot_ms;
    std::optional<double> e2el_ms;
    bool empty() const { return !ttft_ms && !tpot_ms && !e2el_ms; }
};
Result<Slo> ParseSlo(std::string_view text);

struct Distribution {
    double mean = 0, median = 0, p90 = 0, p99 = 0;
    int64_t count = 0;
};
// Percentiles interpolate linearly between the closest ranks (numpy's default).
Distribution Summarize(std::vector<double> values);

struct BenchReport {
    std::string model;
    std::string dataset;
    double request_rate = 0;  // asked for (inf: all at once)
    int64_t max_concurrency = 0;
    int64_t num_requests = 0;
    int64_t completed = 0;
    int64_t failed = 0;
    std::vector<std::string> first_errors;  // up to 5
    double duration_s = 0;
    int64_t total_input_tokens = 0;  // as the server counted them (0 when not reported)
    int64_t total_output_tokens = 0;
    double request_throughput = 0;  // completed requests / s
    double output_throughput = 0;   // output tokens / s
    double total_token_throughput = 0;
    std::optional<double> goodput;  // requests / s within the SLO, when one was given
    // Prompt caching, over completed requests whose usage reported it (-1 totals: none did).
    int64_t total_cached_tokens = -1;          // read from the prefix cache
    int64_t total_cache_creation_tokens = -1;  // written up to cache breakpoints
    int64_t requests_with_cache_read = 0;      // requests that read any prompt token from cache
    Distribution ttft_ms, tpot_ms, itl_ms, e2el_ms;
};

// TPOT of one request in seconds: (E2E - TTFT) / (output tokens - 1).
// REQUIRES: outcome.output_tokens > 1.
double TimePerOutputToken(const RequestOutcome& outcome);

BenchReport MakeReport(const BenchRun& run, const Slo& slo);
std::string ReportText(const BenchReport& report);
std::string ReportJson(const BenchReport& report);

}  // namespace kvshard::loadgen
