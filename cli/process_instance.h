// One instance in process mode, ready to serve: the registry its workers register with, the
// launched worker processes (none with workers.launcher: external) and the RemoteStepExecutor the
// instance's engine runs its steps on. What `kvshard serve` calls for each instance when
// workers.mode is processes.
//
//   auto instance = StartProcessInstance(config, spec);    // returns once every rank is Ready
//   InstanceEngine engine(ec, tokenizer, (*instance)->executor());
//
// Supervision: a thread of the instance watches executor().Health() (and the launched processes).
// When the instance fails it logs why, re-opens the executor to registrations (BeginReform),
// kills what the coordinator launched (SIGKILL, also a stopped worker; every child reaped), waits
// workers.restart_backoff_ms (doubling after each failed attempt, at most 30 s), launches the
// workers again with the same token and waits for them (Reform, workers.register_timeout_ms);
// for external workers it only waits for the replacements' registrations. After
// workers.restart_limit failed attempts in a row (0: at the first failure) it gives up: the
// instance stays down, gave_up() turns true and spec.on_gave_up runs.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli/worker_launcher.h"
#include "common/build_config.h"
#include "common/status.h"
#include "config/server_config.h"
#include "coordinator/remote_executor.h"
#include "worker/worker_service.h"

namespace kvshard::cli {

struct ProcessInstanceSpec {
    std::string instance_id = "0";
    int tp = 1;
    std::string model_path;
    // What each worker builds: max_context, block_size, num_kv_blocks, kv dtype, tokenizer, and
    // threads (0: the machine's cores divided among the tp workers, which run on this machine
    // unless the launcher is external).
    WorkerRunSettings worker;
    // The instance's devices, one per rank ("cpu" or a GPU ordinal; pools[].instances[].devices).
    // Empty: the CPU for every rank.
    std::vector<std::string> devices;
    // The kvshard binary the workers run ("/proc/self/exe" from kvshard itself; tests name it).
    std::string worker_executable = "/proc/self/exe";
    // Empty, or one list per rank added to that rank's settings (the KV pair path's pairs:
    // RemoteInstanceOptions::rank_settings).
    std::vector<std::vector<std::pair<std::string, std::string>>> rank_settings;
    // Runs once, on the supervisor thread, when the supervisor gives up on the instance (why: the
    // last failure). E.g. the serve command exits non-zero when no instance can serve any more.
    // It must not destroy the ProcessInstance (the destructor joins that thread).
    std::function<void(const Status& why)> on_gave_up;
    // Runs on the supervisor thread at each attempt to re-form, once the old workers' channels
    // are closed and what the coordinator launched is killed, before the new workers are
    // launched (or waited for): e.g. the KV pair path's re-plan (cli/kv_pair_replan.h), which
    // hands the executors the rank settings the new workers register with.
    std::function<void()> before_relaunch;
};

// The registry settings of config.workers (host, port, token, heartbeats), for a registry shared
// by several instances. An empty workers.token stays empty: the registry then makes one.
WorkerRegistryOptions RegistryOptionsFrom(const ServerConfig& config);

struct ProcessInstanceOptions {
    // How to start the workers again; nullopt for external workers.
    std::optional<WorkerLauncherOptions> launch;
    int restart_limit = 5;                  // failed attempts in a row before giving up; 0: never
    int64_t restart_backoff_ms = 1'000;     // before the first attempt; doubles, at most 30 s
    int64_t register_timeout_ms = 120'000;  // each attempt's Reform
    int64_t shutdown_wait_ms = 5'000;       // destruction: how long workers may take to exit
    std::function<void(const Status&)> on_gave_up;
    std::function<void()> before_relaunch;  // ProcessInstanceSpec::before_relaunch
};

// Ownership: owns its executor and launcher; shares the registry. Destroying it stops the
// supervisor, tells the workers to shut down, waits for them (shutdown_wait_ms at most), then
// ends what is left. Thread-safety: the accessors from any thread.
class ProcessInstance {
  public:
    ProcessInstance(std::shared_ptr<WorkerRegistry> registry,
                    std::unique_ptr<RemoteStepExecutor> executor,
                    std::unique_ptr<WorkerLauncher> launcher, ProcessInstanceOptions options);
    ~ProcessInstance();
    ProcessInstance(const ProcessInstance&) = delete;
    ProcessInstance& operator=(const ProcessInstance&) = delete;

    // Starts the supervisor thread (StartProcessInstance does, once the workers are Ready).
    // REQUIRES: called at most once.
    void StartSupervisor();

    RemoteStepExecutor& executor() { return *executor_; }
    WorkerRegistry& registry() { return *registry_; }
    // The pids of the processes launched now (one per rank, or mpirun's); empty for external
    // workers and while none run.
    std::vector<pid_t> worker_pids() const;

    // The supervisor gave up: the instance stays down until the serve process is restarted.
    bool gave_up() const { return gave_up_.load(); }
    // Successful re-formations so far.
    int restarts() const { return restarts_.load(); }
    // Attempts to re-form that failed so far (consecutive or not).
    int failed_restarts() const { return failed_restarts_.load(); }
    // The last failure the supervisor saw (OK before any).
    Status last_failure() const;

  private:
    void Supervise();
    // Sleeps up to `ms`; true when the instance is being destroyed.
    bool WaitStopping(int64_t ms);
    bool stopping() const;
    // The launched processes' exit, or OK (also when none were launched).
    Status CheckLaunched();
    void KillLaunched();

    std::shared_ptr<WorkerRegistry> registry_;
    std::unique_ptr<RemoteStepExecutor> executor_;
    const ProcessInstanceOptions options_;

    mutable std::mutex mu_;
    std::condition_variable stop_cv_;
    bool stopping_ = false;                     // guarded by mu_
    std::unique_ptr<WorkerLauncher> launcher_;  // guarded by mu_ (replaced by the supervisor)
    Status last_failure_;                       // guarded by mu_
    std::atomic<bool> gave_up_{false};
    std::atomic<int> restarts_{0};
    std::atomic<int> failed_restarts_{0};
    std::thread supervisor_;
};

// Whether the ranks of `spec` form an NCCL group, so that each formation hands them an NCCL
// unique id (RemoteInstanceOptions::nccl_bootstrap): in CUDA builds, for tp > 1 with every
// rank on a GPU of its own. Ranks sharing a GPU stage their all-reduces through the host, and CPU
// instances (any rank on "cpu", or no devices given) all-reduce over Gloo or MPI: they get none.
bool UsesNcclBootstrap(const ProcessInstanceSpec& spec, bool cuda_build = KVSHARD_WITH_CUDA);

// An instance declared to its registry whose workers have not been waited for yet.
struct DeclaredProcessInstance {
    std::shared_ptr<WorkerRegistry> registry;
    std::unique_ptr<RemoteStepExecutor> executor;
};

// Declares every instance of `specs` to `registry` (nullptr: one of their own, from
// config.workers), so that from then on a worker of any of them may register, in any order (a
// worker naming an instance not among them is still refused, naming it). Errors name the
// instance: a refused launch (tp > 1 with the direct launcher in a build without Gloo), an
// instance id in use. REQUIRES: config.workers.mode is processes.
Result<std::vector<DeclaredProcessInstance>> DeclareProcessInstances(
    const ServerConfig& config, const std::vector<ProcessInstanceSpec>& specs,
    std::shared_ptr<WorkerRegistry> registry = nullptr);

// Launches the workers of every declared instance as config.workers.launcher says (passing the
// registry's token) and waits for all of them at once, each until every rank is Ready
// (workers.register_timeout_ms), serving each formation's rendezvous store meanwhile; then
// starts their supervisors (workers.restart_limit, restart_backoff_ms). The first instance that
// fails ends the others' waiting, and its error is returned, naming the instance and, for a
// worker, its rank and why: a worker that exited (its exit status), a load error (the worker's
// message), or the ranks still missing at the deadline; every instance is then shut down.
// REQUIRES: `declared` from DeclareProcessInstances(config, specs, ...).
Result<std::vector<std::unique_ptr<ProcessInstance>>> FormProcessInstances(
    const ServerConfig& config, const std::vector<ProcessInstanceSpec>& specs,
    std::vector<DeclaredProcessInstance> declared);

// One instance: DeclareProcessInstances and FormProcessInstances of `spec` alone.
Result<std::unique_ptr<ProcessInstance>> StartProcessInstance(
    const ServerConfig& config, const ProcessInstanceSpec& spec,
    std::shared_ptr<WorkerRegistry> registry = nullptr);

}  // namespace kvshard::cli
