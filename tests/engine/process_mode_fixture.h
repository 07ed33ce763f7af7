// The process-mode tests' shared fixture (tests/engine/process_mode_*_test.cc): the real
// `kvshard worker` processes, launched by the coordinator's launcher or started by hand,
// registered with a WorkerRegistry and driven through a RemoteStepExecutor by the instance
// engine, on stories260K; and the hand-made workers that register over a FrameChannel.
// Everything is in kvshard::process_mode (not an anonymous namespace): gtest requires one fixture
// type for ProcessModeTest across the files that use it.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "cli/process_instance.h"
#include "comm/frame_channel.h"
#include "common/build_config.h"
#include "coordinator/engine.h"
#include "coordinator/remote_executor.h"
#include "tests/test_util.h"
#include "worker/local_model.h"
#include "worker/tp_group.h"

extern char** environ;

namespace kvshard::process_mode {

using SteadyClock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Collects a request's tokens; Wait() has a generous bound so a regression fails instead of
// hanging the suite.
class Sink : public RequestSink {
  public:
    void OnDelta(const GenerationDelta& d) override {
        std::lock_guard<std::mutex> lock(mu_);
        ids_.insert(ids_.end(), d.token_ids.begin(), d.token_ids.end());
        cv_.notify_all();
    }
    void OnFinish(const GenerationUsage&, const Status& status) override {
        std::lock_guard<std::mutex> lock(mu_);
        status_ = status;
        done_ = true;
        finished_at_ = SteadyClock::now();
        cv_.notify_all();
    }
    bool WaitDone(milliseconds timeout = milliseconds(60'000)) {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, timeout, [&] { return done_; });
    }
    bool WaitFirstToken(milliseconds timeout = milliseconds(60'000)) {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, timeout, [&] { return !ids_.empty() || done_; });
    }
    std::vector<int32_t> ids() {
        std::lock_guard<std::mutex> lock(mu_);
        return ids_;
    }
    Status status() {
        std::lock_guard<std::mutex> lock(mu_);
        return status_;
    }
    SteadyClock::time_point finished_at() {
        std::lock_guard<std::mutex> lock(mu_);
        return finished_at_;
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<int32_t> ids_;
    Status status_;
    bool done_ = false;
    SteadyClock::time_point finished_at_;
};

inline std::string KvshardBinary() {
    const std::string path = KVSHARD_CLI_BINARY;
    struct stat st {};
    return stat(path.c_str(), &st) == 0 ? path : "";
}

inline bool HaveMpirun() {
    if (!KVSHARD_WITH_MPI) return false;
    return std::system("mpirun --version > /dev/null 2>&1") == 0;
}

// Polls `condition` until it holds or a generous deadline passes (a regression fails instead of
// hanging; no test depends on how soon).
inline bool WaitFor(const std::function<bool()>& condition,
                    milliseconds timeout = milliseconds(90'000)) {
    const auto deadline = SteadyClock::now() + timeout;
    while (!condition()) {
        if (SteadyClock::now() >= deadline) return false;
        std::this_thread::sleep_for(milliseconds(10));
    }
    return true;
}

// Gone and reaped: neither running nor a zombie (kill(pid, 0) succeeds on a zombie).
inline bool Reaped(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

inline constexpr int64_t kBlocks = 256;
inline constexpr int64_t kBlockSize = 16;
inline constexpr int64_t kMaxContext = 512;

class ProcessModeTest : public ::testing::Test {
  protected:
    void SetUp() override {
        model_path_ = testing::SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(model_path_, "stories260K.bin");
        binary_ = KvshardBinary();
        KV_REQUIRE_FIXTURE(binary_, "the kvshard binary (" KVSHARD_CLI_BINARY ")");
        Result<LocalModel> m = LoadLocalModel(model_path_);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        model_ = std::make_unique<LocalModel>(std::move(*m));
    }

    // restart_limit 0: the supervisor never relaunches (the failure tests look at the failed
    // instance); the recovery tests ask for restarts with a short backoff.
    ServerConfig Config(const std::string& launcher = "direct", int64_t dead_after_ms = 1'000,
                        int restart_limit = 0) {
        const std::string yaml =
            "model: " + model_path_ +
            "\nlog_level: warn\nworkers:\n  mode: processes\n  launcher: " + launcher +
            "\n  heartbeat_interval_ms: 200\n  dead_after_ms: " + std::to_string(dead_after_ms) +
            "\n  step_timeout_ms: 30000\n  register_timeout_ms: 60000\n  restart_limit: " +
            std::to_string(restart_limit) + "\n  restart_backoff_ms: 100\n";
        Result<ServerConfig> c = ParseServerConfig(yaml, "test.yaml");
        EXPECT_TRUE(c.ok()) << c.status().ToString();
        return *c;
    }

    // A serve config whose instances take external workers presenting `token` (the registry
    // given to the cli:: functions is the one used, whatever the port says), with `workers_yaml`
    // (lines of the workers: section, each "  key: value\n") after it.
    Result<ServerConfig> ExternalConfig(const std::string& token, const std::string& workers_yaml) {
        return ParseServerConfig("model: " + model_path_ +
                                     "\nlog_level: warn\nworkers:\n  mode: processes\n  launcher: "
                                     "external\n  port: 1\n  token: " +
                                     token + "\n" + workers_yaml,
                                 "test.yaml");
    }

    cli::ProcessInstanceSpec Spec(int tp, const std::string& model_path = "") {
        cli::ProcessInstanceSpec s;
        s.instance_id = "test";
        s.tp = tp;
        s.model_path = model_path.empty() ? model_path_ : model_path;
        s.worker.runner.max_context = kMaxContext;
        s.worker.runner.block_size = kBlockSize;
        s.worker.runner.num_kv_blocks = kBlocks;
        s.worker.threads = 1;
        s.worker_executable = binary_;
        return s;
    }

    std::unique_ptr<InstanceEngine> Engine(StepExecutor& executor) {
        InstanceEngineConfig c;
        c.scheduler.max_num_seqs = 16;
        c.scheduler.max_num_batched_tokens = 128;
        c.blocks.num_blocks = kBlocks;
        c.blocks.block_size = kBlockSize;
        c.max_context = kMaxContext;
        c.stop_token_ids = model_->StopTokenIds();
        auto e = std::make_unique<InstanceEngine>(c, *model_->tokenizer, executor);
        e->Start();
        return e;
    }

    GenerationRequest Request(const std::string& id, const std::string& prompt, int64_t max_tokens,
                              bool ignore_eos = false) {
        GenerationRequest r;
        r.request_id = id;
        r.prompt_token_ids = model_->EncodePrompt(prompt);
        r.max_tokens = max_tokens;
        r.ignore_eos = ignore_eos;
        return r;
    }

    // Greedy tokens of a few concurrent requests through `executor`.
    std::vector<std::vector<int32_t>> Run(StepExecutor& executor) {
        auto engine = Engine(executor);
        std::vector<std::vector<int32_t>> out = RunOn(*engine);
        engine->Stop();
        return out;
    }

    // The same requests on a running engine; `tag` keeps request ids unique across calls.
    std::vector<std::vector<int32_t>> RunOn(InstanceEngine& engine, const std::string& tag = "r") {
        const std::vector<std::string> prompts = {"Once upon a time", "The little dog",
                                                  "Lily and Tom went", "One day, a big bird"};
        std::vector<std::shared_ptr<Sink>> sinks;
        for (size_t i = 0; i < prompts.size(); ++i) {
            sinks.push_back(std::make_shared<Sink>());
            EXPECT_TRUE(
                engine.Submit(Request(tag + std::to_string(i), prompts[i], 48), sinks.back()).ok());
        }
        std::vector<std::vector<int32_t>> out;
        for (auto& s : sinks) {
            EXPECT_TRUE(s->WaitDone());
            EXPECT_TRUE(s->status().ok()) << s->status().ToString();
            out.push_back(s->ids());
        }
        return out;
    }

    std::vector<std::vector<int32_t>> EmbeddedReference() {
        TpGroupConfig tc;
        tc.tp = 1;
        tc.threads_per_rank = 1;
        tc.runner.max_context = kMaxContext;
        tc.runner.block_size = kBlockSize;
        tc.runner.num_kv_blocks = kBlocks;
        Result<std::unique_ptr<TpGroup>> group = TpGroup::Create(*model_->file, tc);
        EXPECT_TRUE(group.ok()) << group.status().ToString();
        return Run(**group);
    }

    // A long request on a fresh engine over `executor`; `pid` is killed once its first token came,
    // and the request must end, with an error, within `bound`. Callers wrap it in
    // ASSERT_NO_FATAL_FAILURE.
    void FailARequestByKilling(StepExecutor& executor, pid_t pid, milliseconds bound) {
        auto engine = Engine(executor);
        auto sink = std::make_shared<Sink>();
        ASSERT_TRUE(engine->Submit(Request("long", "Once upon a time", 400, true), sink).ok());
        ASSERT_TRUE(sink->WaitFirstToken());
        ASSERT_EQ(kill(pid, SIGKILL), 0);
        ASSERT_TRUE(sink->WaitDone(bound)) << "the request hangs";
        EXPECT_FALSE(sink->status().ok());
        engine->Stop();
    }

    // Whether `instance` came back healthy at epoch 2 after one restart (within WaitFor's bound).
    // restarts() counts once Reform returned, a moment after the epoch changed.
    static bool ReformedOnce(cli::ProcessInstance& instance) {
        return WaitFor([&] {
            return instance.executor().Health().ok() && instance.executor().epoch() == 2 &&
                   instance.restarts() == 1;
        });
    }

    std::string model_path_;
    std::string binary_;
    std::unique_ptr<LocalModel> model_;
};

// ---- registration, with hand-made workers ----

inline RegisterAckMessage RegisterAs(uint16_t port, const RegisterMessage& reg,
                                     std::unique_ptr<FrameChannel>* keep = nullptr) {
    Result<std::unique_ptr<FrameChannel>> c =
        ConnectFrameChannel("127.0.0.1", port, milliseconds(5'000));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return {};
    EXPECT_TRUE((*c)->Send(reg).ok());
    Result<Message> answer = (*c)->Receive(SteadyClock::now() + milliseconds(10'000));
    EXPECT_TRUE(answer.ok()) << answer.status().ToString();
    if (!answer.ok()) return {};
    const auto* ack = std::get_if<RegisterAckMessage>(&*answer);
    EXPECT_NE(ack, nullptr);
    if (ack == nullptr) return {};
    RegisterAckMessage out = *ack;
    if (keep != nullptr) *keep = std::move(*c);
    return out;
}

inline constexpr const char* kToken = "registry-test-token";

inline WorkerRegistryOptions RegistryOptions() {
    WorkerRegistryOptions o;
    o.token = kToken;
    return o;
}

// ---- workers started by hand (no launcher) ----

// Starts `args` (args[0] the executable) with the test's environment less its own
// KVSHARD_WORKER_TOKEN and LWS_WORKER_INDEX, plus `env`.
inline pid_t SpawnWithWorkerEnv(std::vector<std::string> args,
                                const std::vector<std::string>& env) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
        const std::string_view v(*e);
        if (v.rfind("KVSHARD_WORKER_TOKEN=", 0) != 0 && v.rfind("LWS_WORKER_INDEX=", 0) != 0) {
            env_strings.push_back(*e);
        }
    }
    env_strings.insert(env_strings.end(), env.begin(), env.end());
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (std::string& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = -1;
    EXPECT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()), 0);
    return pid;
}

// `kvshard worker` for `port` and instance "test", started by hand (no launcher), with `extra`
// arguments and `env` (see SpawnWithWorkerEnv).
inline pid_t SpawnWorker(const std::string& binary, uint16_t port, std::vector<std::string> extra,
                         const std::vector<std::string>& env) {
    std::vector<std::string> args = {
        binary,        "worker", "--coordinator", "127.0.0.1:" + std::to_string(port),
        "--instance",  "test",   "--threads",     "1",
        "--log-level", "warn"};
    args.insert(args.end(), extra.begin(), extra.end());
    return SpawnWithWorkerEnv(std::move(args), env);
}

inline int WaitExit(pid_t pid) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
}

// Waits until the registry knows instance "test" (of tp 2), by registering as a worker of the
// wrong tp (refused, so no rank is taken).
inline bool InstanceDeclared(uint16_t port, const std::string& token) {
    return WaitFor([&] {
        const RegisterAckMessage ack =
            RegisterAs(port, {kAnyRank, 99, "test", kControlProtocolVersion, "", token});
        return ack.error.find("tp 99, but the instance has tp 2") != std::string::npos;
    });
}

inline bool RejectedWith(const WorkerRegistry& registry, const std::string& text) {
    for (const std::string& r : registry.rejections()) {
        if (r.find(text) != std::string::npos) return true;
    }
    return false;
}

}  // namespace kvshard::process_mode
