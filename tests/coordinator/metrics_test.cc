// The Prometheus registry: parse the exposition text back and check every sample.
#include "coordinator/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
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
    EXPECT_EQ(PrometheusNumber(0.0001), "0.0001");  // not "1e-04"
    EXPECT_EQ(PrometheusNumber(-0.0005), "-0.0005");
    EXPECT_EQ(PrometheusNumber(0.00025), "0.00025");
    EXPECT_EQ(PrometheusNumber(0.001), "0.001");
    EXPECT_EQ(PrometheusNumber(0.00001), "1e-05");
    EXPECT_EQ(PrometheusNumber(0), "0");
    EXPECT_EQ(PrometheusNumber(1048576), "1048576");
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
    m.OnFirstToken("default", 0.02);
    m.OnInterToken("default", 0.004);
    FinishedRequestStats finished;
    finished.e2e_seconds = 0.5;
    finished.finished_reason = "length";
    finished.prompt_tokens = 10;
    finished.generation_tokens = 5;
    m.OnRequestFinished(finished);
    EngineStats stats;
    stats.num_running = 3;
    stats.num_waiting = 2;
    stats.kv_cache_usage = 0.75;
    stats.prefix_cache_queries_tokens = 100;
    stats.prefix_cache_hits_tokens = 60;
    stats.num_preemptions = 7;
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
    EXPECT_EQ(e.types.at("kvshard:num_preemptions_total"), "counter");
    EXPECT_EQ(e.samples.at("kvshard:num_preemptions_total" + l), 7);
    EXPECT_EQ(e.samples.at("kvshard:prompt_tokens_total" + l), 10);
    EXPECT_EQ(e.samples.at("kvshard:generation_tokens_total" + l), 5);
    EXPECT_EQ(e.samples.at(
                  "kvshard:request_success_total{model_name=\"smol\",finished_reason=\"length\"}"),
              1);
}

TEST(Metrics, PromptCachePins) {
    ServerMetrics m("smol");
    FinishedRequestStats finished;
    finished.e2e_seconds = 0.5;
    finished.finished_reason = "length";
    finished.prompt_tokens = 2100;
    finished.generation_tokens = 5;
    finished.cache_creation_tokens = 2048;
    m.OnRequestFinished(finished);
    finished.e2e_seconds = 0.1;
    finished.cache_creation_tokens = 0;  // the second one read them from the cache
    m.OnRequestFinished(finished);
    EngineStats stats;
    stats.pinned_blocks = 128;
    stats.pin_hits_total = 9;
    stats.pins_expired_total = 2;
    stats.pins_refused_total = 1;
    const Exposition e = Parse(m.Render(stats));
    const std::string l = "{model_name=\"smol\"}";
    EXPECT_EQ(e.types.at("kvshard:prompt_cache_pinned_blocks"), "gauge");
    EXPECT_EQ(e.samples.at("kvshard:prompt_cache_pinned_blocks" + l), 128);
    for (auto [name, value] : {std::pair{"kvshard:prompt_cache_pin_hits_total", 9},
                               std::pair{"kvshard:prompt_cache_pins_expired_total", 2},
                               std::pair{"kvshard:prompt_cache_pins_refused_total", 1},
                               std::pair{"kvshard:prompt_cache_creation_tokens_total", 2048}}) {
        EXPECT_EQ(e.types.at(name), "counter") << name;
        EXPECT_EQ(e.samples.at(std::string(name) + l), value) << name;
    }
    stats.pinned_blocks = 0;  // a gauge follows the engine down
    EXPECT_EQ(Parse(m.Render(stats)).samples.at("kvshard:prompt_cache_pinned_blocks" + l), 0);
}

// Occurrences of `needle` in `haystack`.
int CountOf(const std::string& haystack, const std::string& needle) {
    int n = 0;
    for (size_t at = haystack.find(needle); at != std::string::npos;
         at = haystack.find(needle, at + needle.size())) {
        ++n;
    }
    return n;
}

TEST(Metrics, LabeledHistogramFamily) {
    MetricsRegistry r(std::vector<std::pair<std::string, std::string>>{{"model_name", "m"}});
    r.LabeledHistogram("x:lat", "Lat.", "pool", "a", {0.1, 1.0}).Observe(0.05);
    r.LabeledHistogram("x:lat", "Lat.", "pool", "b", {0.1, 1.0}).Observe(2.0);
    Histogram& a = r.LabeledHistogram("x:lat", "Lat.", "pool", "a", {0.1, 1.0});
    a.Observe(0.5);

    const std::string text = r.Render();
    EXPECT_EQ(CountOf(text, "# HELP x:lat "), 1) << text;
    EXPECT_EQ(CountOf(text, "# TYPE x:lat histogram\n"), 1) << text;
    const Exposition e = Parse(text);
    EXPECT_EQ(e.samples.at("x:lat_bucket{model_name=\"m\",pool=\"a\",le=\"0.1\"}"), 1);
    EXPECT_EQ(e.samples.at("x:lat_bucket{model_name=\"m\",pool=\"a\",le=\"1\"}"), 2);
    EXPECT_EQ(e.samples.at("x:lat_bucket{model_name=\"m\",pool=\"a\",le=\"+Inf\"}"), 2);
    EXPECT_EQ(e.samples.at("x:lat_count{model_name=\"m\",pool=\"a\"}"), 2);
    EXPECT_DOUBLE_EQ(e.samples.at("x:lat_sum{model_name=\"m\",pool=\"a\"}"), 0.55);
    EXPECT_EQ(e.samples.at("x:lat_bucket{model_name=\"m\",pool=\"b\",le=\"1\"}"), 0);
    EXPECT_EQ(e.samples.at("x:lat_bucket{model_name=\"m\",pool=\"b\",le=\"+Inf\"}"), 1);
    EXPECT_EQ(e.samples.at("x:lat_count{model_name=\"m\",pool=\"b\"}"), 1);
    EXPECT_DOUBLE_EQ(e.samples.at("x:lat_sum{model_name=\"m\",pool=\"b\"}"), 2.0);
}

// The EngineObserver side of ServerMetrics: per-pool latency histograms and KV handoff metrics.
TEST(Metrics, ServerMetricsObserver) {
    enum class Call { kFirstToken, kInterToken, kTransfer, kFailed };
    struct Observation {
        Call call;
        std::string pool;  // kFirstToken, kInterToken
        double seconds;
        int64_t bytes;  // kTransfer
    };
    const std::vector<Observation> observations = {
        {Call::kFirstToken, "prefill", 0.03, 0},
        {Call::kFirstToken, "prefill", 0.5, 0},
        {Call::kFirstToken, "mixed", 0.004, 0},
        {Call::kInterToken, "decode", 0.02, 0},
        {Call::kInterToken, "decode", 0.02, 0},
        {Call::kInterToken, "decode", 3.0, 0},
        {Call::kInterToken, "mixed", 0.001, 0},
        {Call::kTransfer, "", 0.0003, 4096},
        {Call::kTransfer, "", 0.2, 1 << 20},
        {Call::kTransfer, "", 30.0, 100},
        {Call::kFailed, "", 0, 0},
    };
    ServerMetrics m("smol");
    for (const Observation& o : observations) {
        switch (o.call) {
            case Call::kFirstToken:
                m.OnFirstToken(o.pool, o.seconds);
                break;
            case Call::kInterToken:
                m.OnInterToken(o.pool, o.seconds);
                break;
            case Call::kTransfer:
                m.OnKvTransfer(o.bytes, o.seconds);
                break;
            case Call::kFailed:
                m.OnKvTransferFailed(Status(StatusCode::kDeadlineExceeded, "late"));
                break;
        }
    }
    const std::string text = m.Render(EngineStats{});
    const Exposition e = Parse(text);

    const std::string ttft = "kvshard:pool_time_to_first_token_seconds";
    const std::string itl = "kvshard:pool_inter_token_latency_seconds";
    const std::string kv = "kvshard:kv_transfer_seconds";
    for (const std::string& family : {ttft, itl, kv}) {
        EXPECT_EQ(CountOf(text, "# HELP " + family + " "), 1) << family;
        EXPECT_EQ(CountOf(text, "# TYPE " + family + " histogram\n"), 1) << family;
        EXPECT_EQ(e.types.at(family), "histogram");
    }
    // One observation feeds the model-wide histogram and its pool's alike: the engine measures
    // each latency once.
    EXPECT_EQ(e.samples.at("kvshard:time_to_first_token_seconds_count{model_name=\"smol\"}"), 3);
    EXPECT_DOUBLE_EQ(e.samples.at("kvshard:time_to_first_token_seconds_sum{model_name=\"smol\"}"),
                     0.534);
    EXPECT_EQ(e.samples.at("kvshard:inter_token_latency_seconds_count{model_name=\"smol\"}"), 4);

    struct Expected {
        std::string sample;  // the sample name with its labels
        double value;
    };
    const std::vector<Expected> expected = {
        // ttft, pool prefill: 0.03 and 0.5
        {ttft + "_count{model_name=\"smol\",pool=\"prefill\"}", 2},
        {ttft + "_sum{model_name=\"smol\",pool=\"prefill\"}", 0.53},
        {ttft + "_bucket{model_name=\"smol\",pool=\"prefill\",le=\"0.02\"}", 0},
        {ttft + "_bucket{model_name=\"smol\",pool=\"prefill\",le=\"0.04\"}", 1},
        {ttft + "_bucket{model_name=\"smol\",pool=\"prefill\",le=\"0.5\"}", 2},
        {ttft + "_bucket{model_name=\"smol\",pool=\"prefill\",le=\"+Inf\"}", 2},
        // ttft, pool mixed: 0.004
        {ttft + "_count{model_name=\"smol\",pool=\"mixed\"}", 1},
        {ttft + "_sum{model_name=\"smol\",pool=\"mixed\"}", 0.004},
        {ttft + "_bucket{model_name=\"smol\",pool=\"mixed\",le=\"0.001\"}", 0},
        {ttft + "_bucket{model_name=\"smol\",pool=\"mixed\",le=\"0.005\"}", 1},
        // itl, pool decode: 0.02, 0.02, 3.0
        {itl + "_count{model_name=\"smol\",pool=\"decode\"}", 3},
        {itl + "_sum{model_name=\"smol\",pool=\"decode\"}", 3.04},
        {itl + "_bucket{model_name=\"smol\",pool=\"decode\",le=\"0.01\"}", 0},
        {itl + "_bucket{model_name=\"smol\",pool=\"decode\",le=\"0.025\"}", 2},
        {itl + "_bucket{model_name=\"smol\",pool=\"decode\",le=\"2.5\"}", 2},
        {itl + "_bucket{model_name=\"smol\",pool=\"decode\",le=\"5\"}", 3},
        {itl + "_bucket{model_name=\"smol\",pool=\"decode\",le=\"80\"}", 3},
        {itl + "_bucket{model_name=\"smol\",pool=\"decode\",le=\"+Inf\"}", 3},
        // itl, pool mixed: 0.001 (le is inclusive)
        {itl + "_count{model_name=\"smol\",pool=\"mixed\"}", 1},
        {itl + "_bucket{model_name=\"smol\",pool=\"mixed\",le=\"0.001\"}", 1},
        // KV handoffs: 0.0003 s, 0.2 s, 30 s (beyond the last bucket)
        {kv + "_bucket{model_name=\"smol\",le=\"0.0001\"}", 0},
        {kv + "_bucket{model_name=\"smol\",le=\"0.0005\"}", 1},
        {kv + "_bucket{model_name=\"smol\",le=\"0.25\"}", 2},
        {kv + "_bucket{model_name=\"smol\",le=\"10\"}", 2},
        {kv + "_bucket{model_name=\"smol\",le=\"+Inf\"}", 3},
        {kv + "_count{model_name=\"smol\"}", 3},
        {kv + "_sum{model_name=\"smol\"}", 30.2003},
        {"kvshard:kv_transfer_bytes_total{model_name=\"smol\"}", 4096 + (1 << 20) + 100},
        {"kvshard:kv_transfers_total{model_name=\"smol\"}", 3},
        {"kvshard:kv_transfer_failures_total{model_name=\"smol\"}", 1},
    };
    for (const Expected& x : expected) {
        ASSERT_TRUE(e.samples.count(x.sample)) << x.sample << "\n" << text;
        EXPECT_DOUBLE_EQ(e.samples.at(x.sample), x.value) << x.sample;
    }
    // A pool's first observation creates its series in both pool families (at zero where it has
    // no observations yet); only pools that were observed have series.
    EXPECT_EQ(e.samples.at(ttft + "_count{model_name=\"smol\",pool=\"decode\"}"), 0);
    EXPECT_EQ(e.samples.at(itl + "_count{model_name=\"smol\",pool=\"prefill\"}"), 0);
    EXPECT_EQ(CountOf(text, ttft + "_count{"), 3);
    EXPECT_EQ(CountOf(text, itl + "_count{"), 3);
    // ttft: 19 bounds, +Inf, sum, count; itl: 20 bounds, +Inf, sum, count.
    EXPECT_EQ(CountOf(text, "pool=\"decode\""), (19 + 3) + (20 + 3));
    for (const char* counter : {"kvshard:kv_transfer_bytes_total", "kvshard:kv_transfers_total",
                                "kvshard:kv_transfer_failures_total"}) {
        EXPECT_EQ(e.types.at(counter), "counter") << counter;
    }
}

TEST(Metrics, ServerMetricsObserverConcurrent) {
    ServerMetrics m("smol");
    constexpr int kThreads = 4;
    constexpr int kIterations = 5000;
    const std::vector<std::string> pools = {"p0", "p1", "p2"};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < kIterations; ++i) {
                // Every thread touches every pool, so pool series are created under contention.
                const std::string& pool = pools[(i + t) % pools.size()];
                m.OnFirstToken(pool, 0.5);
                m.OnInterToken(pool, 0.25);
                m.OnKvTransfer(1000, 0.125);
                if (i % 10 == 0)
                    m.OnKvTransferFailed(Status(StatusCode::kDeadlineExceeded, "late"));
            }
        });
    }
    for (auto& t : threads) t.join();

    const std::string text = m.Render(EngineStats{});
    const Exposition e = Parse(text);
    EXPECT_EQ(CountOf(text, "# TYPE kvshard:pool_time_to_first_token_seconds histogram"), 1);
    EXPECT_EQ(CountOf(text, "# TYPE kvshard:pool_inter_token_latency_seconds histogram"), 1);
    double ttft_count = 0, itl_count = 0;
    for (const std::string& pool : pools) {
        const std::string l = "{model_name=\"smol\",pool=\"" + pool + "\"}";
        const double ttft = e.samples.at("kvshard:pool_time_to_first_token_seconds_count" + l);
        const double itl = e.samples.at("kvshard:pool_inter_token_latency_seconds_count" + l);
        EXPECT_EQ(e.samples.at("kvshard:pool_time_to_first_token_seconds_sum" + l), ttft * 0.5);
        EXPECT_EQ(e.samples.at("kvshard:pool_inter_token_latency_seconds_sum" + l), itl * 0.25);
        ttft_count += ttft;
        itl_count += itl;
    }
    constexpr double kTotal = kThreads * kIterations;
    EXPECT_EQ(ttft_count, kTotal);
    EXPECT_EQ(itl_count, kTotal);
    const std::string l = "{model_name=\"smol\"}";
    EXPECT_EQ(e.samples.at("kvshard:kv_transfer_bytes_total" + l), kTotal * 1000);
    EXPECT_EQ(e.samples.at("kvshard:kv_transfers_total" + l), kTotal);
    EXPECT_EQ(e.samples.at("kvshard:kv_transfer_seconds_count" + l), kTotal);
    EXPECT_EQ(e.samples.at("kvshard:kv_transfer_seconds_sum" + l), kTotal * 0.125);
    EXPECT_EQ(e.samples.at("kvshard:kv_transfer_failures_total" + l), kThreads * kIterations / 10);
}

// kvshard:instance_up follows each instance's state at scrape time, one series per instance.
TEST(Metrics, InstanceUpPerInstanceAndPool) {
    ServerMetrics m("smol");
    EngineStats stats;
    stats.instances = {{"prefill", "prefill", true}, {"decode-0", "decode", false}};
    Exposition e = Parse(m.Render(stats));
    const std::string p = "kvshard:instance_up{model_name=\"smol\",instance=\"prefill\",pool=\"prefill\"}";
    const std::string d = "kvshard:instance_up{model_name=\"smol\",instance=\"decode-0\",pool=\"decode\"}";
    EXPECT_EQ(e.samples.at(p), 1.0);
    EXPECT_EQ(e.samples.at(d), 0.0);
    stats.instances[1].up = true;
    e = Parse(m.Render(stats));
    EXPECT_EQ(e.samples.at(d), 1.0);
}

}  // namespace
}  // namespace kvshard
