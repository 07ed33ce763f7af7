#include "cli/worker_launcher.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/build_config.h"
#include "common/logging.h"

extern char** environ;

namespace kvshard::cli {
namespace {

// Every live descendant of `root` (children, their children, ...), from /proc. mpirun's ranks
// put themselves in process groups of their own, so killing mpirun's group misses them, and
// a rank orphaned by mpirun's SIGKILL can sit in a collective forever.
// Field 22 of /proc/<pid>/stat (clock ticks after boot), 0 when the process is gone.
uint64_t StartTime(pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) return 0;
    std::istringstream rest(stat.substr(paren + 1));
    std::string field;
    for (int i = 3; i <= 22 && rest >> field; ++i) {
        if (i == 22) return std::stoull(field);
    }
    return 0;
}

std::vector<pid_t> Descendants(pid_t root) {
    std::vector<std::pair<pid_t, pid_t>> procs;  // (pid, parent)
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
        const std::string name = entry.path().filename().string();
        if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
        std::ifstream in(entry.path() / "stat");
        std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        const size_t paren = stat.rfind(')');  // the command may hold spaces and parentheses
        if (paren == std::string::npos) continue;
        std::istringstream rest(stat.substr(paren + 1));
        std::string state;
        pid_t parent = 0;
        if (rest >> state >> parent) procs.emplace_back(static_cast<pid_t>(std::stol(name)), parent);
    }
    std::vector<pid_t> out{root};
    for (size_t i = 0; i < out.size(); ++i) {
        for (const auto& [pid, parent] : procs) {
            if (parent == out[i]) out.push_back(pid);
        }
    }
    out.erase(out.begin());
    return out;
}

}  // namespace

std::string DescribeWaitStatus(int wait_status) {
    if (WIFEXITED(wait_status)) return "exit code " + std::to_string(WEXITSTATUS(wait_status));
    if (WIFSIGNALED(wait_status)) {
        const int sig = WTERMSIG(wait_status);
        return "killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
    }
    return "wait status " + std::to_string(wait_status);
}

Status WorkerLauncher::Spawn(Child& child, char* const envp[]) {
    std::vector<char*> argv;
    for (std::string& a : child.argv) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    // A process group of its own (the child's pid), so Kill() reaches what mpirun started.
    // And the default signal mask and dispositions: the serve command blocks SIGTERM/SIGINT to
    // sigwait for them, and a child would inherit that (the launcher's SIGTERM would not end it).
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGTERM);
    sigaddset(&defaults, SIGINT);
    sigaddset(&defaults, SIGPIPE);
    posix_spawnattr_setflags(
        &attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &defaults);
    // posix_spawnp: mpirun is looked up on PATH; the kvshard path is absolute anyway.
    const int err = posix_spawnp(&pid, argv[0], nullptr, &attr, argv.data(), envp);
    posix_spawnattr_destroy(&attr);
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
    if (o.launch == WorkerLaunch::kDirect && o.tp > 1 && !KVSHARD_WITH_GLOO) {
        return InvalidArgument(
            "tp " + std::to_string(o.tp) +
            " worker processes started one by one all-reduce over Gloo, and this kvshard was "
            "built without it (KVSHARD_WITH_GLOO=OFF): use workers.launcher: mpirun (or tp 1)");
    }
    std::unique_ptr<WorkerLauncher> l(new WorkerLauncher());
    l->options_ = o;
    // "/proc/self/exe" means this binary only to this process (mpirun would resolve it to
    // itself), and its target path may name another build by now (the binary was rebuilt or
    // upgraded while serving: the old file is deleted, the new one speaks another version).
    // /proc/<this pid>/exe is this process's own binary, deleted or not, to any process here.
    std::string executable = o.executable;
    if (executable == "/proc/self/exe") executable = "/proc/" + std::to_string(getpid()) + "/exe";
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
        c.argv.insert(c.argv.end(), {"-np", std::to_string(o.tp), "-x", kWorkerTokenEnv});
        worker_args(c.argv);
        c.argv.insert(c.argv.end(), o.extra_args.begin(), o.extra_args.end());
        l->children_.push_back(std::move(c));
    }
    // This process's environment, with the token in place of any KVSHARD_WORKER_TOKEN of its own.
    const std::string prefix = std::string(kWorkerTokenEnv) + "=";
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
        if (std::string_view(*e).substr(0, prefix.size()) != prefix) env.emplace_back(*e);
    }
    env.push_back(prefix + o.token);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    for (Child& c : l->children_) {
        KV_RETURN_IF_ERROR(l->Spawn(c, envp.data()));  // the destructor ends the rest
    }
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

void WorkerLauncher::NoteDescendants() {
    descendants_.clear();
    for (const Child& c : children_) {
        if (c.pid <= 0 || c.reaped) continue;
        for (pid_t d : Descendants(c.pid)) descendants_.push_back({d, StartTime(d)});
    }
}

void WorkerLauncher::KillNotedDescendants() {
    for (const Process& p : descendants_) {
        if (p.start_time != 0 && StartTime(p.pid) == p.start_time) kill(p.pid, SIGKILL);
    }
}

void WorkerLauncher::Kill() {
    KillNotedDescendants();
    for (Child& c : children_) {
        if (c.pid <= 0) continue;
        // Its group: mpirun's ranks too, even after mpirun itself was reaped (a group id is not
        // reused while any member lives).
        kill(-c.pid, SIGKILL);
        if (c.reaped) continue;
        for (pid_t d : Descendants(c.pid)) kill(d, SIGKILL);
        kill(c.pid, SIGKILL);
        while (waitpid(c.pid, &c.wait_status, 0) < 0 && errno == EINTR) {
        }
        c.reaped = true;
        spdlog::info("{} (pid {}) killed", c.name, c.pid);
    }
}

WorkerLauncher::~WorkerLauncher() {
    for (Child& c : children_) {
        if (Reap(c)) continue;
        kill(c.pid, SIGTERM);
        kill(c.pid, SIGCONT);  // a stopped worker handles its SIGTERM too
    }
    const bool exited = WaitForExit(std::chrono::milliseconds(options_.terminate_grace_ms));
    KillNotedDescendants();  // a rank mpirun left behind
    if (exited) return;
    for (Child& c : children_) {
        if (c.reaped) continue;
        spdlog::warn("{} (pid {}) did not stop within {} ms of SIGTERM: SIGKILL", c.name, c.pid,
                     options_.terminate_grace_ms);
        kill(-c.pid, SIGKILL);
        for (pid_t d : Descendants(c.pid)) kill(d, SIGKILL);
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
