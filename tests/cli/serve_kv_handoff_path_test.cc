// kvshard serve's choice of the KV handoff path (cli/serve_devices.h ServeKvHandoffPath) from a
// parsed config and a device plan, on the CPU: kv_transfer.path parses (auto, host-staged, peer,
// nccl; anything else refused naming the key), the plan's prefill and decode GPUs are asked for
// peer access, mixed-only configs need no path, and refusals name kv_transfer.path.
#include <gtest/gtest.h>

#include <string>

#include "cli/serve_devices.h"

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

TEST(ServeKvHandoffPath, FromTheConfigAndThePlan) {
    auto all_peers = [](int, int) { return true; };
    auto no_peers = [](int, int) { return false; };
    const ServerConfig automatic = Parse(kPools);
    EXPECT_FALSE(automatic.kv_transfer.path.has_value());
    // Two GPUs with peer access: peer copies; without: host-staged; the CPU: host-staged.
    auto path =
        ServeKvHandoffPath(automatic, automatic.EffectivePools(), CudaPlan({0, 1}), all_peers);
    ASSERT_TRUE(path.ok()) << path.status().ToString();
    EXPECT_EQ(path->value(), KvHandoffPath::kPeerCopy);
    path = ServeKvHandoffPath(automatic, automatic.EffectivePools(), CudaPlan({0, 1}), no_peers);
    EXPECT_EQ(path->value(), KvHandoffPath::kHostStaged);
    path = ServeKvHandoffPath(automatic, automatic.EffectivePools(), DevicePlan{}, all_peers);
    EXPECT_EQ(path->value(), KvHandoffPath::kHostStaged);
    // Both pools on GPU 0: peer copies whatever the pairs say (one device).
    path = ServeKvHandoffPath(automatic, automatic.EffectivePools(), CudaPlan({0, 0}), no_peers);
    EXPECT_EQ(path->value(), KvHandoffPath::kPeerCopy);

    const ServerConfig peer = Parse(std::string(kPools) + "kv_transfer:\n  path: peer\n");
    path = ServeKvHandoffPath(peer, peer.EffectivePools(), DevicePlan{}, no_peers);
    EXPECT_EQ(path->value(), KvHandoffPath::kPeerCopy);  // the CPU backend's memcpy
    path = ServeKvHandoffPath(peer, peer.EffectivePools(), CudaPlan({0, 1}), no_peers);
    ASSERT_FALSE(path.ok());
    EXPECT_NE(path.status().message().find("kv_transfer.path"), std::string::npos);

    const ServerConfig processes =
        Parse(std::string(kPools) + "kv_transfer:\n  path: peer\nworkers:\n  mode: processes\n");
    EXPECT_FALSE(
        ServeKvHandoffPath(processes, processes.EffectivePools(), DevicePlan{}, all_peers).ok());

    const ServerConfig host = Parse(std::string(kPools) + "kv_transfer:\n  path: host-staged\n");
    path = ServeKvHandoffPath(host, host.EffectivePools(), CudaPlan({0, 1}), all_peers);
    EXPECT_EQ(path->value(), KvHandoffPath::kHostStaged);

    const ServerConfig nccl = Parse(std::string(kPools) + "kv_transfer:\n  path: nccl\n");
    path = ServeKvHandoffPath(nccl, nccl.EffectivePools(), CudaPlan({0, 1}), all_peers);
    ASSERT_FALSE(path.ok());
    EXPECT_NE(path.status().message().find("kv_transfer.path: nccl"), std::string::npos);
}

TEST(ServeKvHandoffPath, MixedPoolsNeedNoPathAndBadValuesAreRefused) {
    const ServerConfig mixed = Parse("model: /models/none.gguf\ntp: 1\n");
    auto path = ServeKvHandoffPath(mixed, mixed.EffectivePools(), DevicePlan{},
                                   [](int, int) { return true; });
    ASSERT_TRUE(path.ok());
    EXPECT_FALSE(path->has_value());
    Result<ServerConfig> bad =
        ParseServerConfig(std::string(kPools) + "kv_transfer:\n  path: rdma\n", "test.yaml");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("kv_transfer.path"), std::string::npos)
        << bad.status().message();
    EXPECT_NE(bad.status().message().find("rdma"), std::string::npos);
}

}  // namespace
}  // namespace kvshard::cli
