#include "cli/worker_launcher.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "common/logging.h"

extern char** environ;

namespace kvshard::cli {

std::string DescribeWaitStatus(int wait_status) {
    if (WIFEXITED(wait_status)) return "exit code " + std::to_string(WEXITSTATUS(wait_status));
    if (WIFSIGNALED(wait_status)) {
        const int sig = WTERMSIG(wait_status);
        return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
    }
    return "wait status " + std::to_string(wait_status);
}

Status WorkerLauncher::Spawn(Child& child) {
    std::vector<char*> argv;
    for (std::string& a : child.argv) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    // posix_spawnp: mpirun is looked up on PATH; the kvshard path is absolute anyway.
    const int err = posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
    if (err != 0) {
        return Status(StatusCode::kUnavailable,
                      "cannot start " + child.name + " (" + child.argv[0] + "): " + strerror(err));
    }
    child.pid = pid;
    spdlog::info("started {} (pid {})", child.name, pid);
    return Status::Ok();
}

Result<std::unique_ptr<WorkerLauncher>> WorkerLauncher::Launch(const WorkerLauncherOptions& o) {
    if (o.tp < 1) return InvalidArgument("tp " + std::to_string(o.tp) + " must be >= 1");
    if (o.launch == WorkerLaunch::kDirect && o.tp > 1) {
        return InvalidArgument(
            "tp " + std::to_string(o.tp) +
            " worker processes need MPI collectives between them; the direct launcher starts "
            "independent processes: use workers.launcher: mpirun (or tp 1)");
    }
    std::unique_ptr<WorkerLauncher> l(new WorkerLauncher());
    l->options_ = o;
    // "/proc/self/exe" means this binary only to this process: mpirun would resolve it to itself.
    std::string executable = o.executable;
    std::error_code ec;
    if (const auto real = std::filesystem::read_symlink(executable, ec); !ec) executable = real.string();
    auto worker_args = [&](std::vector<std::string>& argv) {
        argv.insert(argv.end(), {executable, "worker", "--coordinator",
                                 o.coordinator_host + ":" + std::to_string(o.coordinator_port),
                                 "--instance", o.instance_id});
    };
    if (o.launch == WorkerLaunch::kDirect) {
        for (int r = 0; r < o.tp; ++r) {
            Child c;
            c.name = "worker rank " + std::to_string(r);
            worker_args(c.argv);
            c.argv.insert(c.argv.end(),
                          {"--rank", std::to_string(r), "--tp", std::to_string(o.tp)});
            c.argv.insert(c.argv.end(), o.extra_args.begin(), o.extra_args.end());
            l->children_.push_back(std::move(c));
        }
    } else {
        Child c;
        c.name = "mpirun of " + std::to_string(o.tp) + " workers";
        c.argv = {o.mpirun, "--oversubscribe"};
        if (geteuid() == 0) c.argv.push_back("--allow-run-as-root");
        c.argv.insert(c.argv.end(), {"-np", std::to_string(o.tp)});
        worker_args(c.argv);
        c.argv.insert(c.argv.end(), o.extra_args.begin(), o.extra_args.end());
        l->children_.push_back(std::move(c));
    }
    for (Child& c : l->children_) KV_RETURN_IF_ERROR(l->Spawn(c));  // the destructor ends the rest
    return l;
}

bool WorkerLauncher::Reap(Child& c) {
    if (c.pid <= 0 || c.reaped) return true;
    const pid_t got = waitpid(c.pid, &c.wait_status, WNOHANG);
    if (got == c.pid || (got < 0 && errno == ECHILD)) c.reaped = true;
    return c.reaped;
}

bool WorkerLauncher::WaitForExit(std::chrono::milliseconds timeout) {
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + timeout;
    for (;;) {
        bool all = true;
        for (Child& c : children_) all = Reap(c) && all;
        if (all) return true;
        if (Clock::now() >= deadline) return false;
        // There is no waitpid with a timeout (and SIGCHLD belongs to the application): poll.
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
}

WorkerLauncher::~WorkerLauncher() {
    for (Child& c : children_) {
        if (!Reap(c)) kill(c.pid, SIGTERM);
    }
    if (WaitForExit(std::chrono::milliseconds(options_.terminate_grace_ms))) return;
    for (Child& c : children_) {
        if (c.reaped) continue;
        spdlog::warn("{} (pid {}) did not stop within {} ms of SIGTERM: SIGKILL", c.name, c.pid,
                     options_.terminate_grace_ms);
        kill(c.pid, SIGKILL);
        while (waitpid(c.pid, &c.wait_status, 0) < 0 && errno == EINTR) {
        }
        c.reaped = true;
    }
}

Status WorkerLauncher::CheckExited() {
    for (Child& c : children_) {
        if (c.pid <= 0 || !Reap(c)) continue;
        return Status(StatusCode::kUnavailable,
                      c.name + " (pid " + std::to_string(c.pid) +
                          ") exited: " + DescribeWaitStatus(c.wait_status));
    }
    return Status::Ok();
}

std::vector<pid_t> WorkerLauncher::pids() const {
    std::vector<pid_t> out;
    for (const Child& c : children_) out.push_back(c.pid);
    return out;
}

}  // namespace kvshard::cli
