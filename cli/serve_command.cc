// `kvshard serve`: the coordinator (HTTP front end, router, one engine thread per instance) and
// the instances of every configured pool — their tensor-parallel workers as threads of this
// process (workers.mode: embedded) or as `kvshard worker` processes (workers.mode: processes).
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cli/commands.h"
#include "cli/kv_pair_replan.h"
#include "cli/load_progress.h"
#include "cli/process_instance.h"
#include "cli/serve_devices.h"
#include "common/build_config.h"
#include "common/device.h"
#include "common/device_peer.h"
#include "common/logging.h"
#include "config/device_plan.h"
#include "config/server_config.h"
#include "coordinator/api_service.h"
#include "coordinator/engine.h"
#include "coordinator/http_server.h"
#include "coordinator/router.h"
#include "coordinator/step_log.h"
#include "kv/kv_cache_groups.h"
#include "model/chat_template.h"
#include "model/hf_export.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "worker/kv_handoff_path.h"
#include "worker/kv_peer_exchange.h"
#include "worker/local_model.h"
#include "worker/tp_group.h"
#include "worker/weights.h"

namespace kvshard::cli {
namespace {

struct ServeFlags {
    std::string config;
    std::vector<ConfigOverride> overrides;
    // Flag values, turned into overrides when given.
    std::string model, tokenizer, host, chat_template, log_level, backend, cuda_graphs;
    int port = -1, tp = 0, threads = -1;
    // vLLM's spellings of common settings.
    std::vector<std::string> served_model_names, api_keys;
    std::string max_model_len, kv_cache_dtype;
    std::vector<std::string> sets;  // --set key=value
    std::string step_log;           // --step-log FILE (coordinator/step_log.h)
    // --stage-collectives: every tp > 1 instance stages its all-reduces through host copies
    // (worker/rank_collective.h), as ranks sharing a GPU do; on the CPU, how that path is tested.
    bool stage_collectives = false;
};

// A list flag's values as one override value (config/server_config.h: comma-separated), or the
// error naming the flag when a value holds the separator.
Result<std::string> JoinListFlag(const std::vector<std::string>& values, const std::string& flag) {
    std::string joined;
    for (const std::string& v : values) {
        if (v.find(',') != std::string::npos) {
            return InvalidArgument(flag + ": invalid value '" + v + "': must not contain ','");
        }
        joined += (joined.empty() ? "" : ",") + v;
    }
    return joined;
}

// kv_cache.dtype "auto" is the model's compute dtype: fp32 on both backends' pools.
KvDtype KvDtypeOf(const ServerConfig& c) { return c.kv_cache.dtype.value_or(KvDtype::kFp32); }

// Blocks that memory_mib holds on the worker with the most KV heads.
int64_t BlocksFor(const ServerConfig& c, const ModelSpec& s, int tp) {
    if (c.kv_cache.num_blocks > 0) return c.kv_cache.num_blocks;
    const int64_t bytes_per_block = KvBlockBytes(s, KvDtypeOf(c), c.kv_cache.block_size, tp);
    return std::max<int64_t>(1, (c.kv_cache.memory_mib << 20) / bytes_per_block);
}

// One instance of a pool: its workers (threads of this process, or worker processes) and engine.
// Members in destruction order: the engine stops before its executor goes away.
struct ServedInstance {
    std::string name;
    std::unique_ptr<TpGroup> group;
    std::unique_ptr<ProcessInstance> process;
    std::unique_ptr<StepLogExecutor> step_logger;  // with --step-log: wraps group or process
    std::unique_ptr<InstanceEngine> engine;
};

// SIGTERM/SIGINT: stop admitting (503 with Retry-After, /health "draining"), let requests in
// flight finish for up to `drain_timeout_s`, then stop the engines (what is left ends with an
// error event and [DONE]), give those answers a moment to be written, and exit 0. A second
// signal meanwhile exits at once.
int Drain(HttpServer& server, const std::function<void()>& stop_engines, const sigset_t& signals,
          int sig, double drain_timeout_s) {
    spdlog::info(
        "signal {}: draining: {} requests in flight, waiting up to {} s (a second signal "
        "exits at once)",
        sig, server.num_in_flight(), drain_timeout_s);
    server.BeginDrain();
    std::thread second([signals] {
        int again = 0;
        sigwait(&signals, &again);
        spdlog::warn("signal {} while draining: exiting now", again);
        spdlog::default_logger()->flush();
        std::_Exit(128 + again);
    });
    second.detach();
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(drain_timeout_s * 1000));
    if (!server.WaitIdle(timeout)) {
        spdlog::warn("drain: {} requests still running after {} s; ending them",
                     server.num_in_flight(), drain_timeout_s);
    }
    stop_engines();
    if (!server.WaitIdle(std::chrono::seconds(2)))
        spdlog::warn("drain: {} answers not fully written; closing", server.num_in_flight());
    server.Stop();
    spdlog::info("drained; stopping the workers");
    return 0;
}

int RunServe(ServeFlags f) {
    auto add = [&](const std::string& key, const std::string& value, const std::string& flag) {
        f.overrides.push_back({key, value, flag});
    };
    if (!f.model.empty()) add("model", f.model, "--model");
    if (!f.tokenizer.empty()) add("tokenizer", f.tokenizer, "--tokenizer");
    if (!f.host.empty()) add("server.host", f.host, "--host");
    if (f.port >= 0) add("server.port", std::to_string(f.port), "--port");
    if (f.tp > 0) add("tp", std::to_string(f.tp), "--tp");
    if (f.threads >= 0) add("threads", std::to_string(f.threads), "--threads");
    if (!f.chat_template.empty()) add("chat_template", f.chat_template, "--chat-template");
    if (!f.log_level.empty()) add("log_level", f.log_level, "--log-level");
    if (!f.backend.empty()) add("backend", f.backend, "--backend");
    if (!f.cuda_graphs.empty()) add("cuda_graphs", f.cuda_graphs, "--cuda-graphs");
    if (!f.max_model_len.empty())
        add("scheduler.max_model_len", f.max_model_len, "--max-model-len");
    if (!f.kv_cache_dtype.empty()) {
        // ParseKvDtype takes vLLM's fp8_e4m3 for kvshard's fp8 as well.
        add("kv_cache.dtype", f.kv_cache_dtype, "--kv-cache-dtype");
    }
    for (const auto& [values, key, flag] :
         {std::tuple{&f.served_model_names, "served_model_name", "--served-model-name"},
          std::tuple{&f.api_keys, "server.api_keys", "--api-key"}}) {
        if (values->empty()) continue;
        Result<std::string> joined = JoinListFlag(*values, flag);
        if (!joined.ok()) return Fail(joined.status().message());
        add(key, *joined, flag);
    }
    for (const std::string& kv : f.sets) {
        const size_t eq = kv.find('=');
        if (eq == std::string::npos || eq == 0)
            return Fail("--set " + kv + ": expected KEY=VALUE, e.g. workers.mode=processes");
        add(kv.substr(0, eq), kv.substr(eq + 1), "--set " + kv.substr(0, eq));
    }
    Result<ServerConfig> cr = LoadServerConfig(f.config, f.overrides);
    if (!cr.ok()) return Fail(cr.status().message());
    const ServerConfig& c = *cr;
    InitLogging("coordinator", c.log_level);
    std::unique_ptr<StepLog> step_log;  // outlives the instances that write to it
    if (!f.step_log.empty()) {
        Result<std::unique_ptr<StepLog>> opened = StepLog::Open(f.step_log);
        if (!opened.ok()) return Fail(opened.status().message());
        step_log = std::move(*opened);
    }
    // Before the model is opened: a backend that needs a device this machine lacks
    // (cli/serve_devices.h).
    const std::string source = c.source.empty() ? std::string() : c.source + ": ";
    const DeviceQuery devices = c.backend == ServeBackend::kCpu ? DeviceQuery{} : QueryDevices();
    if (Result<bool> r = ResolveCudaBackend(c.backend, KVSHARD_WITH_CUDA != 0,
                                            static_cast<int>(devices.devices.size()), devices.error);
        !r.ok()) {
        return Fail(source + r.status().message());
    }

    const auto load_start = std::chrono::steady_clock::now();
    OpenModelOptions open;
    open.tokenizer_path = c.tokenizer_path;
    Result<std::unique_ptr<ModelFile>> model = OpenModel(c.model_path, open);
    if (!model.ok()) return Fail(model.status().message());
    const ModelSpec& spec = (*model)->spec();
    // How the layers share KV blocks (sliding windows): the engines keep a table per group.
    Result<kv::KvCacheGroups> kv_groups = kv::MakeKvCacheGroups(kv::LayerWindows(spec));
    if (!kv_groups.ok()) return Fail(c.model_path + ": " + kv_groups.status().message());
    const std::vector<int64_t> kv_group_windows = kv_groups->BlockManagerWindows();
    Result<std::unique_ptr<Tokenizer>> tokenizer =
        Tokenizer::Create((*model)->shared_tokenizer_data());
    if (!tokenizer.ok()) return Fail(c.model_path + ": " + tokenizer.status().message());
    Result<std::optional<ChatTemplate>> chat = ResolveChatTemplate(
        spec.chat_template, c.chat_template, ChatTemplateTokensOf((*model)->tokenizer_data()),
        spec.architecture);
    if (!chat.ok()) return Fail(chat.status().message());

    const int64_t max_context = c.scheduler.max_model_len > 0 ? c.scheduler.max_model_len
                                : spec.max_position > 0       ? spec.max_position
                                                              : 4096;
    LocalModel stop_ids_of{
        .file = std::move(*model), .tokenizer = std::move(*tokenizer), .runner = nullptr};
    std::vector<int32_t> stop_token_ids = stop_ids_of.StopTokenIds();
    if (chat->has_value()) {
        const int32_t eot = stop_ids_of.tokenizer->PieceToId((*chat)->end_of_turn());
        if (eot >= 0 &&
            std::find(stop_token_ids.begin(), stop_token_ids.end(), eot) == stop_token_ids.end()) {
            stop_token_ids.push_back(eot);
        }
    }
    const std::string served_name = c.served_model_names.empty()
                                        ? std::filesystem::path(c.model_path).filename().string()
                                        : c.served_model_names[0];
    auto metrics = std::make_shared<ServerMetrics>(
        served_name, ServerMetricsOptions{max_context, c.http.metrics_vllm_names});

    // One executor and one engine per instance of every pool.
    const std::vector<PoolConfig> pools = c.EffectivePools();
    int total_workers = 0;
    for (const PoolConfig& p : pools) {
        for (const InstanceConfig& i : p.instances) total_workers += i.tp;
    }
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int threads_per_worker = c.threads > 0 ? c.threads : std::max(1, hw / total_workers);
    // Instances whose supervisor gave up re-forming their workers (process mode).
    std::atomic<int> num_gave_up{0};
    std::shared_ptr<WorkerRegistry> registry;
    if (c.workers.mode == WorkersMode::kProcesses) {
        Result<std::unique_ptr<WorkerRegistry>> r = WorkerRegistry::Start(RegistryOptionsFrom(c));
        if (!r.ok()) return Fail(c.source + ": workers: " + r.status().message());
        registry = std::move(*r);
    }
    // Every instance of the config first, so that in process mode all of them are declared to
    // the registry before any formation waits: their workers may then register in any order
    // (on Kubernetes a later instance's pod may well start first).
    struct PlannedInstance {
        std::string name;
        const PoolConfig* pool = nullptr;
        const InstanceConfig* config = nullptr;
        RunnerOptions runner;
        std::vector<int> gpus;  // each rank's GPU (cuda); empty on the CPU
    };
    std::vector<PlannedInstance> planned;
    for (const PoolConfig& pool : pools) {
        for (size_t k = 0; k < pool.instances.size(); ++k) {
            PlannedInstance pi;
            pi.pool = &pool;
            pi.config = &pool.instances[k];
            pi.name = pool.instances.size() == 1 ? pool.name : pool.name + "-" + std::to_string(k);
            pi.runner.max_context = max_context;
            pi.runner.block_size = c.kv_cache.block_size;
            pi.runner.num_kv_blocks = BlocksFor(c, spec, pi.config->tp);
            pi.runner.kv_storage = KvDtypeOf(c);
            pi.runner.weight_format =
                c.weight_format == "f32" ? WeightFormat::kF32 : WeightFormat::kStored;
            pi.runner.max_step_tokens = c.scheduler.max_num_batched_tokens;
            pi.runner.max_step_seqs = c.scheduler.max_num_seqs;
            pi.runner.cuda_graphs = c.cuda_graphs;
            planned.push_back(std::move(pi));
        }
    }
    // Every rank on its device, before any weight is read (the CPU: warnings only), and how the
    // KV of a handoff travels between the pools (worker/kv_handoff_path.h).
    std::optional<KvHandoffPath> handoff_path;
    KvPairLink pair_link = KvPairLink::kSocket;  // the pair path's link (handoff_path kNccl)
    if (!planned.empty()) {
        Result<DevicePlan> dp =
            PlanServeDevices(c, pools, *stop_ids_of.file, planned[0].runner, max_context,
                             KVSHARD_WITH_CUDA != 0, devices, f.stage_collectives);
        if (!dp.ok()) return Fail(source + dp.status().message());
        for (const std::string& w : dp->warnings) spdlog::warn("{}", w);
        Result<bool> socket_pairs = SocketPairLinkFromEnvironment();
        if (!socket_pairs.ok()) return Fail(socket_pairs.status().message());
        Result<std::optional<KvHandoffPath>> path =
            ServeKvHandoffPath(c, pools, *dp, DevicesCanAccessPeer, *socket_pairs);
        if (!path.ok()) return Fail(source + path.status().message());
        handoff_path = *path;
        if (handoff_path.has_value()) dp->kv_handoff = KvHandoffPathLine(*handoff_path);
        if (handoff_path == KvHandoffPath::kNccl) {
            pair_link = *socket_pairs ? KvPairLink::kSocket : KvPairLink::kNccl;
            dp->kv_handoff += "; " + KvPairLinkNote(pair_link);
            if (pair_link == KvPairLink::kNccl) spdlog::warn("{}", KvPairLinkNote(pair_link));
        }
        for (const std::string& line : dp->Describe(pools)) spdlog::info("device plan: {}", line);
        size_t k = 0;
        for (size_t p = 0; p < pools.size(); ++p) {
            for (size_t i = 0; i < pools[p].instances.size(); ++i, ++k) {
                ApplyDevicePlan(*dp, static_cast<int>(p), static_cast<int>(i), &planned[k].runner);
                planned[k].gpus = RankGpus(*dp, static_cast<int>(p), static_cast<int>(i));
            }
        }
    }
    // The peer-copy handoff's exchange, shared by every instance of this process.
    std::shared_ptr<KvPeerExchange> peer_exchange;
    if (handoff_path == KvHandoffPath::kPeerCopy)
        peer_exchange = std::make_shared<KvPeerExchange>();
    // Embedded workers report their weights as they load (worker processes log their own).
    int64_t weight_bytes = 0;
    if (c.workers.mode == WorkersMode::kEmbedded) {
        for (const PlannedInstance& pi : planned) {
            for (int rank = 0; rank < pi.config->tp; ++rank) {
                Result<int64_t> bytes =
                    ResidentWeightBytes(*stop_ids_of.file, pi.runner.backend.kind,
                                        {.shard = {.rank = rank, .tp = pi.config->tp},
                                         .format = pi.runner.weight_format});
                if (!bytes.ok()) return Fail(bytes.status().message());
                weight_bytes += *bytes;
            }
        }
    }
    LoadProgress progress(weight_bytes, load_start);
    if (c.workers.mode == WorkersMode::kEmbedded) {
        for (PlannedInstance& pi : planned) {
            pi.runner.on_weight_bytes_loaded = [&progress](int64_t bytes) { progress.Add(bytes); };
        }
    }
    // The KV pair path: every rank's pairs, handed out at registration and re-planned when an
    // instance re-forms. Declared before the instances: their supervisors use it until the
    // guard below detaches it.
    std::unique_ptr<KvPairPlan> pair_plan;
    std::vector<ServedInstance> instances(planned.size());
    struct DetachPairPlan {
        KvPairPlan* plan = nullptr;
        ~DetachPairPlan() {
            if (plan != nullptr) plan->Detach();
        }
    } detach_pair_plan;  // destroyed before the instances (and set before their supervisors)
    if (c.workers.mode == WorkersMode::kProcesses) {
        if (handoff_path == KvHandoffPath::kNccl) {
            std::vector<KvPairInstance> pair_instances;
            for (const PlannedInstance& pi : planned)
                pair_instances.push_back({pi.name, pi.config->tp, pi.pool->role});
            Result<std::unique_ptr<KvPairPlan>> made = KvPairPlan::Create(
                spec, pair_instances, pair_link, "127.0.0.1", c.kv_transfer.timeout_ms);
            if (!made.ok()) return Fail(source + made.status().message());
            pair_plan = std::move(*made);
            detach_pair_plan.plan = pair_plan.get();
            pair_plan->SetOnReplanned([m = metrics.get()] { m->OnKvPairsReplanned(); });
        }
        std::vector<ProcessInstanceSpec> specs;
        for (const PlannedInstance& pi : planned) {
            ProcessInstanceSpec ps;
            ps.instance_id = pi.name;
            ps.tp = pi.config->tp;
            ps.devices = pi.config->devices;
            // The plan's GPUs (also where the config gave none), so that ranks on GPUs of their
            // own get an NCCL unique id.
            if (!pi.gpus.empty()) ps.devices.clear();
            for (int gpu : pi.gpus) ps.devices.push_back(std::to_string(gpu));
            ps.model_path = c.model_path;
            ps.worker.runner = pi.runner;
            ps.worker.devices = pi.gpus;
            ps.worker.force_staged_collective = f.stage_collectives;
            ps.worker.tokenizer_path = c.tokenizer_path;
            ps.worker.threads = c.threads > 0 ? c.threads : threads_per_worker;
            ps.on_gave_up = [&num_gave_up](const Status&) { num_gave_up++; };
            if (pair_plan != nullptr) {
                ps.rank_settings = pair_plan->RankSettings(specs.size());
                ps.before_relaunch = [plan = pair_plan.get(), name = pi.name] {
                    (void)plan->Replan(name);  // its error is logged, naming kv_transfer.path
                };
            }
            specs.push_back(std::move(ps));
        }
        Result<std::vector<DeclaredProcessInstance>> declared =
            DeclareProcessInstances(c, specs, registry);
        if (!declared.ok()) return Fail(declared.status().message());
        if (pair_plan != nullptr) {
            for (size_t i = 0; i < declared->size(); ++i)
                pair_plan->SetExecutor(i, (*declared)[i].executor.get());
        }
        Result<std::vector<std::unique_ptr<ProcessInstance>>> formed =
            FormProcessInstances(c, specs, std::move(*declared));
        if (!formed.ok()) return Fail(formed.status().message());
        for (size_t i = 0; i < planned.size(); ++i) instances[i].process = std::move((*formed)[i]);
    }
    for (size_t i = 0; i < planned.size(); ++i) {
        const PlannedInstance& pi = planned[i];
        const PoolConfig& pool = *pi.pool;
        const InstanceConfig& ic = *pi.config;
        ServedInstance& inst = instances[i];
        inst.name = pi.name;
        std::vector<std::string> endpoints;
        if (inst.process != nullptr) {
            endpoints = inst.process->executor().kv_endpoints();
        } else {
            TpGroupConfig tc;
            tc.tp = ic.tp;
            tc.threads_per_rank = threads_per_worker;
            tc.runner = pi.runner;
            tc.devices = pi.gpus;
            tc.force_staged = f.stage_collectives;
            tc.kv_transport_name = inst.name;
            tc.peer_exchange = peer_exchange;
            Result<std::unique_ptr<TpGroup>> group = TpGroup::Create(*stop_ids_of.file, tc);
            if (!group.ok())
                return Fail(c.model_path + ": instance " + inst.name + ": " +
                            group.status().message());
            inst.group = std::move(*group);
            endpoints = inst.group->kv_endpoints();
        }
        InstanceEngineConfig ec;
        ec.name = inst.name;
        ec.pool = pool.name;
        ec.role = pool.role;
        ec.tp = ic.tp;
        ec.kv_endpoints = endpoints;
        ec.observer = metrics.get();
        // A pair set a worker reports down is re-planned (cli/kv_pair_replan.h).
        if (inst.process != nullptr) ec.pair_health = pair_plan.get();
        // The file's sections as they are (config/engine_config.h); the block manager's with
        // what serve resolved: the pool's size, and one block table per KV cache group, as the
        // workers' pools hold them.
        ec.scheduler = c.scheduler;
        ec.handoff = c.kv_transfer;
        ec.blocks = c.kv_cache;
        ec.blocks.num_blocks = pi.runner.num_kv_blocks;
        ec.blocks.group_windows = kv_group_windows;
        ec.max_context = max_context;
        ec.stop_token_ids = stop_token_ids;
        if (Status st = InstanceEngine::ValidateConfig(ec); !st.ok())
            return Fail(c.source + ": " + st.message());
        StepExecutor& executor = inst.group != nullptr ? static_cast<StepExecutor&>(*inst.group)
                                                       : inst.process->executor();
        if (step_log != nullptr) {
            inst.step_logger = std::make_unique<StepLogExecutor>(executor, *step_log, inst.name);
        }
        inst.engine = std::make_unique<InstanceEngine>(
            ec, *stop_ids_of.tokenizer, inst.step_logger != nullptr ? *inst.step_logger : executor);
        inst.engine->Start();
        spdlog::info("instance {} ({} pool {}): tp {}, {} KV blocks of {} tokens, {} workers on {}",
                     inst.name, PoolRoleName(ec.role), pool.name, ic.tp, pi.runner.num_kv_blocks,
                     c.kv_cache.block_size, WorkersModeName(c.workers.mode),
                     pi.runner.backend.kind == BackendKind::kCuda
                         ? "GPU " + std::to_string(pi.runner.backend.device)
                         : std::string("the CPU"));
    }
    progress.Finish();
    std::vector<InstanceEngine*> engines;
    for (ServedInstance& i : instances) engines.push_back(i.engine.get());
    Result<std::unique_ptr<Router>> router = Router::Create(engines);
    if (!router.ok()) return Fail(c.source + ": pools: " + router.status().message());
    // The pair path's re-plans read the router's next transfer id (cli/kv_pair_replan.h); the
    // guard lets go of the router before it is destroyed.
    struct ForgetRouter {
        KvPairPlan* plan = nullptr;
        ~ForgetRouter() {
            if (plan != nullptr) plan->SetTransferFence(nullptr);
        }
    } forget_router;
    if (pair_plan != nullptr) {
        pair_plan->SetTransferFence([r = router->get()](const std::function<void(uint64_t)>& tell) {
            r->WithTransferNumberingPaused(tell);
        });
        forget_router.plan = pair_plan.get();
    }
    Engine& engine =
        engines.size() == 1 ? static_cast<Engine&>(*engines[0]) : static_cast<Engine&>(**router);
    auto stop_all = [&] {
        for (ServedInstance& i : instances) i.engine->Stop();
    };

    ApiServiceOptions ao;
    ao.model.name = served_name;
    if (c.served_model_names.size() > 1) {
        ao.model.aliases.assign(c.served_model_names.begin() + 1, c.served_model_names.end());
    }
    HfTokenizerFiles tokenizer_files = HfTokenizerFilesOf(*stop_ids_of.file);
    ao.tokenizer_json = std::move(tokenizer_files.tokenizer_json);
    ao.tokenizer_config_json = std::move(tokenizer_files.tokenizer_config_json);
    ao.model.path = c.model_path;
    ao.model.vocab_size = spec.vocab_size;
    ao.chat_template = *chat;
    ao.http = c.http;
    ApiService api(engine, *stop_ids_of.tokenizer, metrics, ao);

    // Block SIGINT/SIGTERM in every thread started from here on; this thread waits for them.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    Result<std::unique_ptr<HttpServer>> server = HttpServer::Start(c.http, api);
    if (!server.ok()) {
        stop_all();
        return Fail(server.status().message());
    }
    spdlog::info("serving {} as '{}' on http://{}:{} ({} instance(s), context {})", c.model_path,
                 ao.model.name, c.http.host, (*server)->port(), instances.size(), max_context);
    std::fprintf(stderr, "kvshard: listening on http://%s:%d\n", c.http.host.c_str(),
                 (*server)->port());
    // Waits for a signal; meanwhile, when workers that were given up on leave nothing that can
    // serve, exits non-zero so that a supervisor (systemd, Kubernetes) restarts the server.
    for (;;) {
        timespec tick{0, 200'000'000};
        const int sig = sigtimedwait(&signals, nullptr, &tick);
        if (sig > 0) return Drain(**server, stop_all, signals, sig, c.http.drain_timeout_s);
        if (num_gave_up.load() > 0 && !engine.Health().ok()) {
            spdlog::error(
                "no instance can serve and their workers will not be restarted "
                "(workers.restart_limit {}): exiting",
                c.workers.restart_limit);
            (*server)->BeginDrain();
            stop_all();
            (*server)->WaitIdle(std::chrono::seconds(2));
            (*server)->Stop();
            return 3;
        }
    }
}

}  // namespace

Command RegisterServe(CLI::App& app) {
    auto f = std::make_shared<ServeFlags>();
    CLI::App* sub = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
    sub->add_option("--config", f->config, "YAML config file (docs/config.md)");
    sub->add_option("--model", f->model,
                    "A .gguf file, a Hugging Face directory or a llama2.c .bin");
    sub->add_option("--tokenizer", f->tokenizer,
                    "llama2.c tokenizer.bin (default: found beside --model)");
    sub->add_option("--tp", f->tp, "Tensor-parallel worker threads");
    sub->add_option("--host", f->host, "Address to bind (default 127.0.0.1)");
    sub->add_option("--port", f->port, "Port (default 8000; 0 picks a free one)");
    sub->add_option("--threads", f->threads, "CPU threads per worker (0: cores / tp)");
    sub->add_option("--chat-template", f->chat_template,
                    "chatml, llama2, llama3, gemma, jinja (the model's template, interpreted) "
                    "or a Jinja template file");
    sub->add_option("--log-level", f->log_level, "trace|debug|info|warn|error|off");
    sub->add_option("--backend", f->backend,
                    "Where the workers run: cpu, cuda (a GPU per rank unless devices repeat "
                    "one) or auto");
    sub->add_option("--cuda-graphs", f->cuda_graphs,
                    "Decode steps as CUDA graphs (cuda_graphs): true or false (default)");
    sub->add_option("--max-model-len", f->max_model_len,
                    "Context length in tokens (scheduler.max_model_len; default: the model's)");
    sub->add_option(
        "--kv-cache-dtype,--kv-dtype", f->kv_cache_dtype,
        "KV cache element type (kv_cache.dtype): auto, fp32, bf16, fp16, int8 or fp8 "
        "(E4M3)");
    for (CLI::Option* o : sub->get_options())
        o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    sub->add_flag("--stage-collectives", f->stage_collectives,
                  "tp > 1: all-reduce through host copies of the ranks' buffers even where NCCL "
                  "or the host buffers themselves could be used (the path of ranks sharing a "
                  "GPU)");
    sub->add_option("--served-model-name", f->served_model_names,
                    "The names clients send as \"model\" (served_model_name); the first is the "
                    "one answers carry. Default: the model file's name")
        ->expected(1, CLI::detail::expected_max_vector_size);
    sub->add_option("--api-key", f->api_keys,
                    "Require Authorization: Bearer KEY (server.api_keys; repeatable)");
    sub->add_option("--set", f->sets,
                    "KEY=VALUE: any scalar setting of the config file (repeatable), e.g. "
                    "workers.mode=processes");
    sub->add_option("--step-log", f->step_log,
                    "Write one JSON line per serving step here (a CPU profile for kvshard "
                    "simulate --profile; docs/simulate.md)");
    return [f] { return RunServe(*f); };
}

}  // namespace kvshard::cli
