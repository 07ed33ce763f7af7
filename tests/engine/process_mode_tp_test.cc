// Process mode, tensor parallel: tp 2 instances of independent worker processes (the direct
// launcher, or started by hand without --rank/--tp) meet through the coordinator and all-reduce
// over Gloo (skipped in builds without Gloo); the MPI cases need mpirun and skip without it. Each
// gives the tokens of the embedded tp 1 group, and a rank killed under a step is relaunched.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/engine/process_mode_fixture.h"

namespace kvshard::process_mode {
namespace {

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
    Result<ServerConfig> parsed = ExternalConfig(
        token,
        "  heartbeat_interval_ms: 200\n  dead_after_ms: 2000\n  register_timeout_ms: 60000\n"
        "  restart_limit: 0\n");
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
    Result<ServerConfig> parsed =
        ExternalConfig(token, "  register_timeout_ms: 8000\n  restart_limit: 0\n");
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
    ASSERT_NO_FATAL_FAILURE(FailARequestByKilling(executor, ranks[1], milliseconds(30'000)));
    ASSERT_TRUE(ReformedOnce(**instance)) << executor.Health().ToString() << "; last failure "
                                          << (*instance)->last_failure().ToString();
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
    ASSERT_NO_FATAL_FAILURE(FailARequestByKilling(executor, ranks.back(), milliseconds(60'000)));
    ASSERT_TRUE(ReformedOnce(**instance)) << executor.Health().ToString() << "; last failure "
                                          << (*instance)->last_failure().ToString();
    EXPECT_TRUE(Reaped(mpirun));
    EXPECT_EQ(executor.kv_endpoints().size(), 2u);
    EXPECT_EQ(Run(executor), EmbeddedReference());
}

}  // namespace
}  // namespace kvshard::process_mode
