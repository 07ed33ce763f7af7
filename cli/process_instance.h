// One instance in process mode, ready to serve: the registry its workers register with, the
// launched worker processes (none with workers.launcher: external) and the RemoteStepExecutor the
// instance's engine runs its steps on. What `kvshard serve` calls for each instance when
// workers.mode is processes.
//
//   auto instance = StartProcessInstance(config, spec);    // returns once every rank is Ready
//   InstanceEngine engine(ec, tokenizer, (*instance)->executor());
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cli/worker_launcher.h"
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
    // The kvshard binary the workers run ("/proc/self/exe" from kvshard itself; tests name it).
    std::string worker_executable = "/proc/self/exe";
};

// The registry settings of config.workers (host, port, heartbeats), for a registry shared by
// several instances.
WorkerRegistryOptions RegistryOptionsFrom(const ServerConfig& config);

// Ownership: owns its executor and launcher; shares the registry. Destroying it tells the workers
// to shut down, waits for them (workers.dead_after_ms at most), then ends what is left.
class ProcessInstance {
  public:
    ProcessInstance(std::shared_ptr<WorkerRegistry> registry,
                    std::unique_ptr<RemoteStepExecutor> executor,
                    std::unique_ptr<WorkerLauncher> launcher, int64_t shutdown_wait_ms);
    ~ProcessInstance();
    ProcessInstance(const ProcessInstance&) = delete;
    ProcessInstance& operator=(const ProcessInstance&) = delete;

    RemoteStepExecutor& executor() { return *executor_; }
    WorkerRegistry& registry() { return *registry_; }
    // nullptr when the workers were started by someone else.
    WorkerLauncher* launcher() { return launcher_.get(); }

  private:
    std::shared_ptr<WorkerRegistry> registry_;
    std::unique_ptr<RemoteStepExecutor> executor_;
    std::unique_ptr<WorkerLauncher> launcher_;
    int64_t shutdown_wait_ms_;
};

// Registers the instance with `registry` (nullptr: a registry of its own, from config.workers),
// launches its workers as config.workers.launcher says, and waits until every rank is Ready
// (workers.register_timeout_ms). Errors name the instance and, for a worker, its rank and why:
// a refused launch (tp > 1 with the direct launcher), a worker that exited (its exit status), a
// load error (the worker's message), or the ranks still missing at the deadline.
// REQUIRES: config.workers.mode is processes.
Result<std::unique_ptr<ProcessInstance>> StartProcessInstance(
    const ServerConfig& config, const ProcessInstanceSpec& spec,
    std::shared_ptr<WorkerRegistry> registry = nullptr);

}  // namespace kvshard::cli
