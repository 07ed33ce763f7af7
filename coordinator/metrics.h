// Metrics in the Prometheus text exposition format (version 0.0.4), served at GET /metrics.
//
// MetricsRegistry is a tiny registry of counters, gauges and fixed-bucket histograms. ServerMetrics
// holds kvshard's own metrics:
//   kvshard:time_to_first_token_seconds    histogram  request arrival -> first generated token
//   kvshard:inter_token_latency_seconds    histogram  between consecutive generated tokens
//   kvshard:e2e_request_latency_seconds    histogram  request arrival -> request finished
//   kvshard:num_requests_running           gauge      from Engine::Stats() at scrape time
//   kvshard:num_requests_waiting           gauge      "
//   kvshard:kv_cache_usage_perc            gauge      used KV blocks / all blocks, 0..1
//   kvshard:prefix_cache_queries_total     counter    prompt tokens looked up in the prefix cache
//   kvshard:prefix_cache_hits_total        counter    of those, tokens found
//   kvshard:prompt_cache_pinned_blocks     gauge      KV blocks held by prompt-caching pins now
//   kvshard:prompt_cache_pin_hits_total    counter    admissions whose prefix hit read pinned blocks
//   kvshard:prompt_cache_pins_expired_total  counter  pins that lapsed at their TTL
//   kvshard:prompt_cache_pins_refused_total  counter  pins not made, or lapsed early, for lack of
//                                                     room (kv_cache.max_pinned_fraction)
//   kvshard:prompt_cache_creation_tokens_total  counter  prompt tokens finished requests wrote and
//                                                     pinned (usage cache_creation_tokens)
//   kvshard:prompt_tokens_total            counter    prompt tokens of finished requests
//   kvshard:generation_tokens_total        counter    generated tokens of finished requests
//   kvshard:request_success_total          counter    finished requests, by finished_reason
//   kvshard:instance_up                    gauge      per instance and pool: 1 while its workers
//                                                     can serve, 0 while they are down
// All of them but the gauges come from the engines, through EngineObserver (engine threads of
// every instance call it; the engine measures each latency once, from the request's arrival):
//   kvshard:pool_time_to_first_token_seconds  histogram  per pool: arrival -> first token
//   kvshard:pool_inter_token_latency_seconds  histogram  per pool: between consecutive tokens
//   kvshard:kv_transfer_bytes_total           counter    KV bytes moved by handoffs (all ranks)
//   kvshard:kv_transfer_seconds               histogram  KV handoff latency: prefill step's end ->
//                                                        end of the decode step that received it
//   kvshard:kv_transfers_total                counter    completed KV handoffs
//   kvshard:kv_transfer_failures_total        counter    failed KV handoffs
//   kvshard:kv_pair_replans_total             counter    new KV pair ids handed out
//                                                        (kv_transfer.path: nccl; not from an
//                                                        engine: cli/kv_pair_replan.h)
//   kvshard:iteration_tokens_total            histogram  tokens computed by each engine step
//   kvshard:request_queue_time_seconds        histogram  arrival -> first scheduled in a step
//   kvshard:request_prefill_time_seconds      histogram  first scheduled -> first token
//   kvshard:request_decode_time_seconds       histogram  first token -> last token
//   kvshard:request_inference_time_seconds    histogram  first scheduled -> last token
//   kvshard:request_prompt_tokens             histogram  prompt tokens of each finished request
//   kvshard:request_generation_tokens         histogram  generated tokens (all choices) of each
//   kvshard:request_params_n                  histogram  the n of each finished request
//   kvshard:request_params_max_tokens         histogram  the max_tokens of each finished request
// (the request_* histograms: requests that ended without an error, FinishedRequestStats;
// buckets as vLLM's).
//   kvshard:cache_config_info                 gauge      1, per instance, with labels block_size,
//                                                        num_gpu_blocks (the pool's blocks) and
//                                                        enable_prefix_caching
// The pool histograms carry the label pool="<pool>": a pool's first observation creates its series
// in both. Every sample carries the label model_name="<served model>".
//
// Then, without model_name, the process metrics of prometheus_client (process_metrics.h). With
// ServerMetricsOptions::vllm_names, every kvshard: family is written a second time as vllm:<name>
// (same values and labels) for dashboards made for vLLM.
//
// Thread-safety: all methods may be called from any thread. Observations are lock-free atomics
// (the engine threads record them through the observer); registration and rendering take a
// mutex, and so does the first observation of a pool (it creates its series).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator/engine_api.h"
#include "coordinator/process_metrics.h"

namespace kvshard {

class Counter {
  public:
    void Add(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
    // For a counter mirrored from a source that keeps the running total (the engine's stats).
    void SetTotal(double v) { value_.store(v, std::memory_order_relaxed); }
    double value() const { return value_.load(std::memory_order_relaxed); }

  private:
    std::atomic<double> value_{0.0};
};

class Gauge {
  public:
    void Set(double v) { value_.store(v, std::memory_order_relaxed); }
    double value() const { return value_.load(std::memory_order_relaxed); }

  private:
    std::atomic<double> value_{0.0};
};

class Histogram {
  public:
    // REQUIRES: `upper_bounds` strictly increasing; +Inf is implied.
    explicit Histogram(std::vector<double> upper_bounds);
    void Observe(double v);

    struct Snapshot {
        std::vector<double> upper_bounds;
        std::vector<uint64_t> cumulative_counts;  // one per bound, then +Inf (= count)
        double sum = 0.0;
        uint64_t count = 0;
    };
    Snapshot Take() const;
    const std::vector<double>& upper_bounds() const { return upper_bounds_; }

  private:
    std::vector<double> upper_bounds_;
    std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, +Inf last; not cumulative
    std::atomic<double> sum_{0.0};
};

class MetricsRegistry {
  public:
    // Labels written on every sample, e.g. {{"model_name", "smol"}}.
    explicit MetricsRegistry(std::vector<std::pair<std::string, std::string>> constant_labels = {});

    // References stay valid for the registry's life. REQUIRES: names are unique.
    Counter& AddCounter(const std::string& name, const std::string& help);
    // A counter family with one extra label; each value gets its own Counter on first use.
    Counter& LabeledCounter(const std::string& name, const std::string& help,
                            const std::string& label, const std::string& value);
    Gauge& AddGauge(const std::string& name, const std::string& help);
    // A gauge family with extra labels; each set of values gets its own Gauge on first use.
    Gauge& LabeledGauge(const std::string& name, const std::string& help,
                        const std::vector<std::pair<std::string, std::string>>& labels);
    Histogram& AddHistogram(const std::string& name, const std::string& help,
                            std::vector<double> upper_bounds);
    // A histogram family with one extra label; each value gets its own Histogram on first use.
    // HELP/TYPE are written once for the family. REQUIRES: the same `upper_bounds` on every call.
    Histogram& LabeledHistogram(const std::string& name, const std::string& help,
                                const std::string& label, const std::string& value,
                                const std::vector<double>& upper_bounds);

    // The exposition text. When `alias_from` is not empty, every family whose name begins with
    // it is written a second time, under its name with that prefix replaced by `alias_to`, from
    // the same reading of its values.
    std::string Render(const std::string& alias_from = "", const std::string& alias_to = "") const;

  private:
    enum class Kind { kCounter, kGauge, kHistogram };
    struct Series {
        std::string label;  // extra label "name=\"value\"" or ""
        std::unique_ptr<Counter> counter;
        std::unique_ptr<Gauge> gauge;
        std::unique_ptr<Histogram> histogram;
    };
    struct Family {
        std::string name;
        std::string help;
        Kind kind;
        std::vector<Series> series;
    };
    Family& NewFamily(const std::string& name, const std::string& help, Kind kind);
    Family* FindFamily(const std::string& name);  // REQUIRES: mu_ held

    std::string constant_labels_;  // name="value",... (escaped), "" when none
    mutable std::mutex mu_;
    std::vector<std::unique_ptr<Family>> families_;  // guarded by mu_
};

// Formats a sample value as Prometheus does: shortest round-trip decimal (positional from 1e-4
// to 1), +Inf, -Inf, NaN.
std::string PrometheusNumber(double v);

// Writes prometheus_client's process_* families for `stats` (no constant labels).
std::string RenderProcessMetrics(const ProcessStats& stats);

struct ServerMetricsOptions {
    // The largest prompt + generation a request may have: the token-count histograms' buckets
    // run 1, 2, 5, 10, 20, 50, ... up to it, as vLLM's do.
    int64_t max_model_len = 4096;
    bool vllm_names = false;  // also write every kvshard: family as vllm:<name>
};

class ServerMetrics : public EngineObserver {
  public:
    explicit ServerMetrics(const std::string& model_name, ServerMetricsOptions options = {});

    // EngineObserver, from the engine threads: every latency is the engine's, measured once;
    // a first token or inter-token gap goes to the model-wide and the pool's histogram alike.
    // Lock-free once the pool's series exist.
    void OnFirstToken(const std::string& pool, double seconds_since_arrival) override;
    void OnInterToken(const std::string& pool, double seconds) override;
    void OnKvTransfer(int64_t bytes, double seconds) override;
    void OnKvTransferFailed(const Status& status) override;
    void OnStepTokens(int64_t num_tokens) override;
    void OnRequestFinished(const FinishedRequestStats& stats) override;
    // The KV pair path's pairs were re-planned (an instance re-formed, or a pair set failed).
    void OnKvPairsReplanned() { kv_pair_replans_.Add(); }

    // The exposition text, with gauges and engine counters taken from `stats`.
    std::string Render(const EngineStats& stats);

  private:
    // A pool's histograms. An append-only list: nodes are published with a release store of
    // pools_ (under pools_mu_) and never change or go away before the ServerMetrics does, so
    // readers walk it from one acquire load, without the mutex.
    struct PoolSeries {
        std::string pool;
        Histogram* ttft;
        Histogram* itl;
        const PoolSeries* next;
    };
    const PoolSeries& Pool(const std::string& pool);

    const ServerMetricsOptions options_;
    MetricsRegistry registry_;
    Histogram& ttft_;
    Histogram& itl_;
    Histogram& e2e_;
    Gauge& running_;
    Gauge& waiting_;
    Gauge& kv_usage_;
    Counter& prefix_queries_;
    Counter& prefix_hits_;
    Counter& preemptions_;
    Gauge& pinned_blocks_;
    Counter& pin_hits_;
    Counter& pins_expired_;
    Counter& pins_refused_;
    Counter& cache_creation_tokens_;
    Counter& prompt_tokens_;
    Counter& generation_tokens_;
    Counter& kv_transfer_bytes_;
    Histogram& kv_transfer_seconds_;
    Counter& kv_transfers_;
    Counter& kv_transfer_failures_;
    Counter& kv_pair_replans_;
    Histogram& iteration_tokens_;
    Histogram& queue_time_;
    Histogram& prefill_time_;
    Histogram& decode_time_;
    Histogram& inference_time_;
    Histogram& request_prompt_tokens_;
    Histogram& request_generation_tokens_;
    Histogram& request_params_n_;
    Histogram& request_params_max_tokens_;
    std::atomic<const PoolSeries*> pools_{nullptr};
    std::mutex pools_mu_;                                    // serializes creating a pool's series
    std::vector<std::unique_ptr<PoolSeries>> pool_storage_;  // owns the list; guarded by pools_mu_
};

}  // namespace kvshard
