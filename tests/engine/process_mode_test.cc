// Process mode end to end: the real `kvshard worker` processes, launched by the coordinator's
// launcher, registered with a WorkerRegistry and driven through a RemoteStepExecutor by the
// instance engine, on stories260K. Greedy outputs match the embedded TpGroup; a killed or frozen
// worker fails the in-flight requests with Unavailable and later ones at once; bad registrations
// are refused with the reason. The MPI case (suite ProcessModeMpi) needs mpirun and skips
// without it.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cli/process_instance.h"
#include "comm/frame_channel.h"
#include "common/build_config.h"
#include "coordinator/engine.h"
#include "coordinator/remote_executor.h"
#include "tests/test_util.h"
#include "worker/local_model.h"
#include "worker/tp_group.h"

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;
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
        finished_at_ = Clock::now();
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
    Clock::time_point finished_at() {
        std::lock_guard<std::mutex> lock(mu_);
        return finished_at_;
    }

  private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<int32_t> ids_;
    Status status_;
    bool done_ = false;
    Clock::time_point finished_at_;
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

    ServerConfig Config(const std::string& launcher = "direct", int64_t dead_after_ms = 1'000) {
        const std::string yaml =
            "model: " + model_path_ +
            "\nlog_level: warn\nworkers:\n  mode: processes\n  launcher: " + launcher +
            "\n  heartbeat_interval_ms: 200\n  dead_after_ms: " + std::to_string(dead_after_ms) +
            "\n  step_timeout_ms: 30000\n  register_timeout_ms: 60000\n";
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
        const std::vector<std::string> prompts = {"Once upon a time", "The little dog",
                                                  "Lily and Tom went", "One day, a big bird"};
        auto engine = Engine(executor);
        std::vector<std::shared_ptr<Sink>> sinks;
        for (size_t i = 0; i < prompts.size(); ++i) {
            sinks.push_back(std::make_shared<Sink>());
            EXPECT_TRUE(
                engine->Submit(Request("r" + std::to_string(i), prompts[i], 48), sinks.back())
                    .ok());
        }
        std::vector<std::vector<int32_t>> out;
        for (auto& s : sinks) {
            EXPECT_TRUE(s->WaitDone());
            EXPECT_TRUE(s->status().ok()) << s->status().ToString();
            out.push_back(s->ids());
        }
        engine->Stop();
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
    ASSERT_NE((*instance)->launcher(), nullptr);
    const pid_t worker = (*instance)->launcher()->pids().at(0);
    auto engine = Engine((*instance)->executor());

    auto sink = std::make_shared<Sink>();
    ASSERT_TRUE(engine->Submit(Request("long", "Once upon a time", 400, true), sink).ok());
    ASSERT_TRUE(sink->WaitFirstToken());
    ASSERT_EQ(kill(worker, SIGSTOP), 0);
    const auto stopped_at = Clock::now();
    if (GetParam().kill) {
        ASSERT_EQ(kill(worker, SIGKILL), 0);
    }

    ASSERT_TRUE(sink->WaitDone(milliseconds(30'000))) << "the request hangs";
    const Status failed = sink->status();
    EXPECT_EQ(failed.code(), StatusCode::kUnavailable) << failed.ToString();
    EXPECT_NE(failed.message().find("instance test: worker rank 0"), std::string::npos)
        << failed.ToString();
    EXPECT_LT(sink->ids().size(), 400u);
    const auto detect_ms =
        std::chrono::duration_cast<milliseconds>(sink->finished_at() - stopped_at).count();
    // Loose bounds (a loaded machine): killed: the reset; frozen: dead_after_ms + a heartbeat.
    EXPECT_LT(detect_ms, GetParam().kill ? 5'000 : dead_after_ms + 5'000);
    std::printf("[ %s ] failure noticed after %lld ms\n", GetParam().name,
                static_cast<long long>(detect_ms));

    // Later submissions fail fast with the same error.
    auto later = std::make_shared<Sink>();
    const auto submitted_at = Clock::now();
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
    if (!GetParam().kill) kill(worker, SIGCONT);  // so the launcher's SIGTERM can end it
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
    const auto started = Clock::now();
    Result<std::unique_ptr<cli::ProcessInstance>> instance =
        cli::StartProcessInstance(config, spec);
    ASSERT_FALSE(instance.ok());
    EXPECT_NE(instance.status().message().find("exited: exit code 1"), std::string::npos)
        << instance.status().ToString();
    EXPECT_LT(std::chrono::duration_cast<milliseconds>(Clock::now() - started).count(), 30'000);
}

TEST(ProcessModeConfigTest, TheDirectLauncherRefusesTensorParallelWorkers) {
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

// ---- registration, with hand-made workers ----

RegisterAckMessage RegisterAs(uint16_t port, const RegisterMessage& reg,
                              std::unique_ptr<FrameChannel>* keep = nullptr) {
    Result<std::unique_ptr<FrameChannel>> c =
        ConnectFrameChannel("127.0.0.1", port, milliseconds(5'000));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return {};
    EXPECT_TRUE((*c)->Send(reg).ok());
    Result<Message> answer = (*c)->Receive(Clock::now() + milliseconds(10'000));
    EXPECT_TRUE(answer.ok()) << answer.status().ToString();
    if (!answer.ok()) return {};
    const auto* ack = std::get_if<RegisterAckMessage>(&*answer);
    EXPECT_NE(ack, nullptr);
    if (ack == nullptr) return {};
    RegisterAckMessage out = *ack;
    if (keep != nullptr) *keep = std::move(*c);
    return out;
}

TEST(WorkerRegistryTest, RefusesBadRegistrationsWithTheReason) {
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start({});
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
        RegisterAs(port, {0, 2, "a", kControlProtocolVersion, "h:1"}, &rank0);
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
        {"unknown instance", {0, 2, "b", kControlProtocolVersion, ""}, "unknown instance"},
        {"duplicate rank", {0, 2, "a", kControlProtocolVersion, ""}, "already registered by"},
        {"rank out of range", {2, 2, "a", kControlProtocolVersion, ""}, "out of range"},
        {"negative rank", {-1, 2, "a", kControlProtocolVersion, ""}, "out of range"},
        {"tp mismatch",
         {1, 4, "a", kControlProtocolVersion, ""},
         "tp 4, but the instance has tp 2"},
        {"old protocol", {1, 2, "a", 1, ""}, "protocol version 1"},
    };
    for (const Case& c : cases) {
        const RegisterAckMessage ack = RegisterAs(port, c.reg);
        EXPECT_FALSE(ack.accepted) << c.name;
        EXPECT_NE(ack.error.find(c.reason), std::string::npos) << c.name << ": " << ack.error;
    }
    EXPECT_EQ((*registry)->rejections().size(), cases.size());

    // Rank 1 is still free; with both registered, a load error from rank 1 fails WaitReady.
    std::unique_ptr<FrameChannel> rank1;
    EXPECT_TRUE(RegisterAs(port, {1, 2, "a", kControlProtocolVersion, "h:2"}, &rank1).accepted);
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
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start({});
    ASSERT_TRUE(registry.ok());
    RemoteInstanceOptions o;
    o.instance_id = "x";
    o.tp = 3;
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    std::unique_ptr<FrameChannel> rank1;
    ASSERT_TRUE(
        RegisterAs((*registry)->port(), {1, 3, "x", kControlProtocolVersion, ""}, &rank1).accepted);
    const Status ready = (*executor)->WaitReady(milliseconds(300));
    EXPECT_EQ(ready.code(), StatusCode::kDeadlineExceeded);
    EXPECT_NE(ready.message().find("ranks not registered: 0, 2"), std::string::npos)
        << ready.ToString();
    EXPECT_NE(ready.message().find("registered but not ready: 1"), std::string::npos)
        << ready.ToString();
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

}  // namespace
}  // namespace kvshard
