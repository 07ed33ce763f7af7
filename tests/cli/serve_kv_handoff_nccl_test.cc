// kvshard serve's answer to kv_transfer.path: nccl (cli/serve_devices.h ServeKvHandoffPath) for
// each workers: placement, from a parsed config and a device plan: the reason it cannot work
// (embedded pools, workers launched elsewhere, a GPU holding both sides, no CUDA in the build),
// and that it is accepted for GPU worker processes this coordinator launches on distinct GPUs
// (but not with the CPU workers' socket test knob); and auto keeps host-staged for worker
// processes on any placement.
#include <gtest/gtest.h>

#include <string>

#include "cli/serve_devices.h"
#include "common/build_config.h"

namespace kvshard::cli {
namespace {

constexpr const char* kPools = R"(model: /models/none.gguf
pools:
  - name: prefill
    role: prefill
    instances:
      - tp: 1
        devices: ["0"]
  - name: decode
    role: decode
    instances:
      - tp: 1
        devices: ["1"]
)";

ServerConfig Parse(const std::string& yaml) {
    Result<ServerConfig> c = ParseServerConfig(yaml, "test.yaml");
    KV_CHECK(c.ok()) << c.status().ToString();
    return *c;
}

// A cuda plan placing pool p's only rank on GPU gpus[p].
DevicePlan CudaPlan(const std::vector<int>& gpus) {
    DevicePlan plan;
    plan.cuda = true;
    for (size_t p = 0; p < gpus.size(); ++p)
        plan.ranks.push_back({.pool = int(p), .instance = 0, .rank = 0, .gpu = gpus[p]});
    return plan;
}

std::string Refusal(const std::string& extra, const DevicePlan& plan) {
    const ServerConfig c = Parse(std::string(kPools) + "kv_transfer:\n  path: nccl\n" + extra);
    auto path = ServeKvHandoffPath(c, c.EffectivePools(), plan, [](int, int) { return true; });
    EXPECT_FALSE(path.ok()) << extra;
    return path.ok() ? "" : path.status().message();
}

TEST(ServeKvHandoffNccl, RefusedWithTheReasonForEachPlacement) {
    const std::string direct = "workers:\n  mode: processes\n  launcher: direct\n";
    const std::string external =
        "workers:\n  mode: processes\n  launcher: external\n  port: 9000\n  token: t\n";
    EXPECT_NE(Refusal("", CudaPlan({0, 1})).find("peer copies"), std::string::npos);
    EXPECT_NE(Refusal(direct, DevicePlan{}).find("the cpu backend"), std::string::npos);
    if (KVSHARD_WITH_CUDA) {
        EXPECT_NE(Refusal(external, CudaPlan({0, 1})).find("not all launched on this node"),
                  std::string::npos);
        EXPECT_NE(Refusal(direct, CudaPlan({1, 1})).find("GPU 1 holds a prefill rank and a decode"),
                  std::string::npos);
    } else {
        EXPECT_NE(Refusal(direct, CudaPlan({0, 1})).find("built without CUDA"), std::string::npos);
    }
}

// GPU worker processes launched here on distinct GPUs: accepted (CUDA builds), one instance per
// pool and a tp 2 prefill instance beside a tp 1 decode instance alike; a rank of either side
// sharing a GPU with the other is refused naming the GPU, and so is the socket test knob.
TEST(ServeKvHandoffNccl, AcceptedForGpuWorkerProcessesOnDistinctGpus) {
    const std::string direct = "workers:\n  mode: processes\n  launcher: direct\n";
    const ServerConfig c = Parse(std::string(kPools) + "kv_transfer:\n  path: nccl\n" + direct);
    auto path =
        ServeKvHandoffPath(c, c.EffectivePools(), CudaPlan({0, 1}), [](int, int) { return false; });
    if (!KVSHARD_WITH_CUDA) {
        ASSERT_FALSE(path.ok());
        EXPECT_NE(path.status().message().find("built without CUDA"), std::string::npos);
        return;
    }
    ASSERT_TRUE(path.ok()) << path.status().ToString();
    EXPECT_EQ(path->value(), KvHandoffPath::kNccl);

    DevicePlan tp2 = CudaPlan({0, 2});
    tp2.ranks.push_back({.pool = 0, .instance = 0, .rank = 1, .gpu = 1});
    auto two = ServeKvHandoffPath(c, c.EffectivePools(), tp2, [](int, int) { return true; });
    ASSERT_TRUE(two.ok()) << two.status().ToString();
    EXPECT_EQ(two->value(), KvHandoffPath::kNccl);
    tp2.ranks.back().gpu = 2;  // prefill rank 1 on the decode rank's GPU
    EXPECT_NE(Refusal(direct, tp2).find("GPU 2 holds a prefill rank and a decode rank"),
              std::string::npos);

    auto knob = ServeKvHandoffPath(
        c, c.EffectivePools(), CudaPlan({0, 1}), [](int, int) { return true; },
        /*socket_pair_link=*/true);
    ASSERT_FALSE(knob.ok());
    EXPECT_NE(knob.status().message().find("KVSHARD_KV_PAIR_LINK=socket"), std::string::npos)
        << knob.status().message();
}

TEST(ServeKvHandoffNccl, AutoKeepsHostStagedForWorkerProcesses) {
    const ServerConfig c = Parse(std::string(kPools) + "workers:\n  mode: processes\n");
    for (const DevicePlan& plan : {CudaPlan({0, 1}), CudaPlan({0, 0}), DevicePlan{}}) {
        auto path = ServeKvHandoffPath(c, c.EffectivePools(), plan, [](int, int) { return true; });
        ASSERT_TRUE(path.ok()) << path.status().ToString();
        EXPECT_EQ(path->value(), KvHandoffPath::kHostStaged);
    }
}

}  // namespace
}  // namespace kvshard::cli
