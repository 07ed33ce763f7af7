// BenchRunner: sends a dataset's prompts to an OpenAI-compatible server (or to an Anthropic
// Messages API, /v1/messages), streaming every answer,
// on a schedule: arrivals as a Poisson process of `request_rate` requests per second (infinity:
// all at once), optionally capped at `max_concurrency` requests in flight (later arrivals wait
// their turn). One io_context thread drives every connection, so chunk times are taken as they
// arrive without threads competing for the measurements.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "loadgen/dataset.h"
#include "loadgen/http_client.h"

namespace kvshard::loadgen {

enum class ApiKind { kCompletions, kChat, kMessages };

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
    // Prompt caching: mark each prompt's shared prefix (the system message) with
    // cache_control {"type": "ephemeral"} (chat: on the system message, kvshard's extension of
    // the OpenAI route; messages: on the system block). Not for completions.
    bool cache_prefix = false;
};

struct BenchRun {
    std::string model;
    std::vector<RequestOutcome> outcomes;  // in dataset order
    double duration_s = 0;                 // first send to last answer
    // The run's start on steady_clock (CLOCK_MONOTONIC on Linux: the clock a server's step log
    // on the same machine writes), in seconds since its epoch; outcomes' start_s count from it.
    double start_clock_s = 0;
};

// The JSON body for one prompt: streamed, ignore_eos (not on messages: Anthropic has none),
// max_tokens = output_len, usage requested; the prefix marked for caching with `cache_prefix`.
std::string RequestBody(ApiKind api, const std::string& model, const BenchPrompt& prompt,
                        double temperature, bool cache_prefix = false);
// "completions", "chat" or "messages" -> its path.
std::string_view ApiPath(ApiKind api);

// The id of the server's first model (GET /v1/models), for runs without --model.
Result<std::string> ServedModel(const BaseUrl& url, const std::string& api_key);

// Runs the whole schedule and returns when every request has ended. Fails only before sending
// (no model could be found); failed requests are reported in their outcomes.
Result<BenchRun> RunBench(const BenchOptions& options, const std::vector<BenchPrompt>& prompts);

}  // namespace kvshard::loadgen
