#include "sim/cluster/simulator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <queue>
#include <random>
#include <unordered_map>

#include "common/clock.h"
#include "coordinator/router.h"
#include "kv/kv_cache_groups.h"
#include "model/bpe_tokenizer.h"
#include "model/tokenizer.h"

namespace kvshard::sim {
namespace {

// The token every modelled step samples: the byte-level symbol of 'a' (a normal token whose text
// is one byte, so detokenizing it costs what a real token does).
constexpr int32_t kSampledToken = 'a';

// A byte-level tokenizer with the model's vocabulary size: 256 byte tokens, then plain pieces.
// Prompts are made of token ids directly (the workload gives lengths, not text).
Result<std::unique_ptr<Tokenizer>> MakeTokenizer(int64_t vocab_size) {
    TokenizerData d;
    d.kind = TokenizerKind::kByteLevelBpe;
    for (const std::string& s : ByteLevelEncodeTable()) d.tokens.push_back(s);
    for (int64_t i = static_cast<int64_t>(d.tokens.size()); i < std::max<int64_t>(vocab_size, 257);
         ++i) {
        d.tokens.push_back("t" + std::to_string(i));
    }
    d.types.assign(d.tokens.size(), TokenType::kNormal);
    d.source = "simulated vocabulary";
    return Tokenizer::Create(std::move(d));
}

// The StepExecutor an engine holds in the simulation: never re-formed, always healthy. The driver
// runs plans itself (ModelStep) and the engine's own RunStep is not used.
class ModelledExecutor final : public StepExecutor {
  public:
    Result<StepResult> Execute(const StepPlan& plan) override { return ModelStep(plan, 0); }

    // The result of `plan` as the workers would return it: one token per sampling sequence, the
    // KV bytes each transfer moved.
    static StepResult ModelStep(const StepPlan& plan, int64_t kv_bytes_per_token) {
        StepResult r;
        r.step_id = plan.step_id;
        for (const ScheduledSequence& s : plan.sequences) {
            if (!s.sample) continue;
            SampledToken t;
            t.seq_id = s.seq_id;
            t.token_id = kSampledToken;
            r.tokens.push_back(t);
        }
        for (const KvSendOp& op : plan.kv_sends) r.kv_bytes_sent += op.num_tokens * kv_bytes_per_token;
        for (const KvRecvOp& op : plan.kv_recvs)
            r.kv_bytes_received += op.num_tokens * kv_bytes_per_token;
        return r;
    }
};

// What one request's client would have seen: times on the virtual clock.
class RecordingSink final : public RequestSink {
  public:
    RecordingSink(const VirtualClock& clock, loadgen::RequestOutcome* out)
        : clock_(clock), out_(out), start_(clock.NowSeconds()) {
        out_->start_s = start_;
    }
    void OnDelta(const GenerationDelta& d) override {
        if (d.token_ids.empty()) return;
        const double now = clock_.NowSeconds();
        if (!first_) {
            first_ = true;
            out_->ttft_s = now - start_;
        } else {
            out_->itl_s.push_back(now - last_);
        }
        last_ = now;
    }
    void OnFinish(const GenerationUsage& usage, const Status& status) override {
        out_->ok = status.ok() && !timed_out_;
        if (!status.ok()) out_->error = status.message();
        // The server answers a request it aborted at its deadline with 504.
        if (timed_out_) out_->error = "timed out (504): aborted at the request timeout";
        out_->e2e_s = clock_.NowSeconds() - start_;
        out_->output_tokens = usage.completion_tokens;
        out_->prompt_tokens = usage.prompt_tokens;
        out_->cached_tokens = usage.cached_tokens;
        out_->cache_creation_tokens = usage.cache_creation_tokens;
        done_ = true;
    }
    bool done() const { return done_; }
    void MarkTimedOut() { timed_out_ = true; }

  private:
    const VirtualClock& clock_;
    loadgen::RequestOutcome* out_;
    double start_ = 0, last_ = 0;
    bool first_ = false, done_ = false, timed_out_ = false;
};

struct Instance {
    std::string pool;
    int64_t first_gpu = 0;  // GPUs are numbered over the cluster in pool order
    int64_t tp = 1;
    std::unique_ptr<CostModel> cost;
    std::unique_ptr<ModelledExecutor> executor;
    std::unique_ptr<InstanceEngine> engine;
    // The step in flight, when it ends, and its number (an end event of an earlier number is
    // stale: the step was lengthened after it was scheduled).
    std::optional<StepPlan> plan;
    StepResult result;
    double step_end_s = 0;
    int64_t step_number = 0;
    double busy_s = 0;
    int64_t steps = 0;
    std::vector<int64_t> previous_seq_ids;  // sorted: the last step's (CostModel::Cost)
    int64_t decodes_since_prefill = 0;      // the last step's (NextDecodesSincePrefill)
};

constexpr int64_t kTimeoutEvent = -2;

struct Event {
    double time = 0;
    uint64_t order = 0;  // ties: in the order they were made
    int64_t instance = -1;  // -1: an arrival; -2: the request's timeout
    int64_t request = 0;    // an instance's step end: the step's number
    bool operator>(const Event& o) const {
        return time != o.time ? time > o.time : order > o.order;
    }
};

Clock::time_point AtSeconds(double s) {
    return Clock::time_point(
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)));
}

}  // namespace

Result<SimulationResult> Simulate(const SimulationOptions& o, const std::vector<SimRequest>& requests,
                                  uint64_t seed) {
    const auto wall_start = std::chrono::steady_clock::now();
    if (o.cache_ttl_ms != 0) {
        // The engine's own rule for a breakpoint's TTL, checked once rather than per request.
        const Status st = ValidateCacheBreakpoints({{1, o.cache_ttl_ms}}, 1);
        if (!st.ok()) return InvalidArgument("cache_ttl_ms: " + st.message());
    }
    if (!(o.frontend_s >= 0))
        return InvalidArgument("frontend_s must be >= 0, got " + std::to_string(o.frontend_s));
    if (!(o.frontend_per_prompt_token_s >= 0))
        return InvalidArgument("frontend_per_prompt_token_s must be >= 0, got " +
                               std::to_string(o.frontend_per_prompt_token_s));
    if (!(o.request_timeout_s >= 0))
        return InvalidArgument("request_timeout_s must be >= 0, got " +
                               std::to_string(o.request_timeout_s));
    if (o.scheduler.max_waiting_requests < 0)
        return InvalidArgument("scheduler.max_waiting_requests must be >= 0, got " +
                               std::to_string(o.scheduler.max_waiting_requests));
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, MakeTokenizer(o.arch.vocab_size));
    VirtualClock clock;
    const int64_t max_context =
        o.scheduler.max_model_len > 0 ? o.scheduler.max_model_len
                                      : (o.arch.max_position > 0 ? o.arch.max_position : 8192);

    SimulationResult out;
    std::vector<int64_t> group_windows;  // empty: one full-attention group
    if (!o.arch.layer_attention.empty()) {
        KV_ASSIGN_OR_RETURN(const kv::KvCacheGroups groups,
                            kv::MakeKvCacheGroups(kv::LayerWindows(o.arch)));
        group_windows = groups.BlockManagerWindows();
    }
    const auto num_groups = std::max<int64_t>(1, static_cast<int64_t>(group_windows.size()));
    std::vector<std::unique_ptr<Instance>> instances;
    int64_t next_gpu = 0;
    for (const PoolConfig& pool : o.pools) {
        PoolUsage usage;
        usage.pool = pool.name;
        usage.role = std::string(PoolRoleName(pool.role));
        for (size_t k = 0; k < pool.instances.size(); ++k) {
            auto inst = std::make_unique<Instance>();
            inst->pool = pool.name;
            inst->tp = pool.instances[k].tp;
            inst->first_gpu = next_gpu;
            next_gpu += inst->tp;
            const std::string name = pool.name + "-" + std::to_string(k);
            Result<CostModel> cost =
                o.profile ? CostModel::CreateWithProfile(o.arch, o.weight_dtype, o.kv_dtype, inst->tp,
                                                      o.device, *o.profile)
                          : CostModel::Create(o.arch, o.weight_dtype, o.kv_dtype, inst->tp, o.device);
            if (!cost.ok()) return Status(cost.status().code(), "pool '" + pool.name + "': " + cost.status().message());
            inst->cost = std::make_unique<CostModel>(std::move(cost).value());
            InstanceEngineConfig c;
            c.name = name;
            c.pool = pool.name;
            c.role = pool.role;
            c.tp = static_cast<int32_t>(inst->tp);
            for (int64_t r = 0; r < inst->tp; ++r)
                c.kv_endpoints.push_back("sim://" + name + "/" + std::to_string(r));
            c.handoff = o.handoff;
            c.scheduler = o.scheduler;
            c.blocks = o.blocks;
            // Sliding-window layers: a table per KV cache group, and blocks of one group's layers,
            // so the planner's all-layer blocks make num_groups times as many
            // (kv/kv_cache_groups.h).
            c.blocks.group_windows = group_windows;
            if (o.blocks.num_blocks <= 0) {
                c.blocks.num_blocks =
                    num_groups * inst->cost->NumKvBlocks(o.blocks.block_size, o.memory_utilization);
            }
            if (c.blocks.num_blocks <= 0) {
                return InvalidArgument("pool '" + pool.name + "': the model's weights leave no room for KV cache on " +
                                       std::to_string(inst->tp) + " x " + o.device.name);
            }
            c.max_context =
                std::min(max_context, c.blocks.num_blocks / num_groups * o.blocks.block_size);
            c.clock = &clock;
            KV_RETURN_IF_ERROR(InstanceEngine::ValidateConfig(c));
            out.kv_blocks_per_instance = c.blocks.num_blocks;
            inst->executor = std::make_unique<ModelledExecutor>();
            inst->engine = std::make_unique<InstanceEngine>(c, *tokenizer, *inst->executor);
            instances.push_back(std::move(inst));
            usage.instances++;
            usage.gpus += pool.instances[k].tp;
        }
        out.pools.push_back(usage);
    }
    out.gpus = next_gpu;
    std::vector<InstanceEngine*> engines;
    for (auto& inst : instances) engines.push_back(inst->engine.get());
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Router> router, Router::Create(engines));

    // Which instance a transfer goes to: the decode instance whose endpoints a KvSendOp names.
    std::unordered_map<std::string, const Instance*> by_endpoint;
    for (auto& inst : instances) {
        for (const std::string& e : inst->engine->config().kv_endpoints) by_endpoint[e] = inst.get();
    }
    const int64_t gpus_per_node = std::max<int64_t>(o.device.gpus_per_node, 1);

    out.run.model = o.arch.path;
    out.run.outcomes.resize(requests.size());
    std::vector<std::shared_ptr<RecordingSink>> sinks(requests.size());
    std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events;
    uint64_t order = 0;
    // The draws of SimulationOptions::profile_spread: one stream per run, from its seed.
    std::mt19937_64 spread_rng(seed ^ 0x5eed5eedULL);
    for (size_t i = 0; i < requests.size(); ++i)
        events.push({requests[i].arrival_s, order++, -1, static_cast<int64_t>(i)});

    double kv_usage_integral = 0, last_time = 0;
    auto sample_usage = [&](double now) {
        if (now <= last_time) return;
        double usage = 0;
        for (auto& inst : instances) usage += inst->engine->Stats().kv_cache_usage;
        usage /= static_cast<double>(instances.size());
        out.kv_usage_max = std::max(out.kv_usage_max, usage);
        kv_usage_integral += usage * (now - last_time);
        last_time = now;
    };

    while (!events.empty()) {
        const Event ev = events.top();
        events.pop();
        // A finished request's timeout is no event: it must not move the clock past the end.
        if (ev.instance == kTimeoutEvent && sinks[static_cast<size_t>(ev.request)]->done())
            continue;
        if (ev.instance >= 0 && ev.request != instances[static_cast<size_t>(ev.instance)]->step_number)
            continue;  // a lengthened step's first end
        sample_usage(ev.time);
        if (ev.time > clock.NowSeconds()) clock.Set(AtSeconds(ev.time));
        if (ev.instance == kTimeoutEvent) {
            // What the HTTP session does at server.request_timeout_s: abort what still runs.
            sinks[static_cast<size_t>(ev.request)]->MarkTimedOut();
            out.num_timed_out++;
            router->Abort("sim-" + std::to_string(ev.request));
        } else if (ev.instance < 0) {
            const SimRequest& sr = requests[static_cast<size_t>(ev.request)];
            // The front end's CPU work for the request shares the cores with the steps in flight
            // (a CPU profile's f, fitted on steps that requests arrived during): they end later.
            if (o.profile && o.profile->f > 0) {
                for (size_t i = 0; i < instances.size(); ++i) {
                    Instance& inst = *instances[i];
                    if (!inst.plan) continue;
                    inst.step_end_s += o.profile->f;
                    inst.busy_s += o.profile->f;
                    inst.result.compute_seconds += o.profile->f;
                    events.push({inst.step_end_s, order++, static_cast<int64_t>(i),
                                 ++inst.step_number});
                }
            }
            GenerationRequest req;
            req.request_id = "sim-" + std::to_string(ev.request);
            // Each request draws its own tokens; a prefix group's first prefix_len are shared.
            req.prompt_token_ids =
                PromptTokens(sr, o.arch.vocab_size, seed * 1'000'003 + static_cast<uint64_t>(ev.request));
            req.max_tokens = sr.output_len;
            req.ignore_eos = true;
            // The group's shared prefix marked for caching, as a client marks a system prompt.
            if (o.cache_ttl_ms > 0 && sr.prefix_group >= 0 && sr.prefix_len > 0)
                req.cache_breakpoints.push_back({sr.prefix_len, o.cache_ttl_ms});
            auto sink = std::make_shared<RecordingSink>(clock, &out.run.outcomes[static_cast<size_t>(ev.request)]);
            sinks[static_cast<size_t>(ev.request)] = sink;
            const Status st = router->Submit(std::move(req), sink);
            if (st.ok() && o.request_timeout_s > 0) {
                events.push({ev.time + o.request_timeout_s, order++, kTimeoutEvent, ev.request});
            }
            if (!st.ok()) {
                loadgen::RequestOutcome& oc = out.run.outcomes[static_cast<size_t>(ev.request)];
                oc.ok = false;
                if (st.code() == StatusCode::kResourceExhausted) {
                    // The server answers this with HTTP 429: the client sees a refusal at once.
                    out.num_refused++;
                    oc.error = "refused (429): " + st.message();
                } else {
                    oc.error = st.message();
                }
            }
        } else {
            Instance& inst = *instances[static_cast<size_t>(ev.instance)];
            StepPlan plan = std::move(*inst.plan);
            inst.plan.reset();
            inst.engine->CompleteStep(plan, std::move(inst.result));
        }
        // Every idle instance with work starts its next step now.
        for (size_t i = 0; i < instances.size(); ++i) {
            Instance& inst = *instances[i];
            if (inst.plan || !inst.engine->HasWork()) continue;
            std::optional<StepPlan> plan = inst.engine->PlanStep();
            if (!plan) continue;  // nothing fits until something finishes elsewhere
            // A step's KV sends go to one decode instance each; the link is that of the first.
            Link link = Link::kIntraNode;
            for (const KvSendOp& op : plan->kv_sends) {
                const Instance* dst =
                    op.dst_endpoints.empty() ? nullptr : by_endpoint[op.dst_endpoints[0]];
                if (dst != nullptr &&
                    dst->first_gpu / gpus_per_node != inst.first_gpu / gpus_per_node)
                    link = Link::kNetwork;
                out.num_handoffs++;
                out.handoff_bytes += op.num_tokens * inst.cost->KvBytesPerToken();
            }
            // Layerwise sends overlap the forward pass, blockwise ones follow it (CostModel).
            int64_t prefill_tokens = 0, decode_seqs = 0;
            for (const ScheduledSequence& s : plan->sequences) {
                const auto q = static_cast<int64_t>(s.token_ids.size());
                if (q == 1 && s.start_pos > 0) {
                    ++decode_seqs;
                } else {
                    prefill_tokens += q;
                }
            }
            inst.decodes_since_prefill =
                NextDecodesSincePrefill(prefill_tokens, decode_seqs, inst.decodes_since_prefill);
            const StepCost cost =
                inst.cost->Cost(*plan, link, inst.previous_seq_ids, inst.decodes_since_prefill);
            double seconds = cost.total_s;
            if (o.profile_spread && o.profile && cost.kind == StepKind::kDecode) {
                const std::vector<double>& spread =
                    o.profile->kind_spread[static_cast<int>(cost.kind)];
                if (!spread.empty()) seconds *= spread[spread_rng() % spread.size()];
            }
            inst.previous_seq_ids.clear();
            for (const ScheduledSequence& s : plan->sequences)
                inst.previous_seq_ids.push_back(s.seq_id);
            std::sort(inst.previous_seq_ids.begin(), inst.previous_seq_ids.end());
            inst.result = ModelledExecutor::ModelStep(*plan, inst.cost->KvBytesPerToken());
            inst.result.compute_seconds = seconds;
            inst.plan = std::move(plan);
            inst.busy_s += seconds;
            inst.steps++;
            out.num_steps++;
            inst.step_end_s = clock.NowSeconds() + seconds;
            events.push({inst.step_end_s, order++, static_cast<int64_t>(i), ++inst.step_number});
        }
        int64_t queued = 0, pinned = 0;
        for (auto& inst : instances) {
            const EngineStats s = inst->engine->Stats();
            queued += s.num_waiting;
            pinned += s.pinned_blocks;
        }
        out.max_queued = std::max(out.max_queued, queued);
        out.pinned_blocks_max = std::max(out.pinned_blocks_max, pinned);
    }
    out.simulated_seconds = clock.NowSeconds();
    for (auto& inst : instances) {
        if (inst->engine->HasWork()) {
            spdlog::warn("simulation ended with work left on {} (a request that never fits)",
                         inst->engine->config().name);
        }
        const EngineStats s = inst->engine->Stats();
        out.num_preemptions += s.num_preemptions;
        out.pin_hits += s.pin_hits_total;
        out.pins_expired += s.pins_expired_total;
        out.pins_refused += s.pins_refused_total;
        for (PoolUsage& p : out.pools) {
            if (p.pool != inst->pool) continue;
            p.steps += inst->steps;
            p.busy_fraction += inst->busy_s;
        }
    }
    for (PoolUsage& p : out.pools) {
        p.busy_fraction = out.simulated_seconds > 0 && p.instances > 0
                              ? p.busy_fraction / (out.simulated_seconds * double(p.instances))
                              : 0;
    }
    out.kv_usage_mean = out.simulated_seconds > 0 ? kv_usage_integral / out.simulated_seconds : 0;
    double first = 0;
    if (!requests.empty()) first = requests.front().arrival_s;
    for (const SimRequest& r : requests) first = std::min(first, r.arrival_s);
    out.run.duration_s = out.simulated_seconds - first;
    for (size_t i = 0; i < out.run.outcomes.size(); ++i) {
        loadgen::RequestOutcome& oc = out.run.outcomes[i];
        oc.start_s -= first;
        // The front end: before the engine and after its first token. A refused request (no
        // token) is answered at once and keeps its times.
        if (oc.ttft_s > 0) {
            const double frontend_s =
                o.frontend_s +
                o.frontend_per_prompt_token_s * static_cast<double>(requests[i].prompt_len);
            oc.ttft_s += frontend_s;
            oc.e2e_s += frontend_s;
        }
    }
    for (auto& inst : instances) inst->engine->Stop();
    out.wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
    return out;
}

}  // namespace kvshard::sim
