#include "cli/process_instance.h"

#include <algorithm>
#include <charconv>
#include <mutex>
#include <set>
#include <thread>

#include "common/build_config.h"
#include "common/check.h"
#include "common/logging.h"
#include "config/collective_path.h"

namespace kvshard::cli {

namespace {

constexpr int64_t kMaxRestartBackoffMs = 30'000;
// How often the supervisor looks at the executor's health and the launched processes: the
// executor notices a dead channel itself; this only bounds how late the supervisor reacts.
constexpr int64_t kSupervisePollMs = 20;

int64_t BackoffMs(int64_t first_ms, int failed_attempts) {
    int64_t ms = std::max<int64_t>(first_ms, 0);
    for (int i = 0; i < failed_attempts && ms < kMaxRestartBackoffMs; ++i) ms *= 2;
    return std::min(ms, kMaxRestartBackoffMs);
}

}  // namespace

WorkerRegistryOptions RegistryOptionsFrom(const ServerConfig& config) {
    WorkerRegistryOptions o;
    o.host = config.workers.host;
    o.port = static_cast<uint16_t>(config.workers.port);
    o.token = config.workers.token;
    o.channel.heartbeat_interval_ms = config.workers.heartbeat_interval_ms;
    o.channel.dead_after_ms = config.workers.dead_after_ms;
    return o;
}

ProcessInstance::ProcessInstance(std::shared_ptr<WorkerRegistry> registry,
                                 std::unique_ptr<RemoteStepExecutor> executor,
                                 std::unique_ptr<WorkerLauncher> launcher,
                                 ProcessInstanceOptions options)
    : registry_(std::move(registry)),
      executor_(std::move(executor)),
      options_(std::move(options)),
      launcher_(std::move(launcher)) {}

ProcessInstance::~ProcessInstance() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
    }
    stop_cv_.notify_all();
    if (supervisor_.joinable()) supervisor_.join();
    executor_->Shutdown("the coordinator is shutting the instance down");
    std::unique_ptr<WorkerLauncher> launcher;
    {
        std::lock_guard<std::mutex> lock(mu_);
        launcher = std::move(launcher_);
    }
    if (launcher != nullptr) {
        launcher->WaitForExit(std::chrono::milliseconds(options_.shutdown_wait_ms));
        launcher.reset();  // SIGTERM/SIGKILL whatever did not exit
    }
    executor_.reset();
}

void ProcessInstance::StartSupervisor() {
    supervisor_ = std::thread([this] { Supervise(); });
}

std::vector<pid_t> ProcessInstance::worker_pids() const {
    std::lock_guard<std::mutex> lock(mu_);
    return launcher_ != nullptr ? launcher_->pids() : std::vector<pid_t>{};
}

Status ProcessInstance::last_failure() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_failure_;
}

bool ProcessInstance::stopping() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stopping_;
}

bool ProcessInstance::WaitStopping(int64_t ms) {
    std::unique_lock<std::mutex> lock(mu_);
    return stop_cv_.wait_for(lock, std::chrono::milliseconds(ms), [&] { return stopping_; });
}

Status ProcessInstance::CheckLaunched() {
    std::lock_guard<std::mutex> lock(mu_);
    return launcher_ != nullptr ? launcher_->CheckExited() : Status::Ok();
}

void ProcessInstance::KillLaunched() {
    std::unique_ptr<WorkerLauncher> old;
    {
        std::lock_guard<std::mutex> lock(mu_);
        old = std::move(launcher_);
    }
    if (old != nullptr) old->Kill();
}

void ProcessInstance::Supervise() {
    const std::string who = "instance " + executor_->instance_id();
    int failed_attempts = 0;  // in a row
    for (;;) {
        // Watch until something fails.
        Status why;
        for (;;) {
            if (WaitStopping(kSupervisePollMs)) return;
            why = executor_->Health();
            if (why.ok()) why = CheckLaunched();
            if (!why.ok()) break;
        }
        spdlog::error("{}: down: {}", who, why.message());
        {
            std::lock_guard<std::mutex> lock(mu_);
            last_failure_ = why;
        }
        // Re-form, with backoff, until it works or the attempts run out.
        for (;;) {
            if (failed_attempts >= options_.restart_limit) {
                spdlog::error(
                    "{}: giving up after {} failed attempts to re-form (restart_limit "
                    "{}); the instance stays down: {}",
                    who, failed_attempts, options_.restart_limit, why.message());
                KillLaunched();
                gave_up_.store(true);
                if (options_.on_gave_up) options_.on_gave_up(why);
                return;
            }
            // First, so that replacements (external ones may already be on their way) are
            // accepted, and the old workers' channels are closed.
            executor_->BeginReform(why.message());
            KillLaunched();
            if (options_.before_relaunch) options_.before_relaunch();
            const int64_t backoff_ms = BackoffMs(options_.restart_backoff_ms, failed_attempts);
            spdlog::warn("{}: re-forming in {} ms (attempt {} of {})", who, backoff_ms,
                         failed_attempts + 1, options_.restart_limit);
            if (WaitStopping(backoff_ms)) return;
            Status formed;
            if (options_.launch.has_value()) {
                Result<std::unique_ptr<WorkerLauncher>> launched =
                    WorkerLauncher::Launch(*options_.launch);
                if (launched.ok()) {
                    std::lock_guard<std::mutex> lock(mu_);
                    launcher_ = std::move(*launched);
                } else {
                    formed = launched.status();
                }
            } else {
                spdlog::info("{}: waiting for the replacement workers to register", who);
            }
            if (formed.ok()) {
                formed = executor_->Reform(
                    std::chrono::milliseconds(options_.register_timeout_ms), [this]() -> Status {
                        if (stopping()) return Status(StatusCode::kAborted, "shutting down");
                        return CheckLaunched();
                    });
            }
            if (stopping()) return;
            if (formed.ok()) {
                {
                    std::lock_guard<std::mutex> lock(mu_);
                    if (launcher_ != nullptr) launcher_->NoteDescendants();
                }
                failed_attempts = 0;
                restarts_.fetch_add(1);
                spdlog::info("{}: re-formed (epoch {}), serving again", who, executor_->epoch());
                break;
            }
            ++failed_attempts;
            failed_restarts_.fetch_add(1);
            why = formed;
            spdlog::error("{}: re-forming failed: {}", who, why.message());
            std::lock_guard<std::mutex> lock(mu_);
            last_failure_ = why;
        }
    }
}

namespace {

// The first part of StartProcessInstance: the checks, then the instance declared to `registry`.
Result<DeclaredProcessInstance> Declare(const ServerConfig& config, const ProcessInstanceSpec& spec,
                                        std::shared_ptr<WorkerRegistry> registry) {
    const ServeWorkersConfig& w = config.workers;
    const std::string who = "instance " + spec.instance_id;
    if (w.mode != WorkersMode::kProcesses) {
        return InvalidArgument(who + ": workers.mode is " + std::string(WorkersModeName(w.mode)) +
                               ", not processes");
    }
    if (spec.tp > 1 && w.launcher == WorkersLauncher::kDirect && !KVSHARD_WITH_GLOO) {
        return InvalidArgument(
            who + ": tp " + std::to_string(spec.tp) +
            " worker processes started one by one all-reduce over Gloo, and this kvshard was "
            "built without it (KVSHARD_WITH_GLOO=OFF): set workers.launcher: mpirun (or "
            "external, started with mpirun by hand)");
    }
    WorkerRunSettings settings = spec.worker;
    if (settings.threads <= 0 && spec.tp > 1 && w.launcher != WorkersLauncher::kExternal) {
        // The ranks share this machine's cores.
        const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        settings.threads = std::max(1, hw / spec.tp);
    }
    RemoteInstanceOptions ro;
    ro.instance_id = spec.instance_id;
    ro.tp = spec.tp;
    ro.model_path = spec.model_path;
    ro.settings = EncodeWorkerSettings(settings);
    ro.rank_settings = spec.rank_settings;
    ro.step_timeout_ms = w.step_timeout_ms;
    ro.nccl_bootstrap = UsesNcclBootstrap(spec);
    DeclaredProcessInstance declared;
    KV_ASSIGN_OR_RETURN(declared.executor, registry->AddInstance(ro));
    declared.registry = std::move(registry);
    return declared;
}

// The second part: launches the workers and waits until every rank is Ready, or `abandon`
// (called every few milliseconds while waiting) returns an error.
Result<std::unique_ptr<ProcessInstance>> Form(const ServerConfig& config,
                                              const ProcessInstanceSpec& spec,
                                              DeclaredProcessInstance declared,
                                              const std::function<Status()>& abandon) {
    const ServeWorkersConfig& w = config.workers;
    const std::string who = "instance " + spec.instance_id;
    std::shared_ptr<WorkerRegistry> registry = std::move(declared.registry);
    std::unique_ptr<RemoteStepExecutor> executor = std::move(declared.executor);
    ProcessInstanceOptions po;
    po.restart_limit = w.restart_limit;
    po.restart_backoff_ms = w.restart_backoff_ms;
    po.register_timeout_ms = w.register_timeout_ms;
    po.shutdown_wait_ms = w.dead_after_ms;
    po.on_gave_up = spec.on_gave_up;
    po.before_relaunch = spec.before_relaunch;
    std::unique_ptr<WorkerLauncher> launcher;
    if (w.launcher != WorkersLauncher::kExternal) {
        WorkerLauncherOptions lo;
        lo.launch =
            w.launcher == WorkersLauncher::kMpirun ? WorkerLaunch::kMpirun : WorkerLaunch::kDirect;
        lo.executable = spec.worker_executable;
        // Workers connect to the listener's address; "0.0.0.0" is not one, loopback is.
        lo.coordinator_host = registry->host() == "0.0.0.0" || registry->host().empty()
                                  ? "127.0.0.1"
                                  : registry->host();
        lo.coordinator_port = registry->port();
        lo.instance_id = spec.instance_id;
        lo.tp = spec.tp;
        lo.token = registry->token();
        lo.extra_args = {"--heartbeat-ms",       std::to_string(w.heartbeat_interval_ms),
                         "--dead-after-ms",      std::to_string(w.dead_after_ms),
                         "--connect-timeout-ms", std::to_string(w.register_timeout_ms),
                         "--log-level",          config.log_level};
        KV_ASSIGN_OR_RETURN(launcher, WorkerLauncher::Launch(lo));
        po.launch = lo;
    } else {
        spdlog::info("{}: waiting for {} workers to register at {}:{}", who, spec.tp,
                     registry->host(), registry->port());
    }
    WorkerLauncher* l = launcher.get();
    const Status ready = executor->WaitReady(
        std::chrono::milliseconds(w.register_timeout_ms), [l, &abandon]() -> Status {
            if (abandon) KV_RETURN_IF_ERROR(abandon());
            return l != nullptr ? l->CheckExited() : Status::Ok();
        });
    auto instance = std::make_unique<ProcessInstance>(std::move(registry), std::move(executor),
                                                      std::move(launcher), std::move(po));
    if (!ready.ok()) return ready;  // the instance's destructor ends the workers
    if (l != nullptr) l->NoteDescendants();
    return instance;  // supervised once every instance formed (FormProcessInstances)
}

}  // namespace

bool UsesNcclBootstrap(const ProcessInstanceSpec& spec, bool cuda_build) {
    // The ranks' own rule (config/collective_path.h): NCCL refuses two ranks of one communicator
    // on one GPU, so ranks listed on a shared GPU stage their all-reduces through the host and
    // need no NCCL id; CPU instances ("cpu" devices) all-reduce over Gloo or MPI.
    std::vector<int> gpus;
    for (const std::string& d : spec.devices) {
        int ordinal = -1;
        const auto [end, ec] = std::from_chars(d.data(), d.data() + d.size(), ordinal);
        if (ec != std::errc() || end != d.data() + d.size()) return false;  // "cpu"
        gpus.push_back(ordinal);
    }
    return DecideCollectivePath(
               {.on_gpus = true, .tp = spec.tp, .devices = gpus, .nccl_available = cuda_build}) ==
           CollectivePath::kNccl;
}

Result<std::vector<DeclaredProcessInstance>> DeclareProcessInstances(
    const ServerConfig& config, const std::vector<ProcessInstanceSpec>& specs,
    std::shared_ptr<WorkerRegistry> registry) {
    if (registry == nullptr) {
        KV_ASSIGN_OR_RETURN(std::unique_ptr<WorkerRegistry> own,
                            WorkerRegistry::Start(RegistryOptionsFrom(config)));
        registry = std::move(own);
    }
    std::vector<DeclaredProcessInstance> declared;
    for (const ProcessInstanceSpec& spec : specs) {
        KV_ASSIGN_OR_RETURN(DeclaredProcessInstance d, Declare(config, spec, registry));
        declared.push_back(std::move(d));
    }
    return declared;
}

Result<std::vector<std::unique_ptr<ProcessInstance>>> FormProcessInstances(
    const ServerConfig& config, const std::vector<ProcessInstanceSpec>& specs,
    std::vector<DeclaredProcessInstance> declared) {
    KV_CHECK(specs.size() == declared.size()) << "one declaration per spec";
    const size_t n = specs.size();
    std::vector<Result<std::unique_ptr<ProcessInstance>>> formed;
    for (size_t i = 0; i < n; ++i) formed.emplace_back(Internal("not formed"));
    if (n == 1) {
        formed[0] = Form(config, specs[0], std::move(declared[0]), {});
    } else {
        // Every instance waits at once, each serving its own ranks' rendezvous store; the first
        // failure ends the others' waiting.
        std::mutex mu;
        std::string failed;  // guarded by mu: the first instance that failed
        std::vector<std::thread> threads;
        for (size_t i = 0; i < n; ++i) {
            threads.emplace_back([&, i] {
                const auto abandon = [&]() -> Status {
                    std::lock_guard<std::mutex> lock(mu);
                    if (failed.empty()) return Status::Ok();
                    return Status(StatusCode::kAborted, "instance " + failed + " did not form");
                };
                formed[i] = Form(config, specs[i], std::move(declared[i]), abandon);
                if (!formed[i].ok()) {
                    std::lock_guard<std::mutex> lock(mu);
                    if (failed.empty()) failed = specs[i].instance_id;
                }
            });
        }
        for (std::thread& t : threads) t.join();
        for (size_t i = 0; i < n; ++i) {
            if (!formed[i].ok() && specs[i].instance_id == failed) return formed[i].status();
        }
    }
    std::vector<std::unique_ptr<ProcessInstance>> out;
    for (Result<std::unique_ptr<ProcessInstance>>& f : formed) {
        if (!f.ok()) return f.status();
        out.push_back(std::move(*f));
    }
    // Only now: a supervisor re-forms its instance and runs before_relaunch (serve's KV pair
    // re-plan, which tells the other instances' executors). Were one started while another
    // instance could still fail to form, its re-form could reach executors destroyed on that
    // failure. A worker that died in the meantime is found at the supervisor's first look.
    for (std::unique_ptr<ProcessInstance>& instance : out) instance->StartSupervisor();
    return out;
}

Result<std::unique_ptr<ProcessInstance>> StartProcessInstance(
    const ServerConfig& config, const ProcessInstanceSpec& spec,
    std::shared_ptr<WorkerRegistry> registry) {
    KV_ASSIGN_OR_RETURN(std::vector<DeclaredProcessInstance> declared,
                        DeclareProcessInstances(config, {spec}, std::move(registry)));
    KV_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<ProcessInstance>> formed,
                        FormProcessInstances(config, {spec}, std::move(declared)));
    return std::move(formed[0]);
}

}  // namespace kvshard::cli
