// WorkerLauncher: starts the worker processes of one instance from the coordinator and owns them.
//
//   direct:  one `kvshard worker --coordinator H:P --instance ID --rank r --tp N ...` per rank
//            (posix_spawn), independent processes: with tp > 1 they meet through the coordinator
//            and all-reduce over Gloo (comm/collective.h; builds without Gloo refuse tp > 1).
//   mpirun:  one `mpirun --oversubscribe [--allow-run-as-root] -np N -x KVSHARD_WORKER_TOKEN
//            kvshard worker ...`; the ranks take rank and tp from MPI and all-reduce over it.
//
// The registry's token reaches the workers in their environment (KVSHARD_WORKER_TOKEN), never
// on a command line, where every local user could read it. Each child leads a process group of
// its own, so Kill() ends mpirun's ranks with it.
//
// RAII: the destructor ends the children (SIGTERM, then SIGKILL after the grace period) and
// reaps them. CheckExited notices a child that ended early, so the coordinator can fail at once
// instead of waiting for the registration timeout.
// Thread-safety: one thread at a time for every method.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvshard::cli {

enum class WorkerLaunch { kDirect, kMpirun };

struct WorkerLauncherOptions {
    WorkerLaunch launch = WorkerLaunch::kDirect;
    // The kvshard binary; "/proc/self/exe" when the coordinator is kvshard itself.
    std::string executable = "/proc/self/exe";
    std::string mpirun = "mpirun";  // found on PATH unless a path is given
    std::string coordinator_host = "127.0.0.1";
    uint16_t coordinator_port = 0;
    std::string instance_id;
    int tp = 1;
    // Appended to every worker's command line (e.g. --heartbeat-ms 500).
    std::vector<std::string> extra_args;
    // The registry's token, put in each child's environment as KVSHARD_WORKER_TOKEN.
    std::string token;
    int64_t terminate_grace_ms = 3'000;
};

class WorkerLauncher {
  public:
    // Spawns the processes. InvalidArgument for tp > 1 with the direct launcher in a build
    // without Gloo; the spawn's error (a missing executable or mpirun) otherwise.
    static Result<std::unique_ptr<WorkerLauncher>> Launch(const WorkerLauncherOptions& options);
    ~WorkerLauncher();
    WorkerLauncher(const WorkerLauncher&) = delete;
    WorkerLauncher& operator=(const WorkerLauncher&) = delete;

    // OK while every child runs; Unavailable naming the first that exited (rank, pid, exit code
    // or signal). Reaps what it finds.
    Status CheckExited();

    // Waits up to `timeout` for every child to exit on its own (after the workers were told to
    // shut down) and reaps them; true when all did.
    bool WaitForExit(std::chrono::milliseconds timeout);

    // SIGKILL to every child's process group (a stopped worker too, and mpirun's ranks), then
    // reaps every child: no zombies. Idempotent.
    void Kill();

    // Remembers the processes the children started (mpirun's ranks), once they run: Kill and
    // the destructor end them too, even after mpirun itself is gone (a rank orphaned when mpirun
    // died keeps running, in a process group of its own, often spinning in a collective).
    void NoteDescendants();

    // The spawned processes: one per rank (direct) or mpirun's.
    std::vector<pid_t> pids() const;
    // The command line of child i, for logs.
    const std::vector<std::string>& command(size_t i) const { return children_[i].argv; }

  private:
    struct Child {
        std::string name;  // "worker rank 1" or "mpirun"
        std::vector<std::string> argv;
        pid_t pid = -1;
        bool reaped = false;
        int wait_status = 0;
    };
    WorkerLauncher() = default;
    Status Spawn(Child& child, char* const envp[]);
    // SIGKILL to the noted descendants that are still the processes noted.
    void KillNotedDescendants();
    // Reaps `child` if it exited; true when it has been reaped.
    bool Reap(Child& child);

    WorkerLauncherOptions options_;
    std::vector<Child> children_;
    struct Process {
        pid_t pid = 0;
        uint64_t start_time = 0;  // /proc/<pid>/stat field 22: tells a reused pid apart
    };
    std::vector<Process> descendants_;
};

// The environment variable that carries the token to a worker.
inline constexpr const char* kWorkerTokenEnv = "KVSHARD_WORKER_TOKEN";

// "exit code 3" or "killed by signal 9 (Killed)", from a waitpid status.
std::string DescribeWaitStatus(int wait_status);

}  // namespace kvshard::cli
