#include "loadgen/bench_runner.h"

#include <boost/asio/steady_timer.hpp>
#include <cmath>
#include <deque>
#include <nlohmann/json.hpp>
#include <random>

namespace kvshard::loadgen {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string_view ApiPath(ApiKind api) {
    switch (api) {
        case ApiKind::kCompletions:
            return "/v1/completions";
        case ApiKind::kChat:
            return "/v1/chat/completions";
        case ApiKind::kMessages:
            return "/v1/messages";
    }
    return "/v1/completions";
}

std::string RequestBody(ApiKind api, const std::string& model, const BenchPrompt& prompt,
                        double temperature, bool cache_prefix) {
    const json ephemeral = {{"type", "ephemeral"}};
    if (api == ApiKind::kMessages) {
        json body = {{"model", model},
                     {"max_tokens", prompt.output_len},
                     {"temperature", temperature},
                     {"stream", true},
                     {"messages", json::array({{{"role", "user"}, {"content", prompt.text}}})}};
        if (!prompt.prefix.empty()) {
            json block = {{"type", "text"}, {"text", prompt.prefix}};
            if (cache_prefix) block["cache_control"] = ephemeral;
            body["system"] = json::array({block});
        }
        return body.dump();
    }
    json body = {{"model", model},     {"max_tokens", prompt.output_len},
                 {"ignore_eos", true}, {"temperature", temperature},
                 {"stream", true},     {"stream_options", {{"include_usage", true}}}};
    switch (api) {
        case ApiKind::kMessages:
            break;
        case ApiKind::kCompletions:
            body["prompt"] =
                prompt.prefix.empty() ? prompt.text : prompt.prefix + " " + prompt.text;
            break;
        case ApiKind::kChat: {
            json messages = json::array();
            if (!prompt.prefix.empty()) {
                json system = {{"role", "system"}, {"content", prompt.prefix}};
                if (cache_prefix) system["cache_control"] = ephemeral;
                messages.push_back(std::move(system));
            }
            messages.push_back({{"role", "user"}, {"content", prompt.text}});
            body["messages"] = std::move(messages);
            break;
        }
    }
    return body.dump();
}

Result<std::string> ServedModel(const BaseUrl& url, const std::string& api_key) {
    KV_ASSIGN_OR_RETURN(std::string body, HttpGet(url, "/v1/models", api_key, 30));
    const json j = json::parse(body, nullptr, false);
    if (j.is_object() && j.contains("data") && j["data"].is_array() && !j["data"].empty() &&
        j["data"][0].contains("id") && j["data"][0]["id"].is_string()) {
        return j["data"][0]["id"].get<std::string>();
    }
    return InvalidArgument("GET /v1/models gave no model id; pass --model");
}

namespace {

// Arrival offsets from the start, in seconds: 0 for every request at an infinite rate, else the
// running sum of exponential gaps (a Poisson process).
std::vector<double> ArrivalTimes(size_t n, double rate, uint64_t seed) {
    std::vector<double> t(n, 0.0);
    if (!std::isfinite(rate)) return t;
    std::mt19937_64 rng(seed);
    std::exponential_distribution<double> gap(rate);
    double now = 0;
    for (size_t i = 0; i < n; ++i) {
        now += gap(rng);
        t[i] = now;
    }
    return t;
}

// The schedule's state; everything runs on the io_context's one thread.
class Scheduler {
  public:
    Scheduler(boost::asio::io_context& io, const BenchOptions& options,
              const std::vector<BenchPrompt>& prompts, const std::string& model)
        : io_(io),
          options_(options),
          prompts_(prompts),
          timer_(io),
          arrivals_(ArrivalTimes(prompts.size(), options.request_rate, options.seed)),
          outcomes_(prompts.size()) {
        for (size_t i = 0; i < prompts.size(); ++i) {
            HttpTarget t{options.url, std::string(ApiPath(options.api)),
                         RequestBody(options.api, model, prompts[i], options.temperature,
                                     options.cache_prefix),
                         options.api_key, options.read_timeout_s};
            if (options.api == ApiKind::kMessages) t.headers = {{"anthropic-version", "2023-06-01"}};
            targets_.push_back(std::move(t));
        }
    }

    void Start() {
        start_ = Clock::now();
        ScheduleNext();
    }
    std::vector<RequestOutcome> TakeOutcomes() { return std::move(outcomes_); }
    double duration_s() const { return std::chrono::duration<double>(end_ - start_).count(); }
    double start_clock_s() const {
        return std::chrono::duration<double>(start_.time_since_epoch()).count();
    }

  private:
    void ScheduleNext() {
        // Everything due now joins the ready queue; the timer waits for the next arrival.
        while (next_ < prompts_.size()) {
            const auto due = start_ + std::chrono::duration_cast<Clock::duration>(
                                          std::chrono::duration<double>(arrivals_[next_]));
            if (due > Clock::now()) {
                timer_.expires_at(due);
                timer_.async_wait([this](boost::system::error_code ec) {
                    if (!ec) ScheduleNext();
                });
                break;
            }
            ready_.push_back(next_++);
        }
        StartReady();
    }

    void StartReady() {
        while (!ready_.empty() &&
               (options_.max_concurrency <= 0 || in_flight_ < options_.max_concurrency)) {
            const size_t i = ready_.front();
            ready_.pop_front();
            ++in_flight_;
            StartStreamingRequest(io_, targets_[i], start_, [this, i](RequestOutcome outcome) {
                outcomes_[i] = std::move(outcome);
                --in_flight_;
                if (++completed_ == prompts_.size()) end_ = Clock::now();
                StartReady();
            });
        }
    }

    boost::asio::io_context& io_;
    const BenchOptions& options_;
    const std::vector<BenchPrompt>& prompts_;
    boost::asio::steady_timer timer_;
    std::vector<double> arrivals_;
    std::vector<HttpTarget> targets_;
    std::vector<RequestOutcome> outcomes_;
    std::deque<size_t> ready_;
    size_t next_ = 0;
    int64_t in_flight_ = 0;
    size_t completed_ = 0;
    Clock::time_point start_;
    Clock::time_point end_;
};

}  // namespace

Result<BenchRun> RunBench(const BenchOptions& options, const std::vector<BenchPrompt>& prompts) {
    BenchRun run;
    run.model = options.model;
    if (run.model.empty()) {
        KV_ASSIGN_OR_RETURN(run.model, ServedModel(options.url, options.api_key));
    }
    // A certificate the client does not trust is one line here, not one per request.
    KV_RETURN_IF_ERROR(CheckConnection(options.url, 30));
    if (prompts.empty()) return run;
    boost::asio::io_context io;
    Scheduler scheduler(io, options, prompts, run.model);
    scheduler.Start();
    io.run();
    run.outcomes = scheduler.TakeOutcomes();
    run.duration_s = scheduler.duration_s();
    run.start_clock_s = scheduler.start_clock_s();
    return run;
}

}  // namespace kvshard::loadgen
