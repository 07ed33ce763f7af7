// Process mode end to end: the real `kvshard worker` processes, launched by the coordinator's
// launcher, registered with a WorkerRegistry and driven through a RemoteStepExecutor by the
// instance engine, on stories260K. Greedy outputs match the embedded TpGroup; a killed or frozen
// worker fails the in-flight requests with Unavailable and later ones at once; bad registrations
// (and those without the token) are refused with the reason, silent connections delay nobody;
// a killed or stopped worker is relaunched by the instance's supervisor and the instance serves
// again with a new epoch. tp 2 instances of independent worker processes (the direct launcher,
// or started by hand without --rank/--tp) meet through the coordinator and all-reduce over Gloo
// (skipped in builds without Gloo); the MPI cases need mpirun and skip without it.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/process_instance.h"
#include "comm/collective_store.h"
#include "comm/frame_channel.h"
#include "common/build_config.h"
#include "coordinator/engine.h"
#include "coordinator/remote_executor.h"
#include "tests/test_util.h"
#include "worker/local_model.h"
#include "worker/tp_group.h"

extern char** environ;

namespace kvshard {
namespace {

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

std::string KvshardBinary() {
    const std::string path = KVSHARD_CLI_BINARY;
    struct stat st {};
    return stat(path.c_str(), &st) == 0 ? path : "";
}

bool HaveMpirun() {
    if (!KVSHARD_WITH_MPI) return false;
    return std::system("mpirun --version > /dev/null 2>&1") == 0;
}

// Polls `condition` until it holds or a generous deadline passes (a regression fails instead of
// hanging; no test depends on how soon).
bool WaitFor(const std::function<bool()>& condition, milliseconds timeout = milliseconds(90'000)) {
    const auto deadline = SteadyClock::now() + timeout;
    while (!condition()) {
        if (SteadyClock::now() >= deadline) return false;
        std::this_thread::sleep_for(milliseconds(10));
    }
    return true;
}

// Gone and reaped: neither running nor a zombie (kill(pid, 0) succeeds on a zombie).
bool Reaped(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

// The "socket:[inode]" descriptors of a process.
std::set<std::string> SocketsOf(const std::string& pid) {
    std::set<std::string> out;
    const std::string dir_path = "/proc/" + pid + "/fd";
    DIR* dir = opendir(dir_path.c_str());
    if (dir == nullptr) return out;
    while (dirent* e = readdir(dir)) {
        char target[256];
        const std::string link = dir_path + "/" + e->d_name;
        const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
        if (n <= 0) continue;
        target[n] = '\0';
        if (std::string(target).rfind("socket:", 0) == 0) out.insert(target);
    }
    closedir(dir);
    return out;
}

// The children of `pid` (mpirun's ranks).
std::vector<pid_t> ChildrenOf(pid_t pid) {
    std::vector<pid_t> out;
    const std::string task_dir = "/proc/" + std::to_string(pid) + "/task";
    DIR* dir = opendir(task_dir.c_str());
    if (dir == nullptr) return out;
    while (dirent* e = readdir(dir)) {
        if (e->d_name[0] == '.') continue;
        std::ifstream in(task_dir + "/" + e->d_name + "/children");
        pid_t child = 0;
        while (in >> child) out.push_back(child);
    }
    closedir(dir);
    return out;
}

constexpr int64_t kBlocks = 256;
constexpr int64_t kBlockSize = 16;
constexpr int64_t kMaxContext = 512;

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

    std::string model_path_;
    std::string binary_;
    std::unique_ptr<LocalModel> model_;
};

TEST_F(ProcessModeTest, GreedyOutputsMatchTheEmbeddedGroup) {
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config(), Spec(1));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    RemoteStepExecutor& executor = (*instance)->executor();
    EXPECT_EQ(executor.num_kv_blocks(), std::vector<int64_t>{kBlocks});
    ASSERT_EQ(executor.kv_endpoints().size(), 1u);
    EXPECT_NE(executor.kv_endpoints()[0], "");  // the worker's TCP KV transport

    const auto remote = Run(executor);
    const auto embedded = EmbeddedReference();
    ASSERT_EQ(remote.size(), embedded.size());
    for (size_t i = 0; i < remote.size(); ++i) {
        EXPECT_FALSE(remote[i].empty());
        EXPECT_EQ(remote[i], embedded[i]) << "request " << i;
    }
    EXPECT_TRUE(executor.status().ok()) << executor.status().ToString();
}

// SIGSTOP first, so the request is certainly in flight (the engine waits on the frozen worker),
// then either SIGKILL (connection reset: noticed at once) or nothing (heartbeats stop: noticed
// after dead_after_ms).
struct FailureCase {
    const char* name;
    bool kill;
};

class ProcessModeFailureTest : public ProcessModeTest,
                               public ::testing::WithParamInterface<FailureCase> {};

TEST_P(ProcessModeFailureTest, InFlightRequestsFailWithUnavailableAndLaterOnesAtOnce) {
    const int64_t dead_after_ms = 1'000;
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config("direct", dead_after_ms), Spec(1));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    ASSERT_EQ((*instance)->worker_pids().size(), 1u);
    const pid_t worker = (*instance)->worker_pids().at(0);
    auto engine = Engine((*instance)->executor());

    auto sink = std::make_shared<Sink>();
    ASSERT_TRUE(engine->Submit(Request("long", "Once upon a time", 400, true), sink).ok());
    ASSERT_TRUE(sink->WaitFirstToken());
    ASSERT_EQ(kill(worker, SIGSTOP), 0);
    const auto stopped_at = SteadyClock::now();
    if (GetParam().kill) {
        ASSERT_EQ(kill(worker, SIGKILL), 0);
    }

    ASSERT_TRUE(sink->WaitDone(milliseconds(30'000))) << "the request hangs";
    const Status failed = sink->status();
    EXPECT_EQ(failed.code(), StatusCode::kUnavailable) << failed.ToString();
    // The client hears that the instance lost its workers; which rank and why is the
    // executor's (and the log's).
    const Status why = (*instance)->executor().status();
    EXPECT_NE(why.message().find("instance test: worker rank 0"), std::string::npos)
        << why.ToString();
    EXPECT_LT(sink->ids().size(), 400u);
    const auto detect_ms =
        std::chrono::duration_cast<milliseconds>(sink->finished_at() - stopped_at).count();
    // Loose bounds (a loaded machine): killed: the reset; frozen: dead_after_ms + a heartbeat.
    EXPECT_LT(detect_ms, GetParam().kill ? 5'000 : dead_after_ms + 5'000);
    std::printf("[ %s ] failure noticed after %lld ms\n", GetParam().name,
                static_cast<long long>(detect_ms));

    // Later submissions fail fast with the same error.
    auto later = std::make_shared<Sink>();
    const auto submitted_at = SteadyClock::now();
    const Status submitted = engine->Submit(Request("later", "The little dog", 8), later);
    if (submitted.ok()) {
        ASSERT_TRUE(later->WaitDone(milliseconds(10'000)));
        EXPECT_EQ(later->status().code(), StatusCode::kUnavailable);
        EXPECT_LT(
            std::chrono::duration_cast<milliseconds>(later->finished_at() - submitted_at).count(),
            2'000);
    } else {
        EXPECT_EQ(submitted.code(), StatusCode::kUnavailable);
    }
    EXPECT_EQ((*instance)->executor().status().code(), StatusCode::kUnavailable);
    // GET /health reports it (503 with this status).
    EXPECT_EQ(engine->Health().code(), StatusCode::kUnavailable) << engine->Health().ToString();
    engine->Stop();
    // restart_limit 0: the supervisor gave up at once and killed the worker, stopped or not.
    ASSERT_TRUE(WaitFor([&] { return (*instance)->gave_up(); }));
    EXPECT_TRUE(Reaped(worker));
}

INSTANTIATE_TEST_SUITE_P(Workers, ProcessModeFailureTest,
                         ::testing::Values(FailureCase{"killed", true},
                                           FailureCase{"frozen", false}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_F(ProcessModeTest, ALoadErrorNamesTheRankAndTheWorkersMessage) {
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config(), Spec(1, "/nonexistent/model.gguf"));
    ASSERT_FALSE(instance.ok());
    const std::string message = instance.status().message();
    EXPECT_NE(message.find("instance test: worker rank 0"), std::string::npos) << message;
    EXPECT_NE(message.find("failed to load"), std::string::npos) << message;
    EXPECT_NE(message.find("/nonexistent/model.gguf"), std::string::npos) << message;
}

TEST_F(ProcessModeTest, AWorkerThatExitsEarlyFailsStartupWithItsExitStatus) {
    // A "worker" that exits at once: startup reports its exit status rather than waiting for
    // register_timeout_ms.
    ServerConfig config = Config();
    cli::ProcessInstanceSpec spec = Spec(1);
    spec.worker_executable = "/bin/false";
    const auto started = SteadyClock::now();
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(config, spec);
    ASSERT_FALSE(instance.ok());
    EXPECT_NE(instance.status().message().find("exited: exit code 1"), std::string::npos)
        << instance.status().ToString();
    EXPECT_LT(std::chrono::duration_cast<milliseconds>(SteadyClock::now() - started).count(),
              30'000);
}

#if !KVSHARD_WITH_GLOO
TEST(ProcessModeConfigTest, TheDirectLauncherRefusesTensorParallelWorkersWithoutGloo) {
    Result<ServerConfig> c =
        ParseServerConfig("model: m\nworkers:\n  mode: processes\n  launcher: direct\n", "t.yaml");
    ASSERT_TRUE(c.ok());
    cli::ProcessInstanceSpec spec;
    spec.tp = 2;
    spec.model_path = "m";
    Result<std::unique_ptr<cli::ProcessInstance>> instance = cli::StartProcessInstance(*c, spec);
    ASSERT_FALSE(instance.ok());
    EXPECT_NE(instance.status().message().find("launcher: mpirun"), std::string::npos)
        << instance.status().ToString();
}
#endif

// ---- registration, with hand-made workers ----

RegisterAckMessage RegisterAs(uint16_t port, const RegisterMessage& reg,
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

constexpr const char* kToken = "registry-test-token";

WorkerRegistryOptions RegistryOptions() {
    WorkerRegistryOptions o;
    o.token = kToken;
    return o;
}

TEST(WorkerRegistryTest, RefusesBadRegistrationsWithTheReason) {
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(RegistryOptions());
    ASSERT_TRUE(registry.ok()) << registry.status().ToString();
    const uint16_t port = (*registry)->port();
    RemoteInstanceOptions o;
    o.instance_id = "a";
    o.tp = 2;
    o.model_path = "/models/m.gguf";
    o.settings = {{"block_size", "16"}};
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    EXPECT_FALSE((*registry)->AddInstance(o).ok()) << "the same id twice";

    std::unique_ptr<FrameChannel> rank0;
    const RegisterAckMessage ok =
        RegisterAs(port, {0, 2, "a", kControlProtocolVersion, "h:1", kToken}, &rank0);
    EXPECT_TRUE(ok.accepted) << ok.error;
    EXPECT_EQ(ok.model_path, "/models/m.gguf");
    EXPECT_EQ(ok.tp, 2);
    EXPECT_EQ(ok.settings, o.settings);

    struct Case {
        const char* name;
        RegisterMessage reg;
        const char* reason;
    };
    const std::vector<Case> cases = {
        {"unknown instance", {0, 2, "b", kControlProtocolVersion, "", kToken}, "unknown instance"},
        {"duplicate rank",
         {0, 2, "a", kControlProtocolVersion, "", kToken},
         "rank 0 already registered by 127.0.0.1:"},
        {"rank out of range", {2, 2, "a", kControlProtocolVersion, "", kToken}, "out of range"},
        {"negative rank", {-2, 2, "a", kControlProtocolVersion, "", kToken}, "out of range"},
        {"tp mismatch",
         {1, 4, "a", kControlProtocolVersion, "", kToken},
         "tp 4, but the instance has tp 2"},
        {"tp mismatch, rank left to the coordinator",
         {kAnyRank, 3, "a", kControlProtocolVersion, "", kToken},
         "tp 3, but the instance has tp 2"},
        {"another model",
         {1, 2, "a", kControlProtocolVersion, "", kToken, "other.gguf"},
         "model 'other.gguf', but the instance serves '/models/m.gguf'"},
        {"another model path",
         {1, kAnyTp, "a", kControlProtocolVersion, "", kToken, "/elsewhere/m.gguf"},
         "model '/elsewhere/m.gguf', but the instance serves '/models/m.gguf'"},
        {"old protocol", {1, 2, "a", 1, "", kToken}, "protocol version 1"},
        // Rank 1 is free: only the token is wrong.
        {"no token", {1, 2, "a", kControlProtocolVersion, "", ""}, "no token"},
        {"wrong token",
         {1, 2, "a", kControlProtocolVersion, "", "registry-test-tokeN"},
         "wrong token"},
        {"token prefix", {1, 2, "a", kControlProtocolVersion, "", "registry-test"}, "wrong token"},
        {"token and more",
         {1, 2, "a", kControlProtocolVersion, "", std::string(kToken) + "x"},
         "wrong token"},
    };
    for (const Case& c : cases) {
        const RegisterAckMessage ack = RegisterAs(port, c.reg);
        EXPECT_FALSE(ack.accepted) << c.name;
        EXPECT_NE(ack.error.find(c.reason), std::string::npos) << c.name << ": " << ack.error;
    }
    EXPECT_EQ((*registry)->rejections().size(), cases.size());

    // Rank 1 is still free; with both registered, a load error from rank 1 fails WaitReady.
    std::unique_ptr<FrameChannel> rank1;
    EXPECT_TRUE(
        RegisterAs(port, {1, 2, "a", kControlProtocolVersion, "h:2", kToken}, &rank1).accepted);
    EXPECT_EQ((*executor)->kv_endpoints(), (std::vector<std::string>{"h:1", "h:2"}));
    ASSERT_TRUE(rank0->Send(ReadyMessage{true, "", 64}).ok());
    ASSERT_TRUE(rank1->Send(ReadyMessage{false, "out of memory", 0}).ok());
    const Status ready = (*executor)->WaitReady(milliseconds(10'000));
    EXPECT_EQ(ready.code(), StatusCode::kUnavailable);
    EXPECT_NE(ready.message().find("instance a: worker rank 1"), std::string::npos)
        << ready.ToString();
    EXPECT_NE(ready.message().find("out of memory"), std::string::npos) << ready.ToString();
    // Failed for good: Execute answers at once.
    EXPECT_EQ((*executor)->Execute(StepPlan{}).status().code(), StatusCode::kUnavailable);
}

TEST(WorkerRegistryTest, WaitReadyNamesTheMissingRanksAtTheDeadline) {
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(RegistryOptions());
    ASSERT_TRUE(registry.ok());
    RemoteInstanceOptions o;
    o.instance_id = "x";
    o.tp = 3;
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    std::unique_ptr<FrameChannel> rank1;
    ASSERT_TRUE(
        RegisterAs((*registry)->port(), {1, 3, "x", kControlProtocolVersion, "", kToken}, &rank1)
            .accepted);
    const Status ready = (*executor)->WaitReady(milliseconds(300));
    EXPECT_EQ(ready.code(), StatusCode::kDeadlineExceeded);
    EXPECT_NE(ready.message().find("ranks not registered: 0, 2"), std::string::npos)
        << ready.ToString();
    EXPECT_NE(ready.message().find("registered but not ready: 1"), std::string::npos)
        << ready.ToString();
}

// Workers that leave the rank (and tp) to the coordinator get the lowest free ranks, the
// instance's tp, and, until the instance is formed, the formation's rendezvous store.
TEST(WorkerRegistryTest, AssignsTheLowestFreeRankAndServesTheRendezvousStore) {
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(RegistryOptions());
    ASSERT_TRUE(registry.ok());
    const uint16_t port = (*registry)->port();
    RemoteInstanceOptions o;
    o.instance_id = "s";
    o.tp = 3;
    o.model_path = "/models/m.gguf";
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    std::unique_ptr<FrameChannel> ranks[3];
    const RegisterAckMessage one =
        RegisterAs(port, {1, 3, "s", kControlProtocolVersion, "h:1", kToken}, &ranks[1]);
    ASSERT_TRUE(one.accepted) << one.error;
    EXPECT_EQ(one.rank, 1);
    const RegisterAckMessage zero = RegisterAs(
        port, {kAnyRank, kAnyTp, "s", kControlProtocolVersion, "h:0", kToken, "m.gguf"}, &ranks[0]);
    ASSERT_TRUE(zero.accepted) << zero.error;
    EXPECT_EQ(zero.rank, 0);
    EXPECT_EQ(zero.tp, 3);
    const RegisterAckMessage two = RegisterAs(
        port, {kAnyRank, kAnyTp, "s", kControlProtocolVersion, "h:2", kToken, "/models/m.gguf"},
        &ranks[2]);
    ASSERT_TRUE(two.accepted) << two.error;
    EXPECT_EQ(two.rank, 2);
    const RegisterAckMessage full =
        RegisterAs(port, {kAnyRank, kAnyTp, "s", kControlProtocolVersion, "", kToken});
    EXPECT_FALSE(full.accepted);
    EXPECT_NE(full.error.find("no free rank: all 3 ranks are registered"), std::string::npos)
        << full.error;
    EXPECT_EQ((*executor)->kv_endpoints(), (std::vector<std::string>{"h:0", "h:1", "h:2"}));

    // WaitReady answers the store while it waits for the Ready messages.
    Status ready = Internal("not done");
    std::thread waiter([&] { ready = (*executor)->WaitReady(milliseconds(20'000)); });
    auto ask = [&](int rank, const StoreRequestMessage& request) -> StoreReplyMessage {
        EXPECT_TRUE(ranks[rank]->Send(request).ok());
        Result<Message> answer = ranks[rank]->Receive(SteadyClock::now() + milliseconds(10'000));
        EXPECT_TRUE(answer.ok()) << answer.status().ToString();
        if (!answer.ok()) return {};
        const auto* reply = std::get_if<StoreReplyMessage>(&*answer);
        EXPECT_NE(reply, nullptr);
        return reply != nullptr ? *reply : StoreReplyMessage{};
    };
    EXPECT_FALSE(ask(2, {false, "0", ""}).found);  // not set yet: answered at once
    EXPECT_TRUE(ask(0, {true, "0", std::string("addr\0of rank 0", 14)}).error.empty());
    const StoreReplyMessage got = ask(2, {false, "0", ""});
    EXPECT_TRUE(got.found);
    EXPECT_EQ(got.value, std::string("addr\0of rank 0", 14));
    // The store's bounds hold for what a worker sends.
    const StoreReplyMessage big =
        ask(1, {true, "big", std::string(kMaxCollectiveStoreValueBytes + 1, 'x')});
    EXPECT_NE(big.error.find("at most"), std::string::npos) << big.error;
    EXPECT_FALSE(ask(1, {false, "big", ""}).found);
    EXPECT_NE(ask(1, {false, "", ""}).error, "");

    for (int r = 0; r < 3; ++r) ASSERT_TRUE(ranks[r]->Send(ReadyMessage{true, "", 8}).ok());
    waiter.join();
    EXPECT_TRUE(ready.ok()) << ready.ToString();
}

// A serve config with external workers presenting kToken (the registry given to the cli::
// functions is the one used, whatever the port says).
Result<ServerConfig> ExternalWorkersConfig(int64_t register_timeout_ms) {
    return ParseServerConfig(
        std::string("model: /models/m.gguf\nlog_level: warn\nworkers:\n  mode: processes\n"
                    "  launcher: external\n  port: 1\n  token: ") +
            kToken + "\n  register_timeout_ms: " + std::to_string(register_timeout_ms) + "\n",
        "test.yaml");
}

// `kvshard serve`'s way of starting process instances (DeclareProcessInstances, then
// FormProcessInstances): every instance of the config is known to the registry before any
// formation waits, so the workers of a later instance may register first, and that instance
// forms while an earlier one still waits for its own; a worker naming an instance the config
// lacks is still refused, naming it.
TEST(WorkerRegistryTest, EveryInstanceIsDeclaredBeforeAnyFormationWaits) {
    Result<std::unique_ptr<WorkerRegistry>> started = WorkerRegistry::Start(RegistryOptions());
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    std::shared_ptr<WorkerRegistry> registry = std::move(*started);
    const uint16_t port = registry->port();
    Result<ServerConfig> config = ExternalWorkersConfig(60'000);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    std::vector<cli::ProcessInstanceSpec> specs(2);
    specs[0].instance_id = "prefill";
    specs[1].instance_id = "decode";
    for (cli::ProcessInstanceSpec& spec : specs) spec.model_path = "/models/m.gguf";
    Result<std::vector<cli::DeclaredProcessInstance>> declared =
        cli::DeclareProcessInstances(*config, specs, registry);
    ASSERT_TRUE(declared.ok()) << declared.status().ToString();
    RemoteStepExecutor* prefill = (*declared)[0].executor.get();
    RemoteStepExecutor* decode = (*declared)[1].executor.get();
    Result<std::vector<std::unique_ptr<cli::ProcessInstance>>> formed = Internal("not formed");
    std::thread forming(
        [&] { formed = cli::FormProcessInstances(*config, specs, std::move(*declared)); });

    // The decode instance's worker first, while the prefill instance waits for its own.
    std::unique_ptr<FrameChannel> decode_worker, prefill_worker;
    const RegisterAckMessage decode_ack = RegisterAs(
        port, {kAnyRank, kAnyTp, "decode", kControlProtocolVersion, "h:2", kToken}, &decode_worker);
    ASSERT_TRUE(decode_ack.accepted) << decode_ack.error;
    ASSERT_TRUE(decode_worker->Send(ReadyMessage{true, "", 8}).ok());
    EXPECT_TRUE(WaitFor([&] { return decode->epoch() == 1; }));
    EXPECT_EQ(prefill->epoch(), 0u);
    // An instance the config does not have is refused by name.
    const RegisterAckMessage stranger =
        RegisterAs(port, {kAnyRank, kAnyTp, "mixed", kControlProtocolVersion, "", kToken});
    EXPECT_FALSE(stranger.accepted);
    EXPECT_NE(stranger.error.find("'mixed'"), std::string::npos) << stranger.error;
    EXPECT_NE(stranger.error.find("unknown instance (the coordinator expects 'decode', 'prefill')"),
              std::string::npos)
        << stranger.error;

    const RegisterAckMessage prefill_ack =
        RegisterAs(port, {kAnyRank, kAnyTp, "prefill", kControlProtocolVersion, "h:1", kToken},
                   &prefill_worker);
    ASSERT_TRUE(prefill_ack.accepted) << prefill_ack.error;
    ASSERT_TRUE(prefill_worker->Send(ReadyMessage{true, "", 8}).ok());
    forming.join();
    ASSERT_TRUE(formed.ok()) << formed.status().ToString();
    ASSERT_EQ(formed->size(), 2u);
    EXPECT_EQ((*formed)[0]->executor().instance_id(), "prefill");
    EXPECT_EQ((*formed)[1]->executor().instance_id(), "decode");
    EXPECT_TRUE((*formed)[0]->executor().Health().ok());
    EXPECT_TRUE((*formed)[1]->executor().Health().ok());
}

// One instance that cannot form (its worker reports a load error) ends the others' waiting at
// once, and the error names it.
TEST(WorkerRegistryTest, AnInstanceThatFailsToFormEndsTheOthersWaiting) {
    Result<std::unique_ptr<WorkerRegistry>> started = WorkerRegistry::Start(RegistryOptions());
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    std::shared_ptr<WorkerRegistry> registry = std::move(*started);
    Result<ServerConfig> config = ExternalWorkersConfig(600'000);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    std::vector<cli::ProcessInstanceSpec> specs(2);
    specs[0].instance_id = "waits";
    specs[1].instance_id = "broken";
    Result<std::vector<cli::DeclaredProcessInstance>> declared =
        cli::DeclareProcessInstances(*config, specs, registry);
    ASSERT_TRUE(declared.ok()) << declared.status().ToString();
    Result<std::vector<std::unique_ptr<cli::ProcessInstance>>> formed = Internal("not formed");
    std::thread forming(
        [&] { formed = cli::FormProcessInstances(*config, specs, std::move(*declared)); });
    std::unique_ptr<FrameChannel> worker;
    ASSERT_TRUE(RegisterAs(registry->port(),
                           {0, 1, "broken", kControlProtocolVersion, "h:1", kToken}, &worker)
                    .accepted);
    ASSERT_TRUE(worker->Send(ReadyMessage{false, "cannot read the weights", 0}).ok());
    forming.join();  // long before the 10-minute register_timeout_ms of "waits"
    ASSERT_FALSE(formed.ok());
    EXPECT_NE(formed.status().message().find("broken"), std::string::npos)
        << formed.status().ToString();
    EXPECT_NE(formed.status().message().find("cannot read the weights"), std::string::npos)
        << formed.status().ToString();
}

// The NCCL bootstrap goes only to instances whose ranks are all on GPUs of their own, tp > 1, in
// CUDA builds.
TEST(ProcessModeConfigTest, OnlyGpuInstancesOfTensorParallelRanksGetAnNcclBootstrap) {
    struct Case {
        int tp;
        std::vector<std::string> devices;
        bool cuda_build, nccl;
    };
    const Case cases[] = {
        {2, {"0", "1"}, true, true},
        {4, {"0", "1", "2", "3"}, true, true},
        {2, {"0", "1"}, false, false},
        {1, {"0"}, true, false},
        {2, {"cpu", "cpu"}, true, false},
        {2, {"0", "cpu"}, true, false},
        {2, {"0", "0"}, true, false},  // ranks sharing a GPU stage through the host
        {2, {}, true, false},
    };
    for (const Case& c : cases) {
        cli::ProcessInstanceSpec spec;
        spec.tp = c.tp;
        spec.devices = c.devices;
        EXPECT_EQ(cli::UsesNcclBootstrap(spec, c.cuda_build), c.nccl)
            << "tp " << c.tp << ", " << c.devices.size() << " devices, cuda " << c.cuda_build;
    }
    cli::ProcessInstanceSpec gpus;
    gpus.tp = 2;
    gpus.devices = {"0", "1"};
    EXPECT_EQ(cli::UsesNcclBootstrap(gpus), static_cast<bool>(KVSHARD_WITH_CUDA));
}

// Silent connections (a port scanner, a stuck client) each hold only their own handshake: a real
// worker registers while they are all still open, long before their deadline.
TEST(WorkerRegistryTest, SilentConnectionsDoNotDelayARegistration) {
    WorkerRegistryOptions ro = RegistryOptions();
    ro.register_message_timeout_ms = 120'000;  // far beyond RegisterAs's 10 s wait
    ro.channel.heartbeat_interval_ms = 1'000;
    ro.channel.dead_after_ms = 120'000;
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(ro);
    ASSERT_TRUE(registry.ok()) << registry.status().ToString();
    RemoteInstanceOptions o;
    o.instance_id = "a";
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    std::vector<std::unique_ptr<FrameChannel>> silent;
    for (int i = 0; i < 20; ++i) {
        Result<std::unique_ptr<FrameChannel>> c =
            ConnectFrameChannel("127.0.0.1", (*registry)->port(), milliseconds(5'000));
        ASSERT_TRUE(c.ok()) << c.status().ToString();
        silent.push_back(std::move(*c));
    }
    std::unique_ptr<FrameChannel> worker;
    const RegisterAckMessage ack = RegisterAs(
        (*registry)->port(), {0, 1, "a", kControlProtocolVersion, "h:1", kToken}, &worker);
    EXPECT_TRUE(ack.accepted) << ack.error;
    EXPECT_TRUE((*registry)->rejections().empty());
    for (auto& c : silent) EXPECT_TRUE(c->status().ok()) << "dropped before its deadline";
}

TEST(WorkerRegistryTest, RefusesConnectionsBeyondThePendingHandshakeCap) {
    WorkerRegistryOptions ro = RegistryOptions();
    ro.register_message_timeout_ms = 120'000;
    ro.max_pending_handshakes = 3;
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(ro);
    ASSERT_TRUE(registry.ok());
    std::vector<std::unique_ptr<FrameChannel>> silent;
    for (int i = 0; i < 3; ++i) {
        Result<std::unique_ptr<FrameChannel>> c =
            ConnectFrameChannel("127.0.0.1", (*registry)->port(), milliseconds(5'000));
        ASSERT_TRUE(c.ok());
        silent.push_back(std::move(*c));
    }
    // The 4th is answered at once, before it sends anything (the cap counts only once the three
    // were accepted, hence the retries). It only listens: the registry closes a refused
    // connection right after its answer, and a Register written into that closed connection
    // would reset it, and with it the unread answer, when the reset comes first.
    ASSERT_TRUE(WaitFor([&] {
        Result<std::unique_ptr<FrameChannel>> c =
            ConnectFrameChannel("127.0.0.1", (*registry)->port(), milliseconds(5'000));
        if (!c.ok()) return false;
        Result<Message> answer = (*c)->Receive(SteadyClock::now() + milliseconds(2'000));
        const auto* ack = answer.ok() ? std::get_if<RegisterAckMessage>(&*answer) : nullptr;
        return ack != nullptr && !ack->accepted &&
               ack->error.find("too many connections") != std::string::npos;
    }));
}

// A worker process holds no socket of the coordinator: not the registry's listener, not another
// worker's connection.
TEST_F(ProcessModeTest, WorkersInheritNoSocketOfTheCoordinator) {
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config(), Spec(1));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    ASSERT_EQ((*instance)->worker_pids().size(), 1u);
    const std::set<std::string> ours = SocketsOf("self");
    const std::set<std::string> theirs = SocketsOf(std::to_string((*instance)->worker_pids()[0]));
    EXPECT_FALSE(theirs.empty());  // its own connection and KV listener
    for (const std::string& s : theirs) EXPECT_EQ(ours.count(s), 0u) << s << " is shared";
}

// ---- recovery: the supervisor relaunches dead workers and the instance re-forms ----

struct IdleFailureCase {
    const char* name;
    int signal;
};

class ProcessModeRecoveryTest : public ProcessModeTest,
                                public ::testing::WithParamInterface<IdleFailureCase> {};

TEST_P(ProcessModeRecoveryTest, AnIdleWorkerThatDiesIsRelaunchedAndStepsRunAgain) {
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config("direct", 1'000, /*restart_limit=*/3), Spec(1));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    RemoteStepExecutor& executor = (*instance)->executor();
    ASSERT_TRUE(executor.Health().ok()) << executor.Health().ToString();
    EXPECT_EQ(executor.epoch(), 1u);
    const pid_t old_worker = (*instance)->worker_pids().at(0);

    // No step runs: only the channel's heartbeats (or its reset) can tell.
    ASSERT_EQ(kill(old_worker, GetParam().signal), 0);
    ASSERT_TRUE(WaitFor([&] { return !executor.Health().ok() || executor.epoch() > 1; }))
        << "Health stayed OK";
    // Re-formed with a new worker process; the old one killed (stopped or not) and reaped.
    // (restarts() counts once Reform returned, a moment after the epoch changed.)
    ASSERT_TRUE(WaitFor([&] {
        return executor.Health().ok() && executor.epoch() == 2 && (*instance)->restarts() == 1;
    })) << executor.Health().ToString()
        << "; last failure " << (*instance)->last_failure().ToString();
    EXPECT_FALSE((*instance)->gave_up());
    EXPECT_NE((*instance)->last_failure().message().find("worker rank 0"), std::string::npos)
        << (*instance)->last_failure().ToString();
    EXPECT_TRUE(Reaped(old_worker)) << "pid " << old_worker;
    ASSERT_EQ((*instance)->worker_pids().size(), 1u);
    EXPECT_NE((*instance)->worker_pids()[0], old_worker);
    ASSERT_EQ(executor.kv_endpoints().size(), 1u);
    EXPECT_NE(executor.kv_endpoints()[0], "");  // the new worker's KV transport

    // Steps run again, with the same greedy outputs.
    EXPECT_EQ(Run(executor), EmbeddedReference());
    EXPECT_TRUE(executor.Health().ok()) << executor.Health().ToString();
}

INSTANTIATE_TEST_SUITE_P(Workers, ProcessModeRecoveryTest,
                         ::testing::Values(IdleFailureCase{"killed", SIGKILL},
                                           IdleFailureCase{"stopped", SIGSTOP}),
                         [](const auto& info) { return std::string(info.param.name); });

// The engine keeps running through the failure: the request in flight fails, the instance is
// down (engine Health non-OK), the supervisor re-forms it, and the same engine serves again with
// the tokens it gave before (its prefix cache forgotten: the new workers' pools are empty).
TEST_F(ProcessModeTest, TheSameEngineServesAgainAfterItsWorkerIsRelaunched) {
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config("direct", 1'000, /*restart_limit=*/3), Spec(1));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    RemoteStepExecutor& executor = (*instance)->executor();
    auto engine = Engine(executor);
    const auto before = RunOn(*engine, "before");  // also fills the prefix cache

    auto sink = std::make_shared<Sink>();
    ASSERT_TRUE(engine->Submit(Request("long", "Once upon a time", 400, true), sink).ok());
    ASSERT_TRUE(sink->WaitFirstToken());
    ASSERT_EQ(kill((*instance)->worker_pids().at(0), SIGKILL), 0);
    ASSERT_TRUE(sink->WaitDone(milliseconds(30'000))) << "the request hangs";
    EXPECT_EQ(sink->status().code(), StatusCode::kUnavailable) << sink->status().ToString();

    ASSERT_TRUE(WaitFor([&] { return executor.Health().ok() && executor.epoch() == 2; }))
        << executor.Health().ToString();
    ASSERT_TRUE(WaitFor([&] { return engine->Health().ok(); })) << engine->Health().ToString();
    EXPECT_EQ(RunOn(*engine, "after"), before);
    EXPECT_EQ(before, EmbeddedReference());
    engine->Stop();
}

// External workers (started by hand): one without the token is refused and exits; one with
// --token-file registers; killed, its replacement's registration re-forms the instance.
TEST_F(ProcessModeTest, ExternalWorkersNeedTheTokenAndTheirReplacementReformsTheInstance) {
    const std::string token = "external-test-token";
    const std::string token_file = (std::filesystem::temp_directory_path() /
                                    ("kvshard-token-" + std::to_string(getpid()) + ".txt"))
                                       .string();
    {
        std::ofstream out(token_file);
        out << token << "\n";
    }
    WorkerRegistryOptions ro;
    ro.token = token;
    ro.channel.heartbeat_interval_ms = 200;
    ro.channel.dead_after_ms = 1'000;
    Result<std::unique_ptr<WorkerRegistry>> started = WorkerRegistry::Start(ro);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    std::shared_ptr<WorkerRegistry> registry = std::move(*started);
    // The environment without any KVSHARD_WORKER_TOKEN of the test's own.
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
        if (std::string_view(*e).rfind("KVSHARD_WORKER_TOKEN=", 0) != 0) env_strings.push_back(*e);
    }
    std::vector<char*> envp;
    for (std::string& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    auto spawn = [&](bool with_token) {
        std::vector<std::string> args = {
            binary_,           "worker",
            "--coordinator",   "127.0.0.1:" + std::to_string(registry->port()),
            "--instance",      "test",
            "--heartbeat-ms",  "200",
            "--dead-after-ms", "1000",
            "--log-level",     "warn"};
        if (with_token) args.insert(args.end(), {"--token-file", token_file});
        std::vector<char*> argv;
        for (std::string& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        pid_t pid = -1;
        EXPECT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()), 0);
        return pid;
    };
    auto wait_exit = [](pid_t pid) {
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        return status;
    };

    // external needs a fixed port and the token; the registry given below is the one used.
    Result<ServerConfig> parsed = ParseServerConfig(
        "model: " + model_path_ +
            "\nlog_level: warn\nworkers:\n  mode: processes\n  launcher: external\n  port: "
            "1\n  token: " +
            token +
            "\n  heartbeat_interval_ms: 200\n  dead_after_ms: 1000\n  register_timeout_ms: "
            "60000\n  restart_limit: 2\n  restart_backoff_ms: 100\n",
        "test.yaml");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    const ServerConfig config = *parsed;
    Result<std::unique_ptr<cli::ProcessInstance>> instance = Internal("not started");
    std::thread start([&] { instance = cli::StartProcessInstance(config, Spec(1), registry); });

    const pid_t refused = spawn(false);
    const int refused_status = wait_exit(refused);
    EXPECT_TRUE(WIFEXITED(refused_status) && WEXITSTATUS(refused_status) != 0) << refused_status;
    const pid_t first = spawn(true);
    start.join();
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    bool saw_no_token = false;
    for (const std::string& r : registry->rejections()) {
        saw_no_token = saw_no_token || r.find("no token") != std::string::npos;
    }
    EXPECT_TRUE(saw_no_token);
    RemoteStepExecutor& executor = (*instance)->executor();
    EXPECT_EQ(executor.epoch(), 1u);
    EXPECT_TRUE((*instance)->worker_pids().empty());  // none of its own

    ASSERT_EQ(kill(first, SIGKILL), 0);
    wait_exit(first);
    ASSERT_TRUE(WaitFor([&] { return !executor.Health().ok(); }));
    const pid_t second = spawn(true);
    ASSERT_TRUE(WaitFor([&] {
        return executor.Health().ok() && executor.epoch() == 2 && (*instance)->restarts() == 1;
    })) << executor.Health().ToString();
    EXPECT_EQ(Run(executor), EmbeddedReference());
    instance->reset();  // tells the worker to shut down
    const int second_status = wait_exit(second);
    EXPECT_TRUE(WIFEXITED(second_status) && WEXITSTATUS(second_status) == 0) << second_status;
    std::filesystem::remove(token_file);
}

// The relaunched workers cannot load (the model is gone): after restart_limit failed attempts the
// supervisor gives up, says so, and leaves no worker behind.
TEST_F(ProcessModeTest, TheSupervisorGivesUpAfterRestartLimitFailedAttempts) {
    const std::string model = (std::filesystem::temp_directory_path() /
                               ("kvshard-gives-up-" + std::to_string(getpid()) + ".bin"))
                                  .string();
    std::filesystem::copy_file(model_path_, model,
                               std::filesystem::copy_options::overwrite_existing);
    std::atomic<int> gave_up_calls{0};
    cli::ProcessInstanceSpec spec = Spec(1, model);
    spec.worker.tokenizer_path =
        (std::filesystem::path(model_path_).parent_path() / "tok512.bin").string();
    spec.on_gave_up = [&](const Status&) { gave_up_calls.fetch_add(1); };
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config("direct", 1'000, /*restart_limit=*/2), spec);
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    std::filesystem::remove(model);
    const pid_t worker = (*instance)->worker_pids().at(0);
    ASSERT_EQ(kill(worker, SIGKILL), 0);
    // gave_up() turns true just before the callback runs.
    ASSERT_TRUE(WaitFor([&] { return (*instance)->gave_up() && gave_up_calls.load() > 0; }));
    EXPECT_EQ(gave_up_calls.load(), 1);
    EXPECT_EQ((*instance)->failed_restarts(), 2);
    EXPECT_EQ((*instance)->restarts(), 0);
    // The worker's Ready{error} or, when its exit is seen first, its exit status.
    const std::string last = (*instance)->last_failure().message();
    EXPECT_TRUE(last.find("failed to load") != std::string::npos ||
                last.find("exited: exit code") != std::string::npos)
        << last;
    EXPECT_FALSE((*instance)->executor().Health().ok());
    EXPECT_TRUE((*instance)->worker_pids().empty());
    EXPECT_TRUE(Reaped(worker));
}

// A re-registering worker is accepted once the instance re-forms (external workers' way back).
TEST(WorkerRegistryTest, AFailedInstanceTakesNewRegistrationsWhenReforming) {
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(RegistryOptions());
    ASSERT_TRUE(registry.ok());
    const uint16_t port = (*registry)->port();
    RemoteInstanceOptions o;
    o.instance_id = "e";
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    RemoteStepExecutor& ex = **executor;
    std::unique_ptr<FrameChannel> worker;
    ASSERT_TRUE(
        RegisterAs(port, {0, 1, "e", kControlProtocolVersion, "h:1", kToken}, &worker).accepted);
    ASSERT_TRUE(worker->Send(ReadyMessage{true, "", 8}).ok());
    ASSERT_TRUE(ex.WaitReady(milliseconds(10'000)).ok());
    EXPECT_TRUE(ex.Health().ok());
    EXPECT_EQ(ex.epoch(), 1u);

    worker->Close();  // the worker dies
    ASSERT_TRUE(WaitFor([&] { return !ex.Health().ok(); }));
    EXPECT_NE(ex.Health().message().find("instance e: worker rank 0 (127.0.0.1:"),
              std::string::npos)
        << ex.Health().ToString();
    EXPECT_EQ(ex.Execute(StepPlan{}).status().code(), StatusCode::kUnavailable);
    // Failed and not re-forming yet (the supervisor's restart backoff): a replacement that
    // registers now is held, not refused, and taken once the re-form opens the ranks. Before,
    // it was refused, and an external worker arriving in the backoff was lost (a CI run saw it).
    std::unique_ptr<FrameChannel> replacement;
    RegisterAckMessage held;
    std::thread early([&] {
        held = RegisterAs(port, {0, 1, "e", kControlProtocolVersion, "h:3", kToken}, &replacement);
    });
    std::this_thread::sleep_for(milliseconds(300));  // the backoff, as the supervisor waits it
    ex.BeginReform("test");
    EXPECT_NE(ex.Health().message().find("re-forming"), std::string::npos);
    early.join();
    ASSERT_TRUE(held.accepted) << held.error;
    EXPECT_EQ(ex.Execute(StepPlan{}).status().code(), StatusCode::kUnavailable);
    ASSERT_TRUE(replacement->Send(ReadyMessage{true, "", 16}).ok());
    ASSERT_TRUE(ex.Reform(milliseconds(10'000)).ok());
    EXPECT_TRUE(ex.Health().ok()) << ex.Health().ToString();
    EXPECT_EQ(ex.epoch(), 2u);
    EXPECT_EQ(ex.kv_endpoints(), std::vector<std::string>{"h:3"});
    EXPECT_EQ(ex.num_kv_blocks(), std::vector<int64_t>{16});
}

// An instance that failed and is not re-formed (no supervisor, or its restart limit spent)
// refuses a held registration once the handshake's time is up, naming why.
TEST(WorkerRegistryTest, ARegistrationHeldForAReformThatNeverComesIsRefused) {
    WorkerRegistryOptions options = RegistryOptions();
    options.register_message_timeout_ms = 400;
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(options);
    ASSERT_TRUE(registry.ok());
    const uint16_t port = (*registry)->port();
    RemoteInstanceOptions o;
    o.instance_id = "f";
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    RemoteStepExecutor& ex = **executor;
    std::unique_ptr<FrameChannel> worker;
    ASSERT_TRUE(
        RegisterAs(port, {0, 1, "f", kControlProtocolVersion, "h:1", kToken}, &worker).accepted);
    ASSERT_TRUE(worker->Send(ReadyMessage{true, "", 8}).ok());
    ASSERT_TRUE(ex.WaitReady(milliseconds(10'000)).ok());
    worker->Close();
    ASSERT_TRUE(WaitFor([&] { return !ex.Health().ok(); }));

    const auto start = SteadyClock::now();
    const RegisterAckMessage late =
        RegisterAs(port, {0, 1, "f", kControlProtocolVersion, "h:2", kToken});
    EXPECT_FALSE(late.accepted);
    EXPECT_NE(late.error.find("not re-forming"), std::string::npos) << late.error;
    EXPECT_GE(SteadyClock::now() - start, milliseconds(350));  // held for the handshake's time
}

// ---- Gloo: tp 2 worker processes that meet through the coordinator ----

// `kvshard worker` for `port` and instance "test", started by hand (no launcher): the test's
// environment without its own KVSHARD_WORKER_TOKEN, plus `env`.
pid_t SpawnWorker(const std::string& binary, uint16_t port, std::vector<std::string> extra,
                  const std::vector<std::string>& env) {
    std::vector<std::string> args = {
        binary,        "worker", "--coordinator", "127.0.0.1:" + std::to_string(port),
        "--instance",  "test",   "--threads",     "1",
        "--log-level", "warn"};
    args.insert(args.end(), extra.begin(), extra.end());
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

int WaitExit(pid_t pid) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
}

// Waits until the registry knows instance "test" (of tp 2), by registering as a worker of the
// wrong tp (refused, so no rank is taken).
bool InstanceDeclared(uint16_t port, const std::string& token) {
    return WaitFor([&] {
        const RegisterAckMessage ack =
            RegisterAs(port, {kAnyRank, 99, "test", kControlProtocolVersion, "", token});
        return ack.error.find("tp 99, but the instance has tp 2") != std::string::npos;
    });
}

bool RejectedWith(const WorkerRegistry& registry, const std::string& text) {
    for (const std::string& r : registry.rejections()) {
        if (r.find(text) != std::string::npos) return true;
    }
    return false;
}

// The coordinator's own direct launcher starts tp independent processes (no mpirun): the same
// greedy tokens as the embedded tp 1 group.
TEST_F(ProcessModeTest, GlooTp2DirectWorkersGiveTheSameTokens) {
    if (!KVSHARD_WITH_GLOO) GTEST_SKIP() << "built without Gloo";
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config("direct"), Spec(2));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    EXPECT_EQ((*instance)->worker_pids().size(), 2u);
    EXPECT_EQ((*instance)->executor().kv_endpoints().size(), 2u);
    const auto remote = Run((*instance)->executor());
    const auto embedded = EmbeddedReference();
    ASSERT_EQ(remote.size(), embedded.size());
    for (size_t i = 0; i < remote.size(); ++i) {
        EXPECT_FALSE(remote[i].empty());
        EXPECT_EQ(remote[i], embedded[i]) << "request " << i;
    }
}

// Workers started by hand with neither --rank nor --tp (one with a LeaderWorkerSet index, one
// without): the coordinator assigns the ranks and the tp, and the instance gives the tokens of
// tp 1. A worker that says another tp, or claims a rank that is taken, is refused with the
// numbers and exits non-zero.
TEST_F(ProcessModeTest, GlooTp2ExternalWorkersGetRanksFromTheCoordinator) {
    if (!KVSHARD_WITH_GLOO) GTEST_SKIP() << "built without Gloo";
    const std::string token = "gloo-external-token";
    WorkerRegistryOptions ro;
    ro.token = token;
    ro.channel.heartbeat_interval_ms = 200;
    ro.channel.dead_after_ms = 2'000;
    Result<std::unique_ptr<WorkerRegistry>> started = WorkerRegistry::Start(ro);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    std::shared_ptr<WorkerRegistry> registry = std::move(*started);
    Result<ServerConfig> parsed = ParseServerConfig(
        "model: " + model_path_ +
            "\nlog_level: warn\nworkers:\n  mode: processes\n  launcher: external\n  port: 1\n"
            "  token: " +
            token +
            "\n  heartbeat_interval_ms: 200\n  dead_after_ms: 2000\n  register_timeout_ms: "
            "60000\n  restart_limit: 0\n",
        "test.yaml");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    const ServerConfig config = *parsed;
    Result<std::unique_ptr<cli::ProcessInstance>> instance = Internal("not started");
    std::thread start([&] { instance = cli::StartProcessInstance(config, Spec(2), registry); });

    const std::string token_env = "KVSHARD_WORKER_TOKEN=" + token;
    ASSERT_TRUE(InstanceDeclared(registry->port(), token));
    const pid_t wrong_tp = SpawnWorker(binary_, registry->port(), {"--tp", "3"}, {token_env});
    const int wrong_tp_status = WaitExit(wrong_tp);
    EXPECT_TRUE(WIFEXITED(wrong_tp_status) && WEXITSTATUS(wrong_tp_status) != 0);
    const pid_t indexed =
        SpawnWorker(binary_, registry->port(), {}, {token_env, "LWS_WORKER_INDEX=1"});
    const pid_t assigned = SpawnWorker(binary_, registry->port(), {}, {token_env});
    start.join();
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    EXPECT_TRUE(RejectedWith(*registry, "tp 3, but the instance has tp 2"));

    const pid_t duplicate = SpawnWorker(binary_, registry->port(), {"--rank", "1"}, {token_env});
    const int duplicate_status = WaitExit(duplicate);
    EXPECT_TRUE(WIFEXITED(duplicate_status) && WEXITSTATUS(duplicate_status) != 0);
    EXPECT_TRUE(RejectedWith(*registry, "instance 'test' rank 1: the instance is formed"));

    EXPECT_EQ(Run((*instance)->executor()), EmbeddedReference());
    instance->reset();  // tells the workers to shut down
    for (pid_t p : {indexed, assigned}) {
        const int status = WaitExit(p);
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    }
}

// A rank that never comes: the instance does not form, within workers.register_timeout_ms, and
// the error names the missing rank (the registered one's rendezvous waits longer).
TEST_F(ProcessModeTest, GlooTp2InstanceWithAMissingRankFailsNamingIt) {
    if (!KVSHARD_WITH_GLOO) GTEST_SKIP() << "built without Gloo";
    const std::string token = "gloo-missing-token";
    WorkerRegistryOptions ro;
    ro.token = token;
    Result<std::unique_ptr<WorkerRegistry>> started = WorkerRegistry::Start(ro);
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    std::shared_ptr<WorkerRegistry> registry = std::move(*started);
    Result<ServerConfig> parsed = ParseServerConfig(
        "model: " + model_path_ +
            "\nlog_level: warn\nworkers:\n  mode: processes\n  launcher: external\n  port: 1\n"
            "  token: " +
            token + "\n  register_timeout_ms: 8000\n  restart_limit: 0\n",
        "test.yaml");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    const auto began = SteadyClock::now();
    Result<std::unique_ptr<cli::ProcessInstance>> instance = Internal("not started");
    std::thread start([&] { instance = cli::StartProcessInstance(*parsed, Spec(2), registry); });
    ASSERT_TRUE(InstanceDeclared(registry->port(), token));
    const pid_t lone =
        SpawnWorker(binary_, registry->port(), {"--rank", "0", "--collective-timeout-ms", "60000"},
                    {"KVSHARD_WORKER_TOKEN=" + token});
    start.join();
    ASSERT_FALSE(instance.ok());
    EXPECT_LT(SteadyClock::now() - began, milliseconds(30'000));  // not the 60 s rendezvous
    EXPECT_EQ(instance.status().code(), StatusCode::kDeadlineExceeded)
        << instance.status().ToString();
    EXPECT_NE(instance.status().message().find("ranks not registered: 1"), std::string::npos)
        << instance.status().ToString();
    // The lone worker sees its channel close and exits.
    const int status = WaitExit(lone);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << status;
}

// A rank of a tp-2 Gloo instance killed under a step: the request fails (the surviving rank's
// all-reduce ends when the dead peer's connection closes, not at its deadline), the supervisor
// relaunches both ranks, they meet again in a fresh store, and the instance gives the same tokens.
TEST_F(ProcessModeTest, GlooTp2InstanceKilledUnderAStepIsReformed) {
    if (!KVSHARD_WITH_GLOO) GTEST_SKIP() << "built without Gloo";
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config("direct", 1'000, /*restart_limit=*/3), Spec(2));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    RemoteStepExecutor& executor = (*instance)->executor();
    const std::vector<pid_t> ranks = (*instance)->worker_pids();
    ASSERT_EQ(ranks.size(), 2u);
    {
        auto engine = Engine(executor);
        auto sink = std::make_shared<Sink>();
        ASSERT_TRUE(engine->Submit(Request("long", "Once upon a time", 400, true), sink).ok());
        ASSERT_TRUE(sink->WaitFirstToken());
        ASSERT_EQ(kill(ranks[1], SIGKILL), 0);
        ASSERT_TRUE(sink->WaitDone(milliseconds(30'000))) << "the request hangs";
        EXPECT_FALSE(sink->status().ok());
        engine->Stop();
    }
    ASSERT_TRUE(WaitFor([&] {
        return executor.Health().ok() && executor.epoch() == 2 && (*instance)->restarts() == 1;
    })) << executor.Health().ToString()
        << "; last failure " << (*instance)->last_failure().ToString();
    EXPECT_TRUE(Reaped(ranks[0]));
    EXPECT_TRUE(Reaped(ranks[1]));
    EXPECT_EQ(Run(executor), EmbeddedReference());
}

// ---- MPI: tp 2 worker processes under mpirun ----

TEST_F(ProcessModeTest, MpiTp2WorkersGiveTheSameTokens) {
    if (!HaveMpirun()) GTEST_SKIP() << "no MPI build or no mpirun";
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config("mpirun"), Spec(2));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    EXPECT_EQ((*instance)->executor().kv_endpoints().size(), 2u);
    const auto remote = Run((*instance)->executor());
    const auto embedded = EmbeddedReference();
    ASSERT_EQ(remote.size(), embedded.size());
    for (size_t i = 0; i < remote.size(); ++i) EXPECT_EQ(remote[i], embedded[i]) << "request " << i;
}

// A rank of a tp-2 instance killed under a step: the request fails, the supervisor kills mpirun's
// group, starts it again, and the re-formed instance gives the same tokens.
TEST_F(ProcessModeTest, MpiTp2InstanceKilledUnderAStepIsReformed) {
    if (!HaveMpirun()) GTEST_SKIP() << "no MPI build or no mpirun";
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(Config("mpirun", 1'000, /*restart_limit=*/3), Spec(2));
    ASSERT_TRUE(instance.ok()) << instance.status().ToString();
    RemoteStepExecutor& executor = (*instance)->executor();
    const pid_t mpirun = (*instance)->worker_pids().at(0);
    std::vector<pid_t> ranks;
    ASSERT_TRUE(WaitFor([&] {
        ranks = ChildrenOf(mpirun);
        return ranks.size() >= 2;
    }));
    {
        auto engine = Engine(executor);
        auto sink = std::make_shared<Sink>();
        ASSERT_TRUE(engine->Submit(Request("long", "Once upon a time", 400, true), sink).ok());
        ASSERT_TRUE(sink->WaitFirstToken());
        ASSERT_EQ(kill(ranks.back(), SIGKILL), 0);
        ASSERT_TRUE(sink->WaitDone(milliseconds(60'000))) << "the request hangs";
        EXPECT_FALSE(sink->status().ok());
        engine->Stop();
    }
    // (restarts() counts once Reform returned, a moment after the epoch changed.)
    ASSERT_TRUE(WaitFor([&] {
        return executor.Health().ok() && executor.epoch() == 2 && (*instance)->restarts() == 1;
    })) << executor.Health().ToString()
        << "; last failure " << (*instance)->last_failure().ToString();
    EXPECT_TRUE(Reaped(mpirun));
    EXPECT_EQ(executor.kv_endpoints().size(), 2u);
    EXPECT_EQ(Run(executor), EmbeddedReference());
}

}  // namespace
}  // namespace kvshard
