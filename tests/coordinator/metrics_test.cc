// The Prometheus registry: parse the exposition text back and check every sample.
#include "coordinator/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvshard {
namespace {

// A parsed exposition: sample "name{labels}" -> value, and metric name -> TYPE.
struct Exposition {
    std::map<std::string, double> samples;
    std::map<std::string, std::string> types;
    std::map<std::string, std::string> help;
};

Exposition Parse(const std::string& text) {
    Exposition e;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        EXPECT_FALSE(line.empty()) << "blank line in exposition";
        if (line.rfind("# TYPE ", 0) == 0) {
            std::istringstream l(line.substr(7));
            std::string name, type;
            l >> name >> type;
            e.types[name] = type;
            continue;
        }
        if (line.rfind("# HELP ", 0) == 0) {
            const std::string rest = line.substr(7);
            e.help[rest.substr(0, rest.find(' '))] = rest.substr(rest.find(' ') + 1);
            continue;
        }
        const size_t space = line.rfind(' ');
        EXPECT_NE(space, std::string::npos) << line;
        if (space == std::string::npos) continue;
        const std::string value = line.substr(space + 1);
        e.samples[line.substr(0, space)] = value == "+Inf" ? INFINITY : std::stod(value);
    }
    return e;
}

TEST(Metrics, CounterGaugeHistogramExposition) {
    MetricsRegistry r(std::vector<std::pair<std::string, std::string>>{{"model_name", "m\"1"}});
    Counter& c = r.AddCounter("x:requests_total", "Requests.\nSecond line");
    Gauge& g = r.AddGauge("x:running", "Running.");
    Histogram& h = r.AddHistogram("x:latency_seconds", "Latency.", {0.1, 1.0});
    c.Add();
    c.Add(2);
    g.Set(1.5);
    for (double v : {0.05, 0.1, 0.5, 3.0}) h.Observe(v);
    r.LabeledCounter("x:done_total", "Done.", "reason", "stop").Add();
    r.LabeledCounter("x:done_total", "Done.", "reason", "length").Add(2);
    r.LabeledCounter("x:done_total", "Done.", "reason", "stop").Add();

    const Exposition e = Parse(r.Render());
    const std::string l = "{model_name=\"m\\\"1\"";
    EXPECT_EQ(e.types.at("x:requests_total"), "counter");
    EXPECT_EQ(e.types.at("x:running"), "gauge");
    EXPECT_EQ(e.types.at("x:latency_seconds"), "histogram");
    EXPECT_EQ(e.help.at("x:requests_total"), "Requests.\\nSecond line");
    EXPECT_EQ(e.samples.at("x:requests_total" + l + "}"), 3);
    EXPECT_EQ(e.samples.at("x:running" + l + "}"), 1.5);
    // Buckets are cumulative; le="0.1" includes 0.1 itself.
    EXPECT_EQ(e.samples.at("x:latency_seconds_bucket" + l + ",le=\"0.1\"}"), 2);
    EXPECT_EQ(e.samples.at("x:latency_seconds_bucket" + l + ",le=\"1\"}"), 3);
    EXPECT_EQ(e.samples.at("x:latency_seconds_bucket" + l + ",le=\"+Inf\"}"), 4);
    EXPECT_EQ(e.samples.at("x:latency_seconds_count" + l + "}"), 4);
    EXPECT_DOUBLE_EQ(e.samples.at("x:latency_seconds_sum" + l + "}"), 3.65);
    EXPECT_EQ(e.samples.at("x:done_total" + l + ",reason=\"stop\"}"), 2);
    EXPECT_EQ(e.samples.at("x:done_total" + l + ",reason=\"length\"}"), 2);
}

TEST(Metrics, Numbers) {
    EXPECT_EQ(PrometheusNumber(0.1), "0.1");
    EXPECT_EQ(PrometheusNumber(3), "3");
    EXPECT_EQ(PrometheusNumber(INFINITY), "+Inf");
    EXPECT_EQ(PrometheusNumber(-INFINITY), "-Inf");
    EXPECT_EQ(PrometheusNumber(NAN), "NaN");
}

TEST(Metrics, ConcurrentObservationsAreAllCounted) {
    MetricsRegistry r;
    Counter& c = r.AddCounter("c_total", "c");
    Histogram& h = r.AddHistogram("h", "h", {1.0});
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
        threads.emplace_back([&] {
            for (int i = 0; i < 10000; ++i) {
                c.Add();
                h.Observe(0.5);
            }
        });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(c.value(), 40000);
    const Histogram::Snapshot s = h.Take();
    EXPECT_EQ(s.count, 40000u);
    EXPECT_EQ(s.cumulative_counts[0], 40000u);
    EXPECT_DOUBLE_EQ(s.sum, 20000.0);
}

TEST(Metrics, ServerMetricsNames) {
    ServerMetrics m("smol");
    m.ObserveTimeToFirstToken(0.02);
    m.ObserveInterTokenLatency(0.004);
    m.ObserveRequestFinished(0.5, {10, 5, 4}, "length");
    EngineStats stats;
    stats.num_running = 3;
    stats.num_waiting = 2;
    stats.kv_cache_usage = 0.75;
    stats.prefix_cache_queries_tokens = 100;
    stats.prefix_cache_hits_tokens = 60;
    const Exposition e = Parse(m.Render(stats));
    const std::string l = "{model_name=\"smol\"}";
    for (const char* h :
         {"kvshard:time_to_first_token_seconds", "kvshard:inter_token_latency_seconds",
          "kvshard:e2e_request_latency_seconds"}) {
        EXPECT_EQ(e.types.at(h), "histogram") << h;
        EXPECT_EQ(e.samples.at(std::string(h) + "_count" + l), 1) << h;
    }
    EXPECT_EQ(e.types.at("kvshard:num_requests_running"), "gauge");
    EXPECT_EQ(e.samples.at("kvshard:num_requests_running" + l), 3);
    EXPECT_EQ(e.samples.at("kvshard:num_requests_waiting" + l), 2);
    EXPECT_EQ(e.samples.at("kvshard:kv_cache_usage_perc" + l), 0.75);
    EXPECT_EQ(e.types.at("kvshard:prefix_cache_queries_total"), "counter");
    EXPECT_EQ(e.samples.at("kvshard:prefix_cache_queries_total" + l), 100);
    EXPECT_EQ(e.samples.at("kvshard:prefix_cache_hits_total" + l), 60);
    EXPECT_EQ(e.samples.at("kvshard:prompt_tokens_total" + l), 10);
    EXPECT_EQ(e.samples.at("kvshard:generation_tokens_total" + l), 5);
    EXPECT_EQ(e.samples.at(
                  "kvshard:request_success_total{model_name=\"smol\",finished_reason=\"length\"}"),
              1);
}

}  // namespace
}  // namespace kvshard
