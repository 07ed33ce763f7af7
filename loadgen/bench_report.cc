#include "loadgen/bench_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <numeric>

namespace kvshard::loadgen {

using nlohmann::json;

Result<Slo> ParseSlo(std::string_view text) {
    Slo slo;
    size_t pos = 0;
    while (pos < text.size()) {
        size_t end = text.find(',', pos);
        if (end == std::string_view::npos) end = text.size();
        const std::string item(text.substr(pos, end - pos));
        pos = end + 1;
        const size_t eq = item.find('=');
        if (eq == std::string::npos) {
            return InvalidArgument("--slo: '" + item + "' is not name=milliseconds");
        }
        const std::string name = item.substr(0, eq);
        const std::string value = item.substr(eq + 1);
        char* stop = nullptr;
        const double ms = std::strtod(value.c_str(), &stop);
        if (value.empty() || stop != value.c_str() + value.size() || !(ms > 0) ||
            !std::isfinite(ms)) {
            return InvalidArgument("--slo: " + name +
                                   " needs a positive number of milliseconds, got '" + value + "'");
        }
        if (name == "ttft_ms") {
            slo.ttft_ms = ms;
        } else if (name == "tpot_ms") {
            slo.tpot_ms = ms;
        } else if (name == "e2el_ms") {
            slo.e2el_ms = ms;
        } else {
            return InvalidArgument("--slo: unknown target '" + name +
                                   "' (ttft_ms, tpot_ms, e2el_ms)");
        }
    }
    return slo;
}

Distribution Summarize(std::vector<double> values) {
    Distribution d;
    d.count = static_cast<int64_t>(values.size());
    if (values.empty()) return d;
    std::sort(values.begin(), values.end());
    auto percentile = [&values](double p) {
        const double rank = p / 100.0 * static_cast<double>(values.size() - 1);
        const auto lo = static_cast<size_t>(std::floor(rank));
        const size_t hi = std::min(lo + 1, values.size() - 1);
        return values[lo] + (values[hi] - values[lo]) * (rank - static_cast<double>(lo));
    };
    d.mean =
        std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
    d.median = percentile(50);
    d.p90 = percentile(90);
    d.p99 = percentile(99);
    return d;
}

double TimePerOutputToken(const RequestOutcome& o) {
    return (o.e2e_s - o.ttft_s) / static_cast<double>(o.output_tokens - 1);
}

BenchReport MakeReport(const BenchRun& run, const Slo& slo) {
    BenchReport r;
    r.model = run.model;
    r.num_requests = static_cast<int64_t>(run.outcomes.size());
    r.duration_s = run.duration_s;
    std::vector<double> ttft, tpot, itl, e2el;
    int64_t good = 0;
    for (const RequestOutcome& o : run.outcomes) {
        if (!o.ok) {
            ++r.failed;
            if (r.first_errors.size() < 5) r.first_errors.push_back(o.error);
            continue;
        }
        ++r.completed;
        r.total_output_tokens += o.output_tokens;
        if (o.prompt_tokens > 0) r.total_input_tokens += o.prompt_tokens;
        if (o.cached_tokens >= 0) {
            r.total_cached_tokens = std::max<int64_t>(r.total_cached_tokens, 0) + o.cached_tokens;
            if (o.cached_tokens > 0) ++r.requests_with_cache_read;
        }
        if (o.cache_creation_tokens >= 0) {
            r.total_cache_creation_tokens =
                std::max<int64_t>(r.total_cache_creation_tokens, 0) + o.cache_creation_tokens;
        }
        ttft.push_back(o.ttft_s * 1e3);
        e2el.push_back(o.e2e_s * 1e3);
        for (double gap : o.itl_s) itl.push_back(gap * 1e3);
        const bool has_tpot = o.output_tokens > 1;
        if (has_tpot) tpot.push_back(TimePerOutputToken(o) * 1e3);
        const bool within =
            (!slo.ttft_ms || o.ttft_s * 1e3 <= *slo.ttft_ms) &&
            (!slo.tpot_ms || !has_tpot || TimePerOutputToken(o) * 1e3 <= *slo.tpot_ms) &&
            (!slo.e2el_ms || o.e2e_s * 1e3 <= *slo.e2el_ms);
        if (within) ++good;
    }
    if (r.duration_s > 0) {
        r.request_throughput = static_cast<double>(r.completed) / r.duration_s;
        r.output_throughput = static_cast<double>(r.total_output_tokens) / r.duration_s;
        r.total_token_throughput =
            static_cast<double>(r.total_input_tokens + r.total_output_tokens) / r.duration_s;
        if (!slo.empty()) r.goodput = static_cast<double>(good) / r.duration_s;
    }
    r.ttft_ms = Summarize(std::move(ttft));
    r.tpot_ms = Summarize(std::move(tpot));
    r.itl_ms = Summarize(std::move(itl));
    r.e2el_ms = Summarize(std::move(e2el));
    return r;
}

std::string ReportText(const BenchReport& r) {
    std::string out;
    char line[256];
    auto add = [&](const char* label, const std::string& value) {
        std::snprintf(line, sizeof(line), "%-34s %s\n", label, value.c_str());
        out += line;
    };
    auto num = [](double v, int decimals) {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
        return std::string(buf);
    };
    out += "============ kvshard bench ============\n";
    add("Model:", r.model);
    if (!r.dataset.empty()) add("Dataset:", r.dataset);
    add("Request rate (req/s):", std::isfinite(r.request_rate) ? num(r.request_rate, 2) : "inf");
    add("Max concurrency:", r.max_concurrency > 0 ? std::to_string(r.max_concurrency) : "none");
    add("Successful requests:", std::to_string(r.completed));
    add("Failed requests:", std::to_string(r.failed));
    add("Benchmark duration (s):", num(r.duration_s, 2));
    add("Total input tokens:", std::to_string(r.total_input_tokens));
    add("Total generated tokens:", std::to_string(r.total_output_tokens));
    add("Request throughput (req/s):", num(r.request_throughput, 2));
    add("Output token throughput (tok/s):", num(r.output_throughput, 2));
    add("Total token throughput (tok/s):", num(r.total_token_throughput, 2));
    if (r.goodput) add("Goodput (req/s):", num(*r.goodput, 2));
    if (r.total_cached_tokens >= 0) {
        add("Prompt tokens read from cache:", std::to_string(r.total_cached_tokens));
        add("Requests that read from cache:", std::to_string(r.requests_with_cache_read));
    }
    if (r.total_cache_creation_tokens >= 0)
        add("Prompt tokens written to cache:", std::to_string(r.total_cache_creation_tokens));
    auto dist = [&](const char* title, const char* name, const Distribution& d) {
        out += std::string("------------ ") + title + " ------------\n";
        add((std::string("Mean ") + name + " (ms):").c_str(), num(d.mean, 2));
        add((std::string("Median ") + name + " (ms):").c_str(), num(d.median, 2));
        add((std::string("P90 ") + name + " (ms):").c_str(), num(d.p90, 2));
        add((std::string("P99 ") + name + " (ms):").c_str(), num(d.p99, 2));
    };
    dist("Time to First Token", "TTFT", r.ttft_ms);
    dist("Time per Output Token (excl. 1st token)", "TPOT", r.tpot_ms);
    dist("Inter-token Latency", "ITL", r.itl_ms);
    dist("End-to-end Latency", "E2EL", r.e2el_ms);
    for (const std::string& e : r.first_errors) out += "error: " + e + "\n";
    out += "=======================================\n";
    return out;
}

std::string ReportJson(const BenchReport& r) {
    auto dist = [](const Distribution& d) {
        return json{{"mean", d.mean},
                    {"median", d.median},
                    {"p90", d.p90},
                    {"p99", d.p99},
                    {"count", d.count}};
    };
    json j = {{"model", r.model},
              {"dataset", r.dataset},
              {"request_rate", std::isfinite(r.request_rate) ? json(r.request_rate) : json("inf")},
              {"max_concurrency", r.max_concurrency},
              {"num_requests", r.num_requests},
              {"completed", r.completed},
              {"failed", r.failed},
              {"errors", r.first_errors},
              {"duration_s", r.duration_s},
              {"total_input_tokens", r.total_input_tokens},
              {"total_output_tokens", r.total_output_tokens},
              {"request_throughput", r.request_throughput},
              {"output_throughput", r.output_throughput},
              {"total_token_throughput", r.total_token_throughput},
              {"goodput", r.goodput ? json(*r.goodput) : json(nullptr)},
              {"cached_tokens",
               r.total_cached_tokens >= 0 ? json(r.total_cached_tokens) : json(nullptr)},
              {"cache_creation_tokens", r.total_cache_creation_tokens >= 0
                                            ? json(r.total_cache_creation_tokens)
                                            : json(nullptr)},
              {"requests_with_cache_read", r.requests_with_cache_read},
              {"ttft_ms", dist(r.ttft_ms)},
              {"tpot_ms", dist(r.tpot_ms)},
              {"itl_ms", dist(r.itl_ms)},
              {"e2el_ms", dist(r.e2el_ms)}};
    return j.dump(2, ' ', false, json::error_handler_t::replace);
}

}  // namespace kvshard::loadgen
