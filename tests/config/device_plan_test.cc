// PlanDevices with injected device queries: backend resolution, rank placement, KV sizing from
// free memory × gpu_memory_utilization, and the one-line refusals of issue 13 item 4.
#include "config/device_plan.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvshard {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

GpuInfo H200(int ordinal, int64_t free_bytes = 140 * kGiB) {
    return {.ordinal = ordinal, .name = "NVIDIA H200", .cc_major = 9, .cc_minor = 0,
            .total_bytes = 141 * kGiB, .free_bytes = free_bytes};
}

std::vector<PoolConfig> Pools(std::vector<InstanceConfig> instances) {
    return {PoolConfig{.name = "main", .role = PoolRole::kMixed, .instances = std::move(instances)}};
}

DevicePlanInputs Inputs(ServeBackend backend, std::vector<GpuInfo> gpus) {
    DevicePlanInputs in;
    in.backend = backend;
    in.built_with_cuda = true;
    in.gpus = std::move(gpus);
    in.gpu_memory_utilization = 0.5;
    in.weight_bytes_per_rank = [](int tp) { return 16 * kGiB / tp; };
    in.kv_bytes_per_block = [](int tp) { return 2 * kMiB / tp; };
    in.reserve_bytes_per_rank = [](PoolRole, int) { return 1 * kGiB; };
    return in;
}

std::string Error(const Result<DevicePlan>& r) { return r.ok() ? "(ok)" : r.status().message(); }

TEST(DevicePlan, AutoIsCudaOnlyWithCudaAndADevice) {
    const auto pools = Pools({InstanceConfig{.tp = 1, .devices = {}}});
    auto in = Inputs(ServeBackend::kAuto, {H200(0)});
    ASSERT_TRUE(PlanDevices(pools, in).ok());
    EXPECT_TRUE(PlanDevices(pools, in)->cuda);
    in.gpus.clear();
    EXPECT_FALSE(PlanDevices(pools, in)->cuda);
    in.gpus = {H200(0)};
    in.built_with_cuda = false;
    EXPECT_FALSE(PlanDevices(pools, in)->cuda);
}

TEST(DevicePlan, KvPoolFromFreeMemoryTimesUtilization) {
    const auto pools = Pools({InstanceConfig{.tp = 1, .devices = {}}});
    Result<DevicePlan> plan = PlanDevices(pools, Inputs(ServeBackend::kCuda, {H200(0, 100 * kGiB)}));
    ASSERT_TRUE(plan.ok()) << Error(plan);
    ASSERT_EQ(plan->ranks.size(), 1u);
    const RankPlacement& r = plan->ranks[0];
    EXPECT_EQ(r.gpu, 0);
    EXPECT_EQ(r.usable_bytes, 50 * kGiB);
    // 50 GiB - 16 GiB weights - 1 GiB buffers = 33 GiB of 2 MiB blocks.
    EXPECT_EQ(r.kv_blocks, 33 * 512);
    EXPECT_EQ(r.kv_bytes, 33 * kGiB);
    const std::vector<std::string> lines = plan->Describe(pools);
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0], "pool main instance 0 rank 0: GPU 0, 102400 MiB free, 51200 MiB usable, "
                        "weights 16384 MiB, buffers 1024 MiB, KV 16896 blocks (33792 MiB)");
}

TEST(DevicePlan, DevicesPlaceRanksAndSharedDevicesSplitTheirMemory) {
    // Two instances of tp 2: the first on GPUs 1 and 0, the second (no devices) on 0 and 1 again.
    const auto pools = Pools({InstanceConfig{.tp = 2, .devices = {"1", "0"}}, InstanceConfig{.tp = 2, .devices = {}}});
    Result<DevicePlan> plan = PlanDevices(pools, Inputs(ServeBackend::kCuda, {H200(0), H200(1)}));
    ASSERT_TRUE(plan.ok()) << Error(plan);
    ASSERT_EQ(plan->ranks.size(), 4u);
    EXPECT_EQ(plan->ranks[0].gpu, 1);
    EXPECT_EQ(plan->ranks[1].gpu, 0);
    EXPECT_EQ(plan->ranks[2].gpu, 0);
    EXPECT_EQ(plan->ranks[3].gpu, 1);
    for (const RankPlacement& r : plan->ranks) {
        EXPECT_EQ(r.ranks_on_gpu, 2);
        EXPECT_EQ(r.usable_bytes, 35 * kGiB);  // 140 GiB × 0.5 ÷ 2
        EXPECT_EQ(r.weight_bytes, 8 * kGiB);
        EXPECT_EQ(r.kv_blocks, (35 - 8 - 1) * 1024);  // blocks of 1 MiB at tp 2
    }
}

TEST(DevicePlan, FixedBlockCountMustFit) {
    const auto pools = Pools({InstanceConfig{.tp = 1, .devices = {}}});
    auto in = Inputs(ServeBackend::kCuda, {H200(0, 40 * kGiB)});
    in.fixed_kv_blocks = 100;
    Result<DevicePlan> plan = PlanDevices(pools, in);
    ASSERT_TRUE(plan.ok()) << Error(plan);
    EXPECT_EQ(plan->ranks[0].kv_blocks, 100);
    in.fixed_kv_blocks = 2000;  // 20 - 17 GiB = 1536 blocks
    EXPECT_EQ(Error(PlanDevices(pools, in)),
              "kv_cache.num_blocks: 2000 blocks do not fit pools[0] (main).instances[0] rank 0 on "
              "GPU 0: 3072 MiB left of 40960 MiB free × kv_cache.gpu_memory_utilization 0.50 = "
              "20480 MiB hold 1536");
}

TEST(DevicePlan, CpuBackendWarnsAboutGpuDevices) {
    const auto pools = Pools({InstanceConfig{.tp = 1, .devices = {"0"}}});
    Result<DevicePlan> plan = PlanDevices(pools, Inputs(ServeBackend::kCpu, {H200(0)}));
    ASSERT_TRUE(plan.ok());
    EXPECT_FALSE(plan->cuda);
    ASSERT_EQ(plan->warnings.size(), 1u);
    EXPECT_EQ(plan->warnings[0], "pools[0] (main).instances[0].devices: GPU 0 ignored: the "
                                 "workers run on the CPU (backend: cpu)");
}

TEST(DevicePlan, BadInputIsOneLineNamingTheSettingAndNumbers) {
    const auto one = Pools({InstanceConfig{.tp = 1, .devices = {}}});
    auto in = Inputs(ServeBackend::kCuda, {});
    EXPECT_EQ(Error(PlanDevices(one, in)), "backend: cuda: no CUDA device found (0 devices)");
    in.built_with_cuda = false;
    EXPECT_EQ(Error(PlanDevices(one, in)), "backend: cuda: this kvshard was built without CUDA");

    in = Inputs(ServeBackend::kCuda, {H200(0), H200(1)});
    EXPECT_EQ(Error(PlanDevices(Pools({InstanceConfig{.tp = 1, .devices = {"3"}}}), in)),
              "pools[0] (main).instances[0].devices[0]: GPU 3 does not exist (2 devices: 0, 1)");
    EXPECT_EQ(Error(PlanDevices(Pools({InstanceConfig{.tp = 2, .devices = {"0", "cpu"}}}), in)),
              "pools[0] (main).instances[0].devices[1]: cpu with backend: cuda (give every rank "
              "of a GPU instance a GPU ordinal)");
    EXPECT_EQ(Error(PlanDevices(Pools({InstanceConfig{.tp = 4, .devices = {}}}), in)),
              "pools[0] (main).instances[0].tp: 4 is larger than the 2 GPUs present (0, 1); list "
              "the same GPU more than once in devices to share one");

    GpuInfo t4 = H200(0);
    t4.name = "Tesla T4";
    t4.cc_major = 7;
    t4.cc_minor = 5;
    EXPECT_EQ(Error(PlanDevices(one, Inputs(ServeBackend::kCuda, {t4}))),
              "pools[0] (main).instances[0]: GPU 0 (Tesla T4) has compute capability 7.5; the "
              "CUDA backend needs 8.0 or newer");

    EXPECT_EQ(Error(PlanDevices(one, Inputs(ServeBackend::kCuda, {H200(0, 30 * kGiB)}))),
              "pools[0] (main).instances[0] rank 0 on GPU 0: weights 16384 MiB + buffers 1024 MiB "
              "do not fit in 30720 MiB free × kv_cache.gpu_memory_utilization 0.50 = 15360 MiB");
    EXPECT_EQ(Error(PlanDevices(one, Inputs(ServeBackend::kCuda, {H200(0, 34 * kGiB)}))),
              "pools[0] (main).instances[0] rank 0 on GPU 0: weights 16384 MiB + buffers 1024 MiB "
              "leave 0 MiB of 34816 MiB free × kv_cache.gpu_memory_utilization 0.50 = 17408 MiB: "
              "no room for one KV block of 2097152 bytes");
}

TEST(DevicePlan, NoDeviceSaysWhatTheRuntimeReported) {
    auto in = Inputs(ServeBackend::kCuda, {});
    in.no_device_reason = "cudaGetDeviceCount: cudaErrorInsufficientDriver: CUDA driver version is "
                          "insufficient for CUDA runtime version";
    EXPECT_EQ(Error(PlanDevices(Pools({InstanceConfig{.tp = 1, .devices = {}}}), in)),
              "backend: cuda: no CUDA device found (0 devices; cudaGetDeviceCount: "
              "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
              "version)");
}

// Two ranks listed on one GPU share it: each gets half of its usable memory, and the plan says so.
TEST(DevicePlan, RanksSharingAGpuSplitItsMemory) {
    const auto pools = Pools({InstanceConfig{.tp = 2, .devices = {"0", "0"}}});
    Result<DevicePlan> plan = PlanDevices(pools, Inputs(ServeBackend::kCuda, {H200(0, 100 * kGiB)}));
    ASSERT_TRUE(plan.ok()) << Error(plan);
    ASSERT_EQ(plan->ranks.size(), 2u);
    for (const RankPlacement& r : plan->ranks) {
        EXPECT_EQ(r.gpu, 0);
        EXPECT_EQ(r.ranks_on_gpu, 2);
        EXPECT_EQ(r.usable_bytes, 25 * kGiB);
        // 25 GiB - 8 GiB weights (tp 2) - 1 GiB buffers = 16 GiB of 1 MiB blocks.
        EXPECT_EQ(r.kv_blocks, 16 * 1024);
    }
    // Without devices, automatic placement gives each rank a GPU of its own or refuses.
    EXPECT_EQ(Error(PlanDevices(Pools({InstanceConfig{.tp = 2, .devices = {}}}),
                                Inputs(ServeBackend::kCuda, {H200(0)}))),
              "pools[0] (main).instances[0].tp: 2 is larger than the 1 GPUs present (0); list the "
              "same GPU more than once in devices to share one");
}

TEST(DevicePlan, FindsEachRanksPlacement) {
    const auto pools = Pools({InstanceConfig{.tp = 1, .devices = {"1"}}, InstanceConfig{.tp = 1, .devices = {"0"}}});
    Result<DevicePlan> plan = PlanDevices(pools, Inputs(ServeBackend::kCuda, {H200(0), H200(1)}));
    ASSERT_TRUE(plan.ok()) << Error(plan);
    ASSERT_NE(plan->Find(0, 1, 0), nullptr);
    EXPECT_EQ(plan->Find(0, 0, 0)->gpu, 1);
    EXPECT_EQ(plan->Find(0, 1, 0)->gpu, 0);
    EXPECT_EQ(plan->Find(0, 2, 0), nullptr);
    EXPECT_EQ(plan->Find(0, 0, 1), nullptr);
}

TEST(DevicePlan, BackendAndUtilizationAreServeSettings) {
    auto d = ParseServerConfig("model: m.gguf\n", "serve.yaml");
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->backend, ServeBackend::kCpu);
    EXPECT_DOUBLE_EQ(d->kv_cache.gpu_memory_utilization, 0.9);
    auto c = ParseServerConfig(
        "model: m.gguf\nbackend: auto\nkv_cache:\n  gpu_memory_utilization: 0.8\n", "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->backend, ServeBackend::kAuto);
    EXPECT_DOUBLE_EQ(c->kv_cache.gpu_memory_utilization, 0.8);
    auto bad = ParseServerConfig("model: m.gguf\nbackend: rocm\n", "serve.yaml");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("backend"), std::string::npos);
    EXPECT_NE(bad.status().message().find("rocm"), std::string::npos);
    EXPECT_NE(bad.status().message().find("cpu, cuda or auto"), std::string::npos);
    for (const char* v : {"0", "1.5", "-0.1"}) {
        auto u = ParseServerConfig(std::string("model: m.gguf\nkv_cache:\n  gpu_memory_utilization: ") + v + "\n",
                                   "serve.yaml");
        ASSERT_FALSE(u.ok()) << v;
        EXPECT_NE(u.status().message().find("kv_cache.gpu_memory_utilization"), std::string::npos)
            << u.status().message();
    }
}

// Prefill and decode pools on GPUs: allowed, both on the one GPU (sharing its memory), and the
// plan names the host-staged handoff, which the startup log prints after the ranks' lines.
TEST(DevicePlan, PrefillAndDecodePoolsShareAGpuWithTheHandoffNamed) {
    std::vector<PoolConfig> pools = {
        {.name = "prefill", .role = PoolRole::kPrefill, .instances = {InstanceConfig{.tp = 1, .devices = {"0"}}}},
        {.name = "decode", .role = PoolRole::kDecode, .instances = {InstanceConfig{.tp = 1, .devices = {"0"}}}}};
    Result<DevicePlan> plan = PlanDevices(pools, Inputs(ServeBackend::kCuda, {H200(0, 100 * kGiB)}));
    ASSERT_TRUE(plan.ok()) << Error(plan);
    ASSERT_EQ(plan->ranks.size(), 2u);
    for (const RankPlacement& r : plan->ranks) {
        EXPECT_EQ(r.ranks_on_gpu, 2);
        EXPECT_EQ(r.usable_bytes, 25 * kGiB);
    }
    const std::vector<std::string> lines = plan->Describe(pools);
    ASSERT_EQ(lines.size(), 3u);
    EXPECT_EQ(lines[2], plan->kv_handoff);
    EXPECT_NE(plan->kv_handoff.find("host-staged"), std::string::npos) << plan->kv_handoff;
    // Mixed pools only: no handoff line.
    plan = PlanDevices(Pools({InstanceConfig{.tp = 1, .devices = {}}}), Inputs(ServeBackend::kCuda, {H200(0)}));
    ASSERT_TRUE(plan.ok()) << Error(plan);
    EXPECT_EQ(plan->kv_handoff, "");
}

// cuda_graphs: true is refused by name on the CPU, and on a GPU the graphs' estimate comes off
// the KV pool and shows in the plan's line.
TEST(DevicePlan, CudaGraphsAreRefusedOffGpuAndCountedOnOne) {
    const auto pools = Pools({InstanceConfig{.tp = 1, .devices = {}}});
    auto in = Inputs(ServeBackend::kCpu, {H200(0)});
    in.cuda_graphs = true;
    EXPECT_EQ(Error(PlanDevices(pools, in)),
              "cuda_graphs: true with backend: cpu (the workers run on the CPU): CUDA graphs are "
              "captured on the cuda backend only");
    in.backend = ServeBackend::kAuto;
    in.gpus.clear();
    EXPECT_NE(Error(PlanDevices(pools, in)).find("cuda_graphs: true with backend: auto"),
              std::string::npos);
    in = Inputs(ServeBackend::kCuda, {H200(0, 100 * kGiB)});
    in.graph_bytes_per_rank = [](int) { return 2 * kGiB; };
    Result<DevicePlan> off = PlanDevices(pools, in);  // cuda_graphs false: not counted
    in.cuda_graphs = true;
    Result<DevicePlan> on = PlanDevices(pools, in);
    ASSERT_TRUE(off.ok() && on.ok()) << Error(off) << Error(on);
    EXPECT_EQ(off->ranks[0].graph_bytes, 0);
    EXPECT_EQ(on->ranks[0].graph_bytes, 2 * kGiB);
    EXPECT_EQ(off->ranks[0].kv_blocks - on->ranks[0].kv_blocks, 2 * 512);  // 2 GiB of 2 MiB blocks
    EXPECT_NE(on->Describe(pools)[0].find(", CUDA graphs 2048 MiB"), std::string::npos)
        << on->Describe(pools)[0];
    in.graph_bytes_per_rank = [](int) { return 40 * kGiB; };
    EXPECT_EQ(Error(PlanDevices(pools, in)),
              "pools[0] (main).instances[0] rank 0 on GPU 0: weights 16384 MiB + buffers 1024 MiB "
              "+ CUDA graphs 40960 MiB do not fit in 102400 MiB free × "
              "kv_cache.gpu_memory_utilization 0.50 = 51200 MiB");
}

// cuda_graphs: true at tp > 1: allowed where the instance's all-reduces are NCCL's on each rank's
// stream (every rank on a GPU of its own, config/collective_path.h), which a capture records;
// refused by name, with the GPU the ranks share, where they would be host-staged.
TEST(DevicePlan, CudaGraphsAtTpAboveOneNeedEveryRankOnItsOwnGpu) {
    struct Case {
        std::vector<InstanceConfig> instances;
        bool stage;
        const char* error;  // "" : allowed
    };
    const Case cases[] = {
        {{{.tp = 2, .devices = {}}}, false, ""},          // placed on GPUs 0 and 1
        {{{.tp = 2, .devices = {"1", "0"}}}, false, ""},  // listed, distinct
        {{{.tp = 1, .devices = {}}, {.tp = 2, .devices = {}}}, false, ""},
        {{{.tp = 1, .devices = {"0"}}}, true, ""},  // tp 1: no collective to stage
        {{{.tp = 2, .devices = {"0", "0"}}},
         false,
         "cuda_graphs: true with pools[0] (main).instances[0]: 2 of its 2 ranks share GPU 0, so "
         "their all-reduces are host-staged (they wait on the host) and cannot be captured in a "
         "graph (give each rank a GPU of its own in devices)"},
        {{{.tp = 1, .devices = {"0"}}, {.tp = 4, .devices = {"0", "1", "1", "0"}}},
         false,
         "cuda_graphs: true with pools[0] (main).instances[1]: 2 of its 4 ranks share GPU 0, so "
         "their all-reduces are host-staged (they wait on the host) and cannot be captured in a "
         "graph (give each rank a GPU of its own in devices)"},
        {{{.tp = 2, .devices = {}}},
         true,
         "cuda_graphs: true with pools[0] (main).instances[0]: its 2 ranks stage their "
         "collectives (--stage-collectives), so their all-reduces are host-staged (they wait on "
         "the host) and cannot be captured in a graph"},
    };
    for (const Case& c : cases) {
        auto in = Inputs(ServeBackend::kCuda, {H200(0), H200(1)});
        in.cuda_graphs = true;
        in.force_staged_collectives = c.stage;
        in.graph_bytes_per_rank = [](int tp) { return tp * kGiB; };
        const auto pools = Pools(c.instances);
        const Result<DevicePlan> plan = PlanDevices(pools, in);
        const std::string what = std::to_string(c.instances.size()) + " instances, last tp " +
                                 std::to_string(c.instances.back().tp) + ", stage " +
                                 std::to_string(c.stage);
        if (*c.error != '\0') {
            EXPECT_EQ(Error(plan), c.error) << what;
            EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument) << what;
            // The same instances without graphs are a valid plan: only the graphs are refused.
            in.cuda_graphs = false;
            EXPECT_TRUE(PlanDevices(pools, in).ok()) << what;
            continue;
        }
        ASSERT_TRUE(plan.ok()) << what << ": " << Error(plan);
        for (const RankPlacement& r : plan->ranks) {
            const int tp = c.instances[static_cast<size_t>(r.instance)].tp;
            EXPECT_EQ(r.graph_bytes, tp * kGiB) << what << " rank " << r.rank;
        }
    }
}

// buckets × (nodes per layer × layers + 8) × 64 KiB, the layer's nodes being its kernels
// (kCudaGraphKernelsPerLayer, checked against the runner's ops in tests/worker) and, at tp > 1,
// its two all-reduces.
TEST(DevicePlan, CudaGraphBytesEstimate) {
    EXPECT_EQ(CudaGraphNodesPerLayer(1), 14);
    EXPECT_EQ(CudaGraphNodesPerLayer(2), 16);
    EXPECT_EQ(CudaGraphNodesPerLayer(8), 16);
    EXPECT_EQ(CudaGraphBytes(32, 1, 1), (14 * 32 + 8) * 64 * 1024);
    EXPECT_EQ(CudaGraphBytes(32, 1, 2), (16 * 32 + 8) * 64 * 1024);
    EXPECT_EQ(CudaGraphBytes(32, 35, 4), 35 * CudaGraphBytes(32, 1, 4));
    EXPECT_EQ(CudaGraphBytes(32, 0, 1), 0);
}

}  // namespace
}  // namespace kvshard
