// BenchRunner: sends a dataset's prompts to an OpenAI-compatible server, streaming every answer,
// on a schedule: arrivals as a Poisson process of `request_rate` requests per second (infinity:
// all at once), optionally capped at `max_concurrency` requests in flight (later arrivals wait
// their turn). One io_context thread drives every connection, so chunk times are taken as they
// arrive without threads competing for the measurements.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "loadgen/dataset.h"
#include "loadgen/http_client.h"

namespace kvshard::loadgen {

enum class ApiKind { kCompletions, kChat };

struct BenchOptions {
    BaseUrl url;
    std::string model;  // "" is asked of GET /v1/models (its first model)
    ApiKind api = ApiKind::kCompletions;
    double request_rate = std::numeric_limits<double>::infinity();
    int64_t max_concurrency = 0;  // 0: no cap
    std::string api_key;
    double read_timeout_s = 600;
    uint64_t seed = 0;  // of the arrival times
    double temperature = 0.0;
};

struct BenchRun {
    std::string model;
    std::vector<RequestOutcome> outcomes;  // in dataset order
    double duration_s = 0;                 // first send to last answer
};

// The JSON body for one prompt: streamed, ignore_eos, max_tokens = output_len, usage requested.
std::string RequestBody(ApiKind api, const std::string& model, const BenchPrompt& prompt,
                        double temperature);

// Runs the whole schedule and returns when every request has ended. Fails only before sending
// (no model could be found); failed requests are reported in their outcomes.
Result<BenchRun> RunBench(const BenchOptions& options, const std::vector<BenchPrompt>& prompts);

}  // namespace kvshard::loadgen
