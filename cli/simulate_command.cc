// `kvshard simulate`: kvshard's own engine, scheduler, block manager and router on simulated GPU
// clusters (sim/cluster/simulator.h, docs/simulate.md). Reports what `kvshard bench` reports for
// a real server, plus KV usage, preemptions, handoffs and pool utilization; sweeps the request
// rate for the highest one meeting an SLO, and searches the placements of a GPU budget.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <set>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "cli/simulate_placement.h"
#include "cli/simulate_report.h"
#include "common/logging.h"
#include "config/arch_config.h"
#include "config/server_config.h"
#include "loadgen/bench_report.h"
#include "loadgen/trace_file.h"
#include "sim/cluster/simulator.h"

namespace kvshard::cli {
namespace {

struct SimulateFlags {
    std::string model_config;
    std::string config;
    std::string placement;
    int tp = 1;
    int instances = 1;
    std::string device = "h200";
    std::string catalog;
    std::string profile;
    double profile_scale = 1.0;
    bool profile_spread = false;
    std::string weight_dtype = "bf16";
    std::string kv_dtype = "bf16";
    double memory_utilization = 0.9;
    int64_t num_kv_blocks = 0;
    int64_t block_size = 16;
    int64_t max_num_seqs = 256;
    int64_t max_num_batched_tokens = 8192;
    int64_t max_model_len = 0;
    bool no_prefix_caching = false;
    bool layerwise = false;
    int64_t max_waiting_requests = 0;  // only when given (the default is no cap)
    int64_t cache_ttl_ms = 0;
    double max_pinned_fraction = 0.5;
    int64_t min_pinned_tokens = 1024;
    double request_timeout_s = 0;
    double frontend_ms = 0;
    double frontend_ms_per_token = 0;
    std::string per_request_out;
    // Workload
    std::string dataset = "random";
    std::string dataset_path;
    int64_t num_requests = 1000;
    int64_t input_len = 1024;
    int64_t output_len = 256;
    double range_ratio = 0.0;
    int64_t num_groups = 4;
    int64_t prefix_len = 512;
    int64_t suffix_len = 32;
    std::string length_dist;  // "": the dataset's own; fixed | uniform | lognormal
    double sigma = 0.5;
    std::string request_rate = "inf";
    double burstiness = 1.0;
    uint64_t seed = 0;
    // Output and searches
    std::string slo;
    double slo_attainment = 0.9;
    bool json = false;
    bool sweep_rate = false;
    bool search = false;
    int64_t gpus = 0;
    int max_tp = 8;
    std::set<std::string> given;  // the flags given on the command line
};

// A flag that the rest of the command line makes meaningless is refused by name, never ignored.
Status CheckFlagsApply(const SimulateFlags& f) {
    auto given = [&](const char* name) { return f.given.count(name) > 0; };
    auto refuse = [&](const char* flag, const std::string& why) -> Status {
        if (!given(flag)) return Status::Ok();
        return InvalidArgument(std::string(flag) + " " + why);
    };
    if (!f.config.empty()) {
        // The file's settings are the deployment's; a flag beside them would be one or the other.
        for (const char* flag :
             {"--placement", "--tp", "--instances", "--max-num-seqs", "--max-num-batched-tokens",
              "--max-model-len", "--block-size", "--no-prefix-caching", "--layerwise",
              "--num-kv-blocks", "--max-waiting-requests", "--max-pinned-fraction",
              "--min-pinned-tokens", "--request-timeout-s"}) {
            KV_RETURN_IF_ERROR(refuse(flag, "conflicts with --config (set it in the file)"));
        }
    }
    if (f.profile.empty()) {
        KV_RETURN_IF_ERROR(refuse("--profile-scale", "applies with --profile only"));
        KV_RETURN_IF_ERROR(refuse("--profile-spread", "applies with --profile only"));
    }
    if (!f.placement.empty()) {
        KV_RETURN_IF_ERROR(refuse("--tp", "conflicts with --placement (give tp there)"));
        KV_RETURN_IF_ERROR(refuse("--instances", "conflicts with --placement"));
    }
    if (f.search) {
        for (const char* flag : {"--config", "--placement", "--tp", "--instances"})
            KV_RETURN_IF_ERROR(refuse(flag, "conflicts with --search (it tries every placement)"));
    } else {
        KV_RETURN_IF_ERROR(refuse("--gpus", "applies to --search only"));
        KV_RETURN_IF_ERROR(refuse("--max-tp", "applies to --search only"));
    }
    if (!f.search && !f.sweep_rate)
        KV_RETURN_IF_ERROR(refuse("--slo-attainment", "applies to --sweep-rate and --search only"));
    if (f.sweep_rate || f.search)
        KV_RETURN_IF_ERROR(refuse("--request-rate", "conflicts with --sweep-rate and --search"));
    if (f.sweep_rate || f.search) {
        KV_RETURN_IF_ERROR(refuse("--per-request-out",
                                  "conflicts with --sweep-rate and --search (many runs)"));
    }
    if (f.request_rate == "inf")
        KV_RETURN_IF_ERROR(refuse("--burstiness", "needs a finite --request-rate"));
    const bool trace = f.dataset == "trace";
    if (!trace) KV_RETURN_IF_ERROR(refuse("--dataset-path", "applies to --dataset trace only"));
    if (trace) {
        for (const char* flag :
             {"--num-requests", "--input-len", "--output-len", "--range-ratio", "--length-dist",
              "--request-rate", "--burstiness"}) {
            KV_RETURN_IF_ERROR(refuse(flag, "conflicts with --dataset trace (the trace has them)"));
        }
    }
    if (f.dataset != "shared-prefix") {
        for (const char* flag : {"--num-groups", "--prefix-len", "--suffix-len"})
            KV_RETURN_IF_ERROR(refuse(flag, "applies to --dataset shared-prefix only"));
    }
    if (f.dataset == "shared-prefix") {
        KV_RETURN_IF_ERROR(refuse("--input-len", "does not apply to --dataset shared-prefix "
                                                 "(--prefix-len + --suffix-len)"));
        KV_RETURN_IF_ERROR(refuse("--range-ratio", "does not apply to --dataset shared-prefix"));
    }
    if (f.dataset == "chat")
        KV_RETURN_IF_ERROR(refuse("--range-ratio", "does not apply to --dataset chat"));
    if (f.length_dist == "fixed" || f.length_dist == "lognormal")
        KV_RETURN_IF_ERROR(refuse("--range-ratio", "applies to --length-dist uniform only"));
    if (f.length_dist != "lognormal")
        KV_RETURN_IF_ERROR(refuse("--sigma", "applies to --length-dist lognormal only"));
    // Breakpoints mark a prefix group's shared prefix: only these datasets have groups.
    if (f.dataset != "shared-prefix" && !trace)
        KV_RETURN_IF_ERROR(
            refuse("--cache-ttl-ms", "needs prefix groups (--dataset shared-prefix or a trace)"));
    if (f.no_prefix_caching)
        KV_RETURN_IF_ERROR(refuse("--cache-ttl-ms", "conflicts with --no-prefix-caching"));
    if (f.cache_ttl_ms <= 0) {
        for (const char* flag : {"--max-pinned-fraction", "--min-pinned-tokens"})
            KV_RETURN_IF_ERROR(refuse(flag, "applies with --cache-ttl-ms only (no request pins)"));
    }
    return Status::Ok();
}

Result<double> ParseRate(const std::string& text) {
    if (text == "inf") return std::numeric_limits<double>::infinity();
    char* end = nullptr;
    const double r = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size() || !(r > 0))
        return InvalidArgument("--request-rate must be a positive number or inf, got '" + text + "'");
    return r;
}

Result<std::vector<sim::SimRequest>> MakeRequests(const SimulateFlags& f, double rate) {
    sim::ArrivalSpec arrivals;
    if (std::isinf(rate)) {
        arrivals.kind = sim::ArrivalSpec::Kind::kInfinite;
    } else {
        arrivals.kind = f.burstiness == 1.0 ? sim::ArrivalSpec::Kind::kPoisson
                                            : sim::ArrivalSpec::Kind::kBursty;
        arrivals.rate = rate;
        arrivals.burstiness = f.burstiness;
    }
    if (f.dataset == "trace") {
        if (f.dataset_path.empty()) return InvalidArgument("--dataset trace needs --dataset-path");
        return sim::ReadTrace(f.dataset_path);  // arrival times as recorded
    }
    if (!f.length_dist.empty()) {
        if (f.dataset != "random")
            return InvalidArgument("--length-dist applies to --dataset random only");
        sim::LengthWorkload w;
        w.num_requests = f.num_requests;
        w.arrivals = arrivals;
        w.seed = f.seed;
        if (f.length_dist == "fixed") {
            w.prompt = sim::LengthDist::Fixed(f.input_len);
            w.output = sim::LengthDist::Fixed(f.output_len);
        } else if (f.length_dist == "uniform") {
            auto u = [&](int64_t n) {
                const auto lo = static_cast<int64_t>(std::llround(double(n) * (1 - f.range_ratio)));
                const auto hi = static_cast<int64_t>(std::llround(double(n) * (1 + f.range_ratio)));
                return sim::LengthDist::Uniform(std::max<int64_t>(lo, 1), std::max<int64_t>(hi, 1));
            };
            w.prompt = u(f.input_len);
            w.output = u(f.output_len);
        } else if (f.length_dist == "lognormal") {
            w.prompt = sim::LengthDist::LogNormalMean(double(f.input_len), f.sigma, 1, 8 * f.input_len);
            w.output = sim::LengthDist::LogNormalMean(double(f.output_len), f.sigma, 1, 8 * f.output_len);
        } else {
            return InvalidArgument("--length-dist must be fixed, uniform or lognormal, got '" +
                                   f.length_dist + "'");
        }
        return sim::MakeWorkload(w);
    }
    KV_ASSIGN_OR_RETURN(sim::DatasetKind kind, sim::ParseDatasetKind(f.dataset));
    sim::DatasetWorkload w;
    w.kind = kind;
    w.num_requests = f.num_requests;
    w.input_len = f.input_len;
    w.output_len = f.output_len;
    w.range_ratio = f.range_ratio;
    w.num_groups = f.num_groups;
    w.prefix_len = f.prefix_len;
    w.suffix_len = f.suffix_len;
    w.arrivals = arrivals;
    w.seed = f.seed;
    return sim::MakeWorkload(w);
}

// The share of requests that completed within every SLO target.
double Attainment(const loadgen::BenchReport& r, int64_t num_requests) {
    if (!r.goodput || num_requests == 0) return r.completed == num_requests ? 1.0 : 0.0;
    return *r.goodput * r.duration_s / static_cast<double>(num_requests);
}

struct RunOutcome {
    sim::SimulationResult sim;
    loadgen::BenchReport report;
    double attainment = 0;
};

Result<RunOutcome> RunOnce(const SimulateFlags& f, const sim::SimulationOptions& options,
                           const loadgen::Slo& slo, double rate) {
    KV_ASSIGN_OR_RETURN(std::vector<sim::SimRequest> requests, MakeRequests(f, rate));
    KV_ASSIGN_OR_RETURN(sim::SimulationResult result, sim::Simulate(options, requests, f.seed));
    RunOutcome o;
    o.report = loadgen::MakeReport(result.run, slo);
    o.report.model = options.arch.path;
    o.report.dataset = f.dataset;
    o.report.request_rate = rate;
    o.attainment = Attainment(o.report, static_cast<int64_t>(requests.size()));
    o.sim = std::move(result);
    return o;
}

// The highest rate whose SLO attainment is at least the target: doubling from 0.25 req/s until
// it fails, then bisecting to 2% (a rate beyond capacity only grows the queue).
struct Sweep {
    double best_rate = 0;
    std::optional<RunOutcome> best;
    std::vector<std::pair<double, double>> tried;  // rate, attainment
};

Result<Sweep> SweepRate(const SimulateFlags& f, const sim::SimulationOptions& options,
                        const loadgen::Slo& slo) {
    Sweep s;
    double lo = 0, hi = 0, rate = 0.25;
    for (int i = 0; i < 24 && hi == 0; ++i, rate *= 2) {
        KV_ASSIGN_OR_RETURN(RunOutcome o, RunOnce(f, options, slo, rate));
        s.tried.push_back({rate, o.attainment});
        if (o.attainment >= f.slo_attainment) {
            lo = rate;
            s.best = std::move(o);
        } else {
            hi = rate;
        }
    }
    while (hi > 0 && lo > 0 && (hi - lo) / lo > 0.02) {
        const double mid = (lo + hi) / 2;
        KV_ASSIGN_OR_RETURN(RunOutcome o, RunOnce(f, options, slo, mid));
        s.tried.push_back({mid, o.attainment});
        if (o.attainment >= f.slo_attainment) {
            lo = mid;
            s.best = std::move(o);
        } else {
            hi = mid;
        }
    }
    s.best_rate = lo;
    return s;
}

nlohmann::json RunJson(const RunOutcome& o) {
    nlohmann::json j = nlohmann::json::parse(loadgen::ReportJson(o.report));
    j["slo_attainment"] = o.attainment;
    j["simulation"] = SimulationJson(o.sim);
    return j;
}

int RunSimulate(const SimulateFlags& f) {
    InitLogging("simulate", "warn");
    if (Status st = CheckFlagsApply(f); !st.ok()) return Fail(st.message());
    Result<ArchConfig> arch = ReadArchConfig(f.model_config);
    if (!arch.ok()) return Fail(arch.status().message());
    Result<KvDtype> kv_dtype = ParseKvDtype(f.kv_dtype);
    if (!kv_dtype.ok()) return Fail("--kv-dtype: " + kv_dtype.status().message());
    Result<kv::WeightDtype> weight_dtype = kv::ParseWeightDtype(f.weight_dtype);
    if (!weight_dtype.ok()) return Fail("--weight-dtype: " + weight_dtype.status().message());
    auto slo = loadgen::ParseSlo(f.slo);
    if (!slo.ok()) return Fail(slo.status().message());
    Result<double> rate = ParseRate(f.request_rate);
    if (!rate.ok()) return Fail(rate.status().message());
    if (!(f.slo_attainment > 0 && f.slo_attainment <= 1))
        return Fail("--slo-attainment must be in (0, 1]");
    if ((f.sweep_rate || f.search) && slo->empty())
        return Fail(std::string(f.search ? "--search" : "--sweep-rate") +
                    " needs --slo (the targets a rate must meet)");
    if ((f.sweep_rate || f.search) && f.dataset == "trace")
        return Fail("--sweep-rate and --search set the arrival rate; a trace has its own times");

    sim::SimulationOptions options;
    options.arch = *arch;
    options.weight_dtype = *weight_dtype;
    options.kv_dtype = *kv_dtype;
    Result<std::vector<sim::Accelerator>> catalog =
        f.catalog.empty() ? Result<std::vector<sim::Accelerator>>(sim::BuiltinAccelerators())
                          : sim::LoadAcceleratorCatalog(f.catalog);
    if (!catalog.ok()) return Fail(catalog.status().message());
    Result<sim::Accelerator> device = sim::FindAccelerator(f.device, *catalog);
    if (!device.ok()) return Fail("--device: " + device.status().message());
    options.device = *device;
    if (!f.profile.empty()) {
        if (!(f.profile_scale > 0 && std::isfinite(f.profile_scale)))
            return Fail("--profile-scale must be a positive number");
        Result<sim::CpuProfile> profile = sim::LoadCpuProfile(f.profile);
        if (!profile.ok()) return Fail(profile.status().message());
        std::fputs(ProfileText(f.profile, *profile).c_str(), stderr);
        options.profile = profile->Scaled(f.profile_scale);
        options.profile_spread = f.profile_spread;
        if (f.given.count("--profile-scale"))
            std::fprintf(stderr, "profile %s: step times scaled by %.4f (--profile-scale)\n",
                         f.profile.c_str(), f.profile_scale);
    }
    options.scheduler.max_num_seqs = f.max_num_seqs;
    options.scheduler.max_num_batched_tokens = f.max_num_batched_tokens;
    options.scheduler.max_model_len = f.max_model_len;
    options.blocks.block_size = f.block_size;
    options.memory_utilization = f.memory_utilization;
    options.blocks.num_blocks = f.num_kv_blocks;
    options.blocks.enable_prefix_caching = !f.no_prefix_caching;
    options.handoff.layerwise = f.layerwise;
    if (f.given.count("--max-waiting-requests") > 0) {
        if (f.max_waiting_requests < 0) return Fail("--max-waiting-requests must be >= 0");
        options.scheduler.max_waiting_requests = f.max_waiting_requests;
    }
    if (f.given.count("--cache-ttl-ms") > 0 &&
        !(f.cache_ttl_ms >= 1 && f.cache_ttl_ms <= 86'400'000))
        return Fail("--cache-ttl-ms must be in 1..86400000 (24 h), as a breakpoint's TTL");
    options.cache_ttl_ms = f.cache_ttl_ms;
    options.request_timeout_s = f.request_timeout_s;
    if (!(f.frontend_ms >= 0)) return Fail("--frontend-ms must be >= 0");
    options.frontend_s = f.frontend_ms / 1000.0;
    if (!(f.frontend_ms_per_token >= 0)) return Fail("--frontend-ms-per-token must be >= 0");
    options.frontend_per_prompt_token_s = f.frontend_ms_per_token / 1000.0;
    options.blocks.max_pinned_fraction = f.max_pinned_fraction;
    options.blocks.min_pinned_tokens = f.min_pinned_tokens;

    if (!f.config.empty()) {
        // The deployment file `kvshard serve` would run: its pools, scheduler and KV settings.
        // (Its model file is not read: the simulated model is --model-config.)
        Result<ServerConfig> config =
            LoadServerConfig(f.config, {{"model", f.model_config, "--model-config"}});
        if (!config.ok()) return Fail(config.status().message());
        options.pools = config->EffectivePools();
        options.scheduler = config->scheduler;      // max_waiting_requests and max_model_len too
        options.blocks = config->kv_cache;          // the block manager's part of kv_cache:
        options.handoff.layerwise = config->kv_transfer.layerwise;
        options.request_timeout_s = config->http.request_timeout_s;
        if (f.cache_ttl_ms > 0 && !options.blocks.enable_prefix_caching)
            return Fail(f.config +
                        ": kv_cache.enable_prefix_caching is false, so --cache-ttl-ms "
                        "would pin nothing");
        if (config->kv_cache.dtype.has_value()) {
            return Fail(f.config + ": kv_cache.dtype: simulate takes the KV dtype from --kv-dtype");
        }
        std::fprintf(stderr,
                     "simulate: from %s: pools, scheduler (with max_waiting_requests), kv_cache "
                     "(block_size, num_blocks, enable_prefix_caching, max_pinned_fraction, "
                     "min_pinned_tokens), server.request_timeout_s and kv_transfer.layerwise; "
                     "not simulated: model, the rest of server, workers, kv_cache.memory_mib, "
                     "kv_transfer.timeout_ms, pools' devices\n",
                     f.config.c_str());
    } else if (!f.placement.empty()) {
        Result<std::vector<PoolConfig>> pools = ParsePlacement(f.placement);
        if (!pools.ok()) return Fail(pools.status().message());
        options.pools = *pools;
    } else {
        PoolConfig p;
        p.name = "mixed";
        p.instances.assign(static_cast<size_t>(std::max(f.instances, 1)), InstanceConfig{f.tp, {}});
        options.pools = {p};
    }
    if (Status st = options.scheduler.Validate(); !st.ok()) return Fail(st.message());

    if (f.search) {
        if (f.gpus <= 0) return Fail("--search needs --gpus N (the budget to place)");
        struct Ranked {
            std::string placement;
            double rate = 0;
            double per_gpu = 0;
            std::string why;  // when it cannot serve
        };
        std::vector<Ranked> ranked;
        for (const std::vector<PoolConfig>& pools : Placements(f.gpus, f.max_tp)) {
            sim::SimulationOptions o = options;
            o.pools = pools;
            Ranked r;
            r.placement = PlacementText(pools);
            Result<Sweep> s = SweepRate(f, o, *slo);
            if (!s.ok()) {
                r.why = s.status().message();
            } else {
                r.rate = s->best_rate;
                r.per_gpu = s->best_rate / double(f.gpus);
                if (r.rate == 0) r.why = "meets the SLO at no rate tried (from 0.25 req/s)";
            }
            ranked.push_back(r);
        }
        std::stable_sort(ranked.begin(), ranked.end(),
                         [](const Ranked& a, const Ranked& b) { return a.per_gpu > b.per_gpu; });
        if (f.json) {
            nlohmann::json j = nlohmann::json::array();
            for (const Ranked& r : ranked) {
                j.push_back({{"placement", r.placement}, {"max_rate", r.rate},
                             {"max_rate_per_gpu", r.per_gpu},
                             {"note", r.why.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.why)}});
            }
            std::printf("%s\n", j.dump(2).c_str());
        } else {
            std::printf("Placements of %lld x %s for %s, SLO %s met by %.0f%% of requests:\n",
                        static_cast<long long>(f.gpus), options.device.name.c_str(),
                        arch->path.c_str(), f.slo.c_str(), 100 * f.slo_attainment);
            std::printf("%-32s %14s %14s\n", "placement", "max req/s", "req/s per GPU");
            for (const Ranked& r : ranked) {
                if (!r.why.empty() && r.rate == 0) {
                    std::printf("%-32s %14s %14s  (%s)\n", r.placement.c_str(), "-", "-", r.why.c_str());
                } else {
                    std::printf("%-32s %14.2f %14.3f\n", r.placement.c_str(), r.rate, r.per_gpu);
                }
            }
        }
        return ranked.empty() || ranked[0].rate == 0 ? 1 : 0;
    }

    if (f.sweep_rate) {
        Result<Sweep> s = SweepRate(f, options, *slo);
        if (!s.ok()) return Fail(s.status().message());
        if (f.json) {
            nlohmann::json tried = nlohmann::json::array();
            for (auto [r, a] : s->tried) tried.push_back({{"rate", r}, {"slo_attainment", a}});
            nlohmann::json j = {{"max_rate", s->best_rate}, {"tried", tried}};
            if (s->best) j["at_max_rate"] = RunJson(*s->best);
            std::printf("%s\n", j.dump(2).c_str());
        } else {
            std::printf("%-14s %s\n", "rate (req/s)", "SLO attainment");
            for (auto [r, a] : s->tried) std::printf("%-14.3f %.3f\n", r, a);
            if (!s->best) {
                std::printf("No rate tried (from 0.25 req/s) meets the SLO for %.0f%% of requests.\n",
                            100 * f.slo_attainment);
                return 1;
            }
            std::printf("Highest rate meeting the SLO for %.0f%% of requests: %.2f req/s\n\n",
                        100 * f.slo_attainment, s->best_rate);
            std::fputs(loadgen::ReportText(s->best->report).c_str(), stdout);
            std::fputs(SimulationText(s->best->sim).c_str(), stdout);
        }
        return s->best ? 0 : 1;
    }

    Result<RunOutcome> o = RunOnce(f, options, *slo, *rate);
    if (!o.ok()) return Fail(o.status().message());
    if (!f.per_request_out.empty()) {
        const Status written = loadgen::WritePerRequestFile(f.per_request_out, o->sim.run.outcomes);
        if (!written.ok()) return Fail(written.message());
    }
    if (f.json) {
        std::printf("%s\n", RunJson(*o).dump(2).c_str());
    } else {
        std::fputs(loadgen::ReportText(o->report).c_str(), stdout);
        std::fputs(SimulationText(o->sim).c_str(), stdout);
    }
    return o->report.completed > 0 ? 0 : 1;
}

}  // namespace

Command RegisterSimulate(CLI::App& app) {
    auto f = std::make_shared<SimulateFlags>();
    CLI::App* sub = app.add_subcommand(
        "simulate", "Run kvshard's scheduler and router on simulated GPUs: latency and goodput");
    sub->add_option("--model-config", f->model_config, "The model's Hugging Face config.json")
        ->required();
    sub->add_option("--config", f->config,
                    "A kvshard serve YAML: its pools, scheduler and kv_cache settings");
    sub->add_option("--placement", f->placement,
                    "Pools without a file: mixed=COUNTxTP, or prefill=COUNTxTP,decode=COUNTxTP");
    sub->add_option("--tp", f->tp, "Tensor-parallel GPUs per instance (one mixed pool)")
        ->capture_default_str();
    sub->add_option("--instances", f->instances, "Instances of the mixed pool")->capture_default_str();
    sub->add_option("--device", f->device, "Accelerator kind: a100, h100, h200, b200 (or the catalog's)")
        ->capture_default_str();
    sub->add_option("--catalog", f->catalog, "YAML overriding or adding accelerator kinds");
    sub->add_option("--profile", f->profile,
                    "Measured step costs (kvshard bench-engine --json) instead of the roofline");
    sub->add_option("--profile-scale", f->profile_scale,
                    "Multiply the profile's step times by this (the machine's speed during the "
                    "run replayed against the profile's)")
        ->capture_default_str();
    sub->add_flag("--profile-spread", f->profile_spread,
                  "Each decode-only step's time times a random draw from how the profile's "
                  "measured decode steps spread around the fit (seeded by --seed)");
    sub->add_option("--weight-dtype", f->weight_dtype, "bf16, fp16, fp8, int4, fp32")->capture_default_str();
    sub->add_option("--kv-dtype", f->kv_dtype, "bf16, fp16, fp8, int8, fp32")->capture_default_str();
    sub->add_option("--memory-utilization", f->memory_utilization,
                    "Share of each GPU's memory for weights and KV")->capture_default_str();
    sub->add_option("--num-kv-blocks", f->num_kv_blocks,
                    "KV blocks per instance (0: what the memory holds)")->capture_default_str();
    sub->add_option("--block-size", f->block_size, "Tokens per KV block")->capture_default_str();
    sub->add_option("--max-num-seqs", f->max_num_seqs, "Sequences per step")->capture_default_str();
    sub->add_option("--max-num-batched-tokens", f->max_num_batched_tokens, "Tokens per step")
        ->capture_default_str();
    sub->add_option("--max-model-len", f->max_model_len, "Context length (0: the model's)")
        ->capture_default_str();
    sub->add_flag("--no-prefix-caching", f->no_prefix_caching, "Turn the prefix cache off");
    sub->add_flag("--layerwise", f->layerwise, "Hand KV over layer by layer, overlapping prefill");
    sub->add_option(
        "--max-waiting-requests", f->max_waiting_requests,
        "Refuse (429) requests beyond max-num-seqs + this per instance (default: no cap)");
    sub->add_option(
        "--cache-ttl-ms", f->cache_ttl_ms,
        "Prompt caching: each request of a prefix group pins its shared prefix this long");
    sub->add_option("--max-pinned-fraction", f->max_pinned_fraction,
                    "Prompt caching: the most of an instance's KV blocks pins may hold")
        ->capture_default_str();
    sub->add_option("--min-pinned-tokens", f->min_pinned_tokens,
                    "Prompt caching: shorter breakpoints are not pinned")
        ->capture_default_str();
    sub->add_option("--request-timeout-s", f->request_timeout_s,
                    "Abort (504) a request still running this long after it arrived (0: never)")
        ->capture_default_str();
    sub->add_option("--frontend-ms", f->frontend_ms,
                    "Front-end latency per request (HTTP, tokenize, first chunk) added to TTFT "
                    "and E2E, not ITL (0: not modelled)")
        ->capture_default_str();
    sub->add_option("--frontend-ms-per-token", f->frontend_ms_per_token,
                    "Front-end latency per prompt token (tokenization, chat template), added "
                    "as --frontend-ms is")
        ->capture_default_str();
    sub->add_option("--dataset", f->dataset, "random | shared-prefix | chat | trace")
        ->capture_default_str();
    sub->add_option("--dataset-path", f->dataset_path,
                    "trace: JSON lines of arrival_s, prompt_len, output_len[, prefix_group, prefix_len]");
    sub->add_option("--num-requests", f->num_requests, "Requests")->capture_default_str();
    sub->add_option("--input-len", f->input_len, "Prompt tokens (chat: median; lognormal: mean)")
        ->capture_default_str();
    sub->add_option("--output-len", f->output_len, "Output tokens (chat: median; lognormal: mean)")
        ->capture_default_str();
    sub->add_option("--range-ratio", f->range_ratio, "random, uniform: lengths vary by +-ratio")
        ->capture_default_str();
    sub->add_option("--num-groups", f->num_groups, "shared-prefix: groups")->capture_default_str();
    sub->add_option("--prefix-len", f->prefix_len, "shared-prefix: tokens shared by a group")
        ->capture_default_str();
    sub->add_option("--suffix-len", f->suffix_len, "shared-prefix: each request's own tokens")
        ->capture_default_str();
    sub->add_option("--length-dist", f->length_dist,
                    "random: fixed | uniform | lognormal lengths around --input-len/--output-len");
    sub->add_option("--sigma", f->sigma, "lognormal: sigma of the underlying normal")
        ->capture_default_str();
    sub->add_option("--request-rate", f->request_rate, "Arrivals per second, or inf (all at once)")
        ->capture_default_str();
    sub->add_option("--burstiness", f->burstiness,
                    "Gamma arrivals of this shape (1: Poisson; < 1 burstier)")->capture_default_str();
    sub->add_option("--seed", f->seed, "Seed of lengths, tokens and arrivals")->capture_default_str();
    sub->add_option("--slo", f->slo, "Goodput targets: ttft_ms=...,tpot_ms=...[,e2el_ms=...]");
    sub->add_option("--slo-attainment", f->slo_attainment,
                    "Share of requests that must meet the SLO (--sweep-rate, --search)")
        ->capture_default_str();
    sub->add_flag("--sweep-rate", f->sweep_rate, "Find the highest request rate meeting the SLO");
    sub->add_flag("--search", f->search,
                  "Rank every placement of --gpus GPUs by the highest rate per GPU meeting the SLO");
    sub->add_option("--gpus", f->gpus, "--search: the GPU budget");
    sub->add_option("--max-tp", f->max_tp, "--search: largest tp tried")->capture_default_str();
    sub->add_flag("--json", f->json, "Print JSON");
    sub->add_option("--per-request-out", f->per_request_out,
                    "Write each request's TTFT, ITL median and E2E as JSON lines (trace order)");
    return [f, sub] {
        for (const CLI::Option* o : sub->get_options()) {
            if (o->count() > 0) f->given.insert(o->get_name());
        }
        return RunSimulate(*f);
    };
}

}  // namespace kvshard::cli
