#include "cli/process_instance.h"

#include <algorithm>
#include <thread>

#include "common/logging.h"

namespace kvshard::cli {

WorkerRegistryOptions RegistryOptionsFrom(const ServerConfig& config) {
    WorkerRegistryOptions o;
    o.host = config.workers.host;
    o.port = static_cast<uint16_t>(config.workers.port);
    o.channel.heartbeat_interval_ms = config.workers.heartbeat_interval_ms;
    o.channel.dead_after_ms = config.workers.dead_after_ms;
    return o;
}

ProcessInstance::ProcessInstance(std::shared_ptr<WorkerRegistry> registry,
                                 std::unique_ptr<RemoteStepExecutor> executor,
                                 std::unique_ptr<WorkerLauncher> launcher, int64_t shutdown_wait_ms)
    : registry_(std::move(registry)),
      executor_(std::move(executor)),
      launcher_(std::move(launcher)),
      shutdown_wait_ms_(shutdown_wait_ms) {}

ProcessInstance::~ProcessInstance() {
    executor_->Shutdown("the coordinator is shutting the instance down");
    if (launcher_ != nullptr) {
        launcher_->WaitForExit(std::chrono::milliseconds(shutdown_wait_ms_));
        launcher_.reset();  // SIGTERM/SIGKILL whatever did not exit
    }
    executor_.reset();
}

Result<std::unique_ptr<ProcessInstance>> StartProcessInstance(
    const ServerConfig& config, const ProcessInstanceSpec& spec,
    std::shared_ptr<WorkerRegistry> registry) {
    const ServeWorkersConfig& w = config.workers;
    const std::string who = "instance " + spec.instance_id;
    if (w.mode != WorkersMode::kProcesses) {
        return InvalidArgument(who + ": workers.mode is " + std::string(WorkersModeName(w.mode)) +
                               ", not processes");
    }
    if (spec.tp > 1 && w.launcher == WorkersLauncher::kDirect) {
        return InvalidArgument(
            who + ": tp " + std::to_string(spec.tp) +
            " worker processes all-reduce over MPI, which processes started one by one do not "
            "share: set workers.launcher: mpirun (or external, started with mpirun by hand)");
    }
    if (registry == nullptr) {
        KV_ASSIGN_OR_RETURN(std::unique_ptr<WorkerRegistry> own,
                            WorkerRegistry::Start(RegistryOptionsFrom(config)));
        registry = std::move(own);
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
    ro.step_timeout_ms = w.step_timeout_ms;
    KV_ASSIGN_OR_RETURN(std::unique_ptr<RemoteStepExecutor> executor, registry->AddInstance(ro));

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
        lo.extra_args = {"--heartbeat-ms",       std::to_string(w.heartbeat_interval_ms),
                         "--dead-after-ms",      std::to_string(w.dead_after_ms),
                         "--connect-timeout-ms", std::to_string(w.register_timeout_ms),
                         "--log-level",          config.log_level};
        KV_ASSIGN_OR_RETURN(launcher, WorkerLauncher::Launch(lo));
    } else {
        spdlog::info("{}: waiting for {} workers to register at {}:{}", who, spec.tp,
                     registry->host(), registry->port());
    }
    WorkerLauncher* l = launcher.get();
    const Status ready =
        executor->WaitReady(std::chrono::milliseconds(w.register_timeout_ms),
                            [l]() { return l != nullptr ? l->CheckExited() : Status::Ok(); });
    auto instance = std::make_unique<ProcessInstance>(std::move(registry), std::move(executor),
                                                      std::move(launcher), w.dead_after_ms);
    if (!ready.ok()) return ready;  // the instance's destructor ends the workers
    return instance;
}

}  // namespace kvshard::cli
