// Process mode, starting up: the real `kvshard worker` processes, launched by the coordinator's
// launcher, give the embedded TpGroup's greedy tokens; a load error or a worker that exits early
// fails startup naming the rank and the reason; the config decides which instances get an NCCL
// bootstrap; workers inherit no socket of the coordinator.
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "tests/engine/process_mode_fixture.h"

namespace kvshard::process_mode {
namespace {

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

}  // namespace
}  // namespace kvshard::process_mode
