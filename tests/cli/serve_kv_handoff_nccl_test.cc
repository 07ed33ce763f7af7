// kvshard serve's answer to kv_transfer.path: nccl (cli/serve_devices.h ServeKvHandoffPath) for
// each workers: placement, from a parsed config and a device plan: the reason it cannot work
// (embedded pools, workers launched elsewhere, a GPU holding both sides, no CUDA in the build),
// or, for GPU worker processes this coordinator launches on distinct GPUs, that it is not wired
// yet; and auto keeps host-staged for worker processes on any placement.
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
        EXPECT_NE(Refusal(direct, CudaPlan({0, 1})).find("not wired on GPUs yet"),
                  std::string::npos);
    } else {
        EXPECT_NE(Refusal(direct, CudaPlan({0, 1})).find("built without CUDA"), std::string::npos);
    }
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
