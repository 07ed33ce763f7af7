#include "coordinator/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "common/check.h"

namespace kvshard {

std::string PrometheusNumber(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    char buf[64];
    // Shortest round-trip form; below 1 down to 1e-4 always positional, as Go's
    // strconv.FormatFloat(v, 'g', -1, 64) (the Prometheus client) writes it, so a bucket bound
    // such as 0.0001 gets le="0.0001" rather than le="1e-04".
    const double magnitude = std::fabs(v);
    auto [end, ec] = magnitude >= 1e-4 && magnitude < 1.0
                         ? std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::fixed)
                         : std::to_chars(buf, buf + sizeof(buf), v);
    KV_CHECK(ec == std::errc());
    return std::string(buf, end);
}

namespace {

// Label values escape backslash, double quote and newline; HELP text escapes backslash and newline.
std::string Escape(const std::string& s, bool quote) {
    std::string out;
    for (char c : s) {
        if (c == '\\') {
            out += "\\\\";
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '"' && quote) {
            out += "\\\"";
        } else {
            out += c;
        }
    }
    return out;
}

std::string Labels(const std::string& constant, const std::string& extra) {
    std::string all = constant;
    if (!extra.empty()) all += (all.empty() ? "" : ",") + extra;
    return all.empty() ? "" : "{" + all + "}";
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)),
      counts_(new std::atomic<uint64_t>[upper_bounds_.size() + 1]) {
    for (size_t i = 0; i + 1 < upper_bounds_.size(); ++i) {
        KV_CHECK_LT(upper_bounds_[i], upper_bounds_[i + 1]);
    }
    for (size_t i = 0; i <= upper_bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double v) {
    size_t bucket = 0;
    while (bucket < upper_bounds_.size() && v > upper_bounds_[bucket]) ++bucket;
    counts_[bucket].fetch_add(1, std::memory_order_relaxed);
    sum_.fetch_add(v, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Take() const {
    Snapshot s;
    s.upper_bounds = upper_bounds_;
    uint64_t running = 0;
    for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
        running += counts_[i].load(std::memory_order_relaxed);
        s.cumulative_counts.push_back(running);
    }
    s.count = running;
    s.sum = sum_.load(std::memory_order_relaxed);
    return s;
}

MetricsRegistry::MetricsRegistry(std::vector<std::pair<std::string, std::string>> constant_labels) {
    for (const auto& [name, value] : constant_labels) {
        if (!constant_labels_.empty()) constant_labels_ += ",";
        constant_labels_ += name + "=\"" + Escape(value, true) + "\"";
    }
}

MetricsRegistry::Family& MetricsRegistry::NewFamily(const std::string& name,
                                                    const std::string& help, Kind kind) {
    for (const auto& f : families_) KV_CHECK(f->name != name) << "duplicate metric " << name;
    families_.push_back(std::make_unique<Family>(Family{name, help, kind, {}}));
    return *families_.back();
}

Counter& MetricsRegistry::AddCounter(const std::string& name, const std::string& help) {
    std::lock_guard<std::mutex> lock(mu_);
    Family& f = NewFamily(name, help, Kind::kCounter);
    f.series.push_back({"", std::make_unique<Counter>(), nullptr, nullptr});
    return *f.series.back().counter;
}

MetricsRegistry::Family* MetricsRegistry::FindFamily(const std::string& name) {
    for (const auto& f : families_) {
        if (f->name == name) return f.get();
    }
    return nullptr;
}

Counter& MetricsRegistry::LabeledCounter(const std::string& name, const std::string& help,
                                         const std::string& label, const std::string& value) {
    std::lock_guard<std::mutex> lock(mu_);
    Family* family = FindFamily(name);
    if (family == nullptr) family = &NewFamily(name, help, Kind::kCounter);
    KV_CHECK(family->kind == Kind::kCounter) << name;
    const std::string text = label + "=\"" + Escape(value, true) + "\"";
    for (Series& s : family->series) {
        if (s.label == text) return *s.counter;
    }
    family->series.push_back({text, std::make_unique<Counter>(), nullptr, nullptr});
    return *family->series.back().counter;
}

Gauge& MetricsRegistry::AddGauge(const std::string& name, const std::string& help) {
    std::lock_guard<std::mutex> lock(mu_);
    Family& f = NewFamily(name, help, Kind::kGauge);
    f.series.push_back({"", nullptr, std::make_unique<Gauge>(), nullptr});
    return *f.series.back().gauge;
}

Gauge& MetricsRegistry::LabeledGauge(
    const std::string& name, const std::string& help,
    const std::vector<std::pair<std::string, std::string>>& labels) {
    std::lock_guard<std::mutex> lock(mu_);
    Family* family = FindFamily(name);
    if (family == nullptr) family = &NewFamily(name, help, Kind::kGauge);
    KV_CHECK(family->kind == Kind::kGauge) << name;
    std::string text;
    for (const auto& [label, value] : labels) {
        if (!text.empty()) text += ",";
        text += label + "=\"" + Escape(value, true) + "\"";
    }
    for (Series& s : family->series) {
        if (s.label == text) return *s.gauge;
    }
    family->series.push_back({text, nullptr, std::make_unique<Gauge>(), nullptr});
    return *family->series.back().gauge;
}

Histogram& MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                         std::vector<double> upper_bounds) {
    std::lock_guard<std::mutex> lock(mu_);
    Family& f = NewFamily(name, help, Kind::kHistogram);
    f.series.push_back(
        {"", nullptr, nullptr, std::make_unique<Histogram>(std::move(upper_bounds))});
    return *f.series.back().histogram;
}

Histogram& MetricsRegistry::LabeledHistogram(const std::string& name, const std::string& help,
                                             const std::string& label, const std::string& value,
                                             const std::vector<double>& upper_bounds) {
    std::lock_guard<std::mutex> lock(mu_);
    Family* family = FindFamily(name);
    if (family == nullptr) family = &NewFamily(name, help, Kind::kHistogram);
    KV_CHECK(family->kind == Kind::kHistogram) << name;
    const std::string text = label + "=\"" + Escape(value, true) + "\"";
    for (Series& s : family->series) {
        KV_CHECK(s.histogram->upper_bounds() == upper_bounds) << "bucket mismatch in " << name;
        if (s.label == text) return *s.histogram;
    }
    family->series.push_back({text, nullptr, nullptr, std::make_unique<Histogram>(upper_bounds)});
    return *family->series.back().histogram;
}

std::string MetricsRegistry::Render(const std::string& alias_from,
                                    const std::string& alias_to) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::string out, aliases;
    for (const auto& f : families_) {
        const char* type = f->kind == Kind::kCounter ? "counter"
                           : f->kind == Kind::kGauge ? "gauge"
                                                     : "histogram";
        // Each sample line less the family name, read once for the name and its alias alike.
        std::vector<std::string> lines;
        for (const Series& s : f->series) {
            const std::string labels = Labels(constant_labels_, s.label);
            if (s.counter) lines.push_back(labels + " " + PrometheusNumber(s.counter->value()));
            if (s.gauge) lines.push_back(labels + " " + PrometheusNumber(s.gauge->value()));
            if (!s.histogram) continue;
            const Histogram::Snapshot snap = s.histogram->Take();
            for (size_t i = 0; i < snap.cumulative_counts.size(); ++i) {
                const double le = i < snap.upper_bounds.size() ? snap.upper_bounds[i] : INFINITY;
                std::string bucket_label = s.label;
                if (!bucket_label.empty()) bucket_label += ",";
                bucket_label += "le=\"" + PrometheusNumber(le) + "\"";
                lines.push_back("_bucket" + Labels(constant_labels_, bucket_label) + " " +
                                std::to_string(snap.cumulative_counts[i]));
            }
            lines.push_back("_sum" + labels + " " + PrometheusNumber(snap.sum));
            lines.push_back("_count" + labels + " " + std::to_string(snap.count));
        }
        auto write = [&](const std::string& name, std::string* to) {
            *to += "# HELP " + name + " " + Escape(f->help, false) + "\n";
            *to += "# TYPE " + name + " " + type + "\n";
            for (const std::string& line : lines) *to += name + line + "\n";
        };
        write(f->name, &out);
        if (!alias_from.empty() && f->name.rfind(alias_from, 0) == 0)
            write(alias_to + f->name.substr(alias_from.size()), &aliases);
    }
    return out + aliases;
}

std::string RenderProcessMetrics(const ProcessStats& stats) {
    MetricsRegistry r;
    r.AddGauge("process_virtual_memory_bytes", "Virtual memory size in bytes.")
        .Set(stats.virtual_memory_bytes);
    r.AddGauge("process_resident_memory_bytes", "Resident memory size in bytes.")
        .Set(stats.resident_memory_bytes);
    r.AddGauge("process_start_time_seconds",
               "Start time of the process since unix epoch in seconds.")
        .Set(stats.start_time_seconds);
    r.AddCounter("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.")
        .SetTotal(stats.cpu_seconds);
    r.AddGauge("process_open_fds", "Number of open file descriptors.").Set(stats.open_fds);
    r.AddGauge("process_max_fds", "Maximum number of open file descriptors.").Set(stats.max_fds);
    return r.Render();
}

namespace {

const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                          0.1,   0.25,  0.5,  0.75, 1.0,  2.5,  5.0,
                                          7.5,   10.0,  20.0, 40.0, 80.0};
const std::vector<double> kItlBuckets = {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                                         0.15,  0.2,   0.3,  0.4,   0.5,  0.75,  1.0,
                                         2.5,   5.0,   10.0, 20.0,  40.0, 80.0};
// 100 us .. 10 s in 1-2.5-5 steps.
const std::vector<double> kKvTransferBuckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                                1.0,    2.5,     5.0,    10.0};

// vLLM's buckets for its request phase histograms, in seconds.
const std::vector<double> kRequestPhaseBuckets = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                                  5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
const std::vector<double> kIterationTokenBuckets = {1,   8,    16,   32,   64,   128,  256,
                                                    512, 1024, 2048, 4096, 8192, 16384};

// 1, 2, 5, 10, 20, 50, ... while not above `max` (vLLM's build_1_2_5_buckets).
std::vector<double> OneTwoFiveBuckets(int64_t max) {
    std::vector<double> out;
    for (double decade = 1;; decade *= 10) {
        for (double m : {1.0, 2.0, 5.0}) {
            if (m * decade > static_cast<double>(std::max<int64_t>(max, 1))) return out;
            out.push_back(m * decade);
        }
    }
}

constexpr const char* kPoolTtftName = "kvshard:pool_time_to_first_token_seconds";
constexpr const char* kPoolTtftHelp =
    "Per pool: time from a request's arrival at the engine to its first generated token, in "
    "seconds.";
constexpr const char* kPoolItlName = "kvshard:pool_inter_token_latency_seconds";
constexpr const char* kPoolItlHelp =
    "Per pool: time between two consecutive generated tokens of a request, in seconds.";

}  // namespace

ServerMetrics::ServerMetrics(const std::string& model_name, ServerMetricsOptions options)
    : options_(options),
      registry_({{"model_name", model_name}}),
      ttft_(registry_.AddHistogram(
          "kvshard:time_to_first_token_seconds",
          "Time from a request's arrival to its first generated token, in seconds.", kTtftBuckets)),
      itl_(registry_.AddHistogram(
          "kvshard:inter_token_latency_seconds",
          "Time between two consecutive generated tokens of a request, in seconds.", kItlBuckets)),
      e2e_(
          registry_.AddHistogram("kvshard:e2e_request_latency_seconds",
                                 "Time from a request's arrival to its end, in seconds.",
                                 {0.1,  0.3,  0.5,  0.8,  1.0,  1.5,  2.0,   2.5,   5.0,   10.0,
                                  15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0})),
      running_(
          registry_.AddGauge("kvshard:num_requests_running", "Requests in the running batch.")),
      waiting_(
          registry_.AddGauge("kvshard:num_requests_waiting", "Requests waiting to be scheduled.")),
      kv_usage_(registry_.AddGauge("kvshard:kv_cache_usage_perc",
                                   "Fraction of KV cache blocks in use (1 = full).")),
      prefix_queries_(registry_.AddCounter("kvshard:prefix_cache_queries_total",
                                           "Prompt tokens looked up in the prefix cache.")),
      prefix_hits_(registry_.AddCounter("kvshard:prefix_cache_hits_total",
                                        "Prompt tokens found in the prefix cache.")),
      preemptions_(registry_.AddCounter("kvshard:num_preemptions_total",
                                        "Sequences preempted for lack of KV blocks (their KV is "
                                        "recomputed when they resume).")),
      pinned_blocks_(registry_.AddGauge("kvshard:prompt_cache_pinned_blocks",
                                        "KV cache blocks held by prompt-caching pins (cache "
                                        "breakpoints) now, over all instances.")),
      pin_hits_(registry_.AddCounter("kvshard:prompt_cache_pin_hits_total",
                                     "Admissions whose prefix-cache hit read pinned blocks.")),
      pins_expired_(registry_.AddCounter("kvshard:prompt_cache_pins_expired_total",
                                         "Prompt-caching pins that lapsed at their TTL.")),
      pins_refused_(registry_.AddCounter(
          "kvshard:prompt_cache_pins_refused_total",
          "Prompt-caching pins not made, or lapsed before their TTL, for lack of room "
          "(kv_cache.max_pinned_fraction, or work that could not run otherwise).")),
      cache_creation_tokens_(registry_.AddCounter(
          "kvshard:prompt_cache_creation_tokens_total",
          "Prompt tokens finished requests computed and pinned up to their cache breakpoints.")),
      prompt_tokens_(registry_.AddCounter("kvshard:prompt_tokens_total",
                                          "Prompt tokens of finished requests.")),
      generation_tokens_(registry_.AddCounter("kvshard:generation_tokens_total",
                                              "Generated tokens of finished requests.")),
      kv_transfer_bytes_(registry_.AddCounter("kvshard:kv_transfer_bytes_total",
                                              "KV cache bytes moved by completed prefill->decode "
                                              "handoffs, summed over all ranks.")),
      kv_transfer_seconds_(registry_.AddHistogram(
          "kvshard:kv_transfer_seconds",
          "KV handoff latency: from the prefill step's end to the end of the decode step that "
          "received the KV, in seconds.",
          kKvTransferBuckets)),
      kv_transfers_(registry_.AddCounter("kvshard:kv_transfers_total",
                                         "Completed prefill->decode KV handoffs.")),
      kv_transfer_failures_(registry_.AddCounter(
          "kvshard:kv_transfer_failures_total",
          "Failed prefill->decode KV handoffs (the request continued on the prefill instance).")),
      kv_pair_replans_(registry_.AddCounter(
          "kvshard:kv_pair_replans_total",
          "KV pair re-plans (kv_transfer.path: nccl): new pair ids after an instance re-formed "
          "or a pair set failed.")),
      iteration_tokens_(registry_.AddHistogram(
          "kvshard:iteration_tokens_total",
          "Tokens computed by one engine step (prompt chunks plus one per decoding sequence).",
          kIterationTokenBuckets)),
      queue_time_(registry_.AddHistogram(
          "kvshard:request_queue_time_seconds",
          "Time from a request's arrival to the first step that ran it, in seconds.",
          kRequestPhaseBuckets)),
      prefill_time_(registry_.AddHistogram(
          "kvshard:request_prefill_time_seconds",
          "Time from the first step that ran a request to its first generated token, in seconds.",
          kRequestPhaseBuckets)),
      decode_time_(registry_.AddHistogram(
          "kvshard:request_decode_time_seconds",
          "Time from a request's first generated token to its last, in seconds.",
          kRequestPhaseBuckets)),
      inference_time_(registry_.AddHistogram(
          "kvshard:request_inference_time_seconds",
          "Time from the first step that ran a request to its last generated token (prefill + "
          "decode), in seconds.",
          kRequestPhaseBuckets)),
      request_prompt_tokens_(registry_.AddHistogram("kvshard:request_prompt_tokens",
                                                    "Prompt tokens of each finished request.",
                                                    OneTwoFiveBuckets(options.max_model_len))),
      request_generation_tokens_(
          registry_.AddHistogram("kvshard:request_generation_tokens",
                                 "Generated tokens of each finished request, over all its choices.",
                                 OneTwoFiveBuckets(options.max_model_len))),
      request_params_n_(registry_.AddHistogram("kvshard:request_params_n",
                                               "The n (choices) of each finished request.",
                                               {1, 2, 5, 10, 20})),
      request_params_max_tokens_(registry_.AddHistogram("kvshard:request_params_max_tokens",
                                                        "The max_tokens of each finished request.",
                                                        OneTwoFiveBuckets(options.max_model_len))) {
}

const ServerMetrics::PoolSeries& ServerMetrics::Pool(const std::string& pool) {
    for (const PoolSeries* p = pools_.load(std::memory_order_acquire); p != nullptr; p = p->next) {
        if (p->pool == pool) return *p;
    }
    std::lock_guard<std::mutex> lock(pools_mu_);
    const PoolSeries* head = pools_.load(std::memory_order_acquire);
    for (const PoolSeries* p = head; p != nullptr; p = p->next) {
        if (p->pool == pool) return *p;  // another thread created it meanwhile
    }
    pool_storage_.push_back(std::make_unique<PoolSeries>(PoolSeries{
        pool, &registry_.LabeledHistogram(kPoolTtftName, kPoolTtftHelp, "pool", pool, kTtftBuckets),
        &registry_.LabeledHistogram(kPoolItlName, kPoolItlHelp, "pool", pool, kItlBuckets), head}));
    const PoolSeries* series = pool_storage_.back().get();
    pools_.store(series, std::memory_order_release);
    return *series;
}

void ServerMetrics::OnFirstToken(const std::string& pool, double seconds_since_arrival) {
    ttft_.Observe(seconds_since_arrival);
    Pool(pool).ttft->Observe(seconds_since_arrival);
}

void ServerMetrics::OnInterToken(const std::string& pool, double seconds) {
    itl_.Observe(seconds);
    Pool(pool).itl->Observe(seconds);
}

void ServerMetrics::OnKvTransfer(int64_t bytes, double seconds) {
    kv_transfer_bytes_.Add(static_cast<double>(bytes));
    kv_transfer_seconds_.Observe(seconds);
    kv_transfers_.Add();
}

void ServerMetrics::OnKvTransferFailed(const Status& /*status*/) { kv_transfer_failures_.Add(); }

void ServerMetrics::OnStepTokens(int64_t num_tokens) {
    iteration_tokens_.Observe(static_cast<double>(num_tokens));
}

void ServerMetrics::OnRequestFinished(const FinishedRequestStats& stats) {
    e2e_.Observe(stats.e2e_seconds);
    prompt_tokens_.Add(static_cast<double>(stats.prompt_tokens));
    cache_creation_tokens_.Add(static_cast<double>(stats.cache_creation_tokens));
    generation_tokens_.Add(static_cast<double>(stats.generation_tokens));
    registry_
        .LabeledCounter("kvshard:request_success_total", "Finished requests by finish reason.",
                        "finished_reason", stats.finished_reason)
        .Add();
    if (stats.failed) return;  // the phase histograms: requests that ended normally
    queue_time_.Observe(stats.queue_seconds);
    prefill_time_.Observe(stats.prefill_seconds);
    decode_time_.Observe(stats.decode_seconds);
    inference_time_.Observe(stats.inference_seconds);
    request_prompt_tokens_.Observe(static_cast<double>(stats.prompt_tokens));
    request_generation_tokens_.Observe(static_cast<double>(stats.generation_tokens));
    request_params_n_.Observe(stats.n);
    request_params_max_tokens_.Observe(static_cast<double>(stats.max_tokens));
}

std::string ServerMetrics::Render(const EngineStats& stats) {
    running_.Set(static_cast<double>(stats.num_running));
    waiting_.Set(static_cast<double>(stats.num_waiting));
    kv_usage_.Set(stats.kv_cache_usage);
    prefix_queries_.SetTotal(static_cast<double>(stats.prefix_cache_queries_tokens));
    prefix_hits_.SetTotal(static_cast<double>(stats.prefix_cache_hits_tokens));
    preemptions_.SetTotal(static_cast<double>(stats.num_preemptions));
    pinned_blocks_.Set(static_cast<double>(stats.pinned_blocks));
    pin_hits_.SetTotal(static_cast<double>(stats.pin_hits_total));
    pins_expired_.SetTotal(static_cast<double>(stats.pins_expired_total));
    pins_refused_.SetTotal(static_cast<double>(stats.pins_refused_total));
    for (const InstanceUp& i : stats.instances) {
        registry_
            .LabeledGauge("kvshard:instance_up",
                          "1 while the instance's workers can serve, 0 while they are down "
                          "(restarting, or given up).",
                          {{"instance", i.instance}, {"pool", i.pool}})
            .Set(i.up ? 1.0 : 0.0);
    }
    for (const CacheConfigInfo& c : stats.cache_configs) {
        registry_
            .LabeledGauge("kvshard:cache_config_info",
                          "Information of the KV cache of each instance (value 1; the settings "
                          "are its labels).",
                          {{"instance", c.instance},
                           {"block_size", std::to_string(c.block_size)},
                           {"num_gpu_blocks", std::to_string(c.num_blocks)},
                           {"enable_prefix_caching", c.enable_prefix_caching ? "True" : "False"}})
            .Set(1.0);
    }
    std::string text =
        options_.vllm_names ? registry_.Render("kvshard:", "vllm:") : registry_.Render();
    // Where /proc cannot be read the process_* families are left out rather than written as 0.
    if (Result<ProcessStats> p = ReadProcessStats(); p.ok()) text += RenderProcessMetrics(*p);
    return text;
}

}  // namespace kvshard
