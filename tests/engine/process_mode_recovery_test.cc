// Process mode, failure and recovery: a killed or frozen worker fails the in-flight requests with
// Unavailable and later ones at once; a killed or stopped worker is relaunched by the instance's
// supervisor and the instance (and the same engine) serves again with a new epoch; external
// workers need the token and their replacement re-forms the instance; the supervisor gives up
// after restart_limit failed attempts.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/engine/process_mode_fixture.h"

namespace kvshard::process_mode {
namespace {

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
    ASSERT_TRUE(ReformedOnce(**instance)) << executor.Health().ToString() << "; last failure "
                                          << (*instance)->last_failure().ToString();
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
    auto spawn = [&](bool with_token) {
        std::vector<std::string> args = {
            binary_,           "worker",
            "--coordinator",   "127.0.0.1:" + std::to_string(registry->port()),
            "--instance",      "test",
            "--heartbeat-ms",  "200",
            "--dead-after-ms", "1000",
            "--log-level",     "warn"};
        if (with_token) args.insert(args.end(), {"--token-file", token_file});
        return SpawnWithWorkerEnv(std::move(args), {});
    };

    // external needs a fixed port and the token; the registry given below is the one used.
    Result<ServerConfig> parsed = ExternalConfig(
        token,
        "  heartbeat_interval_ms: 200\n  dead_after_ms: 1000\n  register_timeout_ms: 60000\n"
        "  restart_limit: 2\n  restart_backoff_ms: 100\n");
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    const ServerConfig config = *parsed;
    Result<std::unique_ptr<cli::ProcessInstance>> instance = Internal("not started");
    std::thread start([&] { instance = cli::StartProcessInstance(config, Spec(1), registry); });

    const pid_t refused = spawn(false);
    const int refused_status = WaitExit(refused);
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
    WaitExit(first);
    ASSERT_TRUE(WaitFor([&] { return !executor.Health().ok(); }));
    const pid_t second = spawn(true);
    ASSERT_TRUE(ReformedOnce(**instance)) << executor.Health().ToString();
    EXPECT_EQ(Run(executor), EmbeddedReference());
    instance->reset();  // tells the worker to shut down
    const int second_status = WaitExit(second);
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

}  // namespace
}  // namespace kvshard::process_mode
