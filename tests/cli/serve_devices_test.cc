// kvshard serve's device plan (cli/serve_devices.h) against fake device queries, on the CPU: where
// each instance runs, how its KV pool is sized from free memory × gpu_memory_utilization less the
// resident weights and buffers, what the startup log prints, and the one-line refusals.
#include "cli/serve_devices.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>

#include "kernels/cuda/cuda_backend.h"
#include "model/synthetic_gguf.h"
#include "tests/test_util.h"
#include "worker/weights.h"

namespace kvshard::cli {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

DeviceInfo Gpu(int ordinal, int64_t free_bytes, int cc_major = 9) {
    return {.ordinal = ordinal, .name = "NVIDIA H200", .cc_major = cc_major, .cc_minor = 0,
            .total_bytes = 141 * kGiB, .free_bytes = free_bytes};
}

class ServeDevicesTest : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string path = dir_.File("q8.gguf");
        const SyntheticGgufOptions o{.weight_dtype = DType::kQ8_0, .seed = 3};
        ASSERT_TRUE(SyntheticLlamaGguf(SyntheticArchSpec("llama"), o).WriteFile(path).ok());
        Result<std::unique_ptr<ModelFile>> m = OpenModel(path);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        model_ = std::move(*m);
        runner_.block_size = 16;
        runner_.max_step_tokens = 256;
        runner_.max_step_seqs = 8;
    }

    ServerConfig Config(const std::string& yaml) {
        Result<ServerConfig> c = ParseServerConfig("model: m.gguf\n" + yaml, "serve.yaml");
        EXPECT_TRUE(c.ok()) << c.status().ToString();
        return c.ok() ? *c : ServerConfig{};
    }

    Result<DevicePlan> Plan(const ServerConfig& c, const DeviceQuery& q, bool with_cuda = true) {
        return PlanServeDevices(c, c.EffectivePools(), *model_, runner_, 512, with_cuda, q);
    }

    std::string Error(const ServerConfig& c, const DeviceQuery& q, bool with_cuda = true) {
        Result<DevicePlan> r = Plan(c, q, with_cuda);
        return r.ok() ? "(ok)" : r.status().message();
    }

    testing::TempDir dir_;
    std::unique_ptr<ModelFile> model_;
    RunnerOptions runner_;
};

TEST_F(ServeDevicesTest, EachInstanceOnItsGpuWithTheKvPoolTheMemoryLeaves) {
    const ServerConfig c = Config(
        "backend: cuda\nkv_cache:\n  gpu_memory_utilization: 0.5\npools:\n"
        "  - name: main\n    instances:\n      - devices: [1]\n      - devices: [0]\n");
    const DeviceQuery q{.devices = {Gpu(0, 40 * kGiB), Gpu(1, 20 * kGiB)}, .error = ""};
    Result<DevicePlan> plan = Plan(c, q);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ASSERT_TRUE(plan->cuda);
    ASSERT_EQ(plan->ranks.size(), 2u);

    Result<int64_t> weights = ResidentWeightBytes(*model_, BackendKind::kCuda);
    ASSERT_TRUE(weights.ok()) << weights.status().ToString();
    const ModelSpec& s = model_->spec();
    const int64_t block = KvBlockBytes(s, runner_.kv_storage, 16, 1);
    EXPECT_EQ(block, s.num_layers * 2 * s.num_kv_heads * 16 * s.head_dim * 4);
    const int64_t reserve = GpuRankReserveBytes(s, runner_, 512, 1);
    EXPECT_GE(reserve, cuda::CudaBackend::kFixedBytes);
    for (const RankPlacement& r : plan->ranks) {
        EXPECT_EQ(r.weight_bytes, *weights);
        EXPECT_EQ(r.reserve_bytes, reserve);
        EXPECT_EQ(r.usable_bytes, r.free_bytes / 2);
        EXPECT_EQ(r.kv_blocks, (r.usable_bytes - *weights - reserve) / block);
    }
    EXPECT_EQ(plan->ranks[0].gpu, 1);
    EXPECT_EQ(plan->ranks[0].free_bytes, 20 * kGiB);
    EXPECT_EQ(plan->ranks[1].gpu, 0);

    RunnerOptions first = runner_, second = runner_;
    ApplyDevicePlan(*plan, 0, 0, &first);
    ApplyDevicePlan(*plan, 0, 1, &second);
    EXPECT_EQ(first.backend.kind, BackendKind::kCuda);
    EXPECT_EQ(first.backend.device, 1);
    EXPECT_EQ(first.num_kv_blocks, plan->ranks[0].kv_blocks);
    EXPECT_EQ(second.backend.device, 0);
    EXPECT_EQ(second.num_kv_blocks, plan->ranks[1].kv_blocks);

    // The startup log: one line per rank with the plan's numbers.
    const std::vector<std::string> lines = plan->Describe(c.EffectivePools());
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_EQ(lines[0], "pool main instance 0 rank 0: GPU 1, 20480 MiB free, 10240 MiB usable, "
                        "weights " + std::to_string(*weights / kMiB) + " MiB, buffers " +
                            std::to_string(reserve / kMiB) + " MiB, KV " +
                            std::to_string(plan->ranks[0].kv_blocks) + " blocks (" +
                            std::to_string(plan->ranks[0].kv_blocks * block / kMiB) + " MiB)");
}

// Tensor parallelism on GPUs: tp 2 as worker processes on GPUs of their own, and tp 2 on one GPU
// where devices lists it twice; RankGpus hands each rank its ordinal.
TEST_F(ServeDevicesTest, TpInstancesOnOwnOrSharedGpus) {
    const DeviceQuery two{.devices = {Gpu(0, 40 * kGiB), Gpu(1, 40 * kGiB)}, .error = ""};
    const ServerConfig own = Config("backend: cuda\ntp: 2\nworkers:\n  mode: processes\n");
    Result<DevicePlan> plan = Plan(own, two);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(RankGpus(*plan, 0, 0), (std::vector<int>{0, 1}));
    EXPECT_EQ(plan->ranks[0].ranks_on_gpu, 1);

    const ServerConfig shared = Config(
        "backend: cuda\npools:\n  - name: main\n    instances:\n      - tp: 2\n"
        "        devices: [0, 0]\n");
    plan = Plan(shared, {.devices = {Gpu(0, 40 * kGiB)}, .error = ""});
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(RankGpus(*plan, 0, 0), (std::vector<int>{0, 0}));
    ASSERT_EQ(plan->ranks.size(), 2u);
    EXPECT_EQ(plan->ranks[1].ranks_on_gpu, 2);
    EXPECT_EQ(plan->ranks[1].usable_bytes, static_cast<int64_t>(40 * kGiB * 0.9) / 2);

    // The CPU: no GPUs to hand out.
    plan = Plan(Config("backend: cpu\ntp: 2\n"), two);
    ASSERT_TRUE(plan.ok());
    EXPECT_TRUE(RankGpus(*plan, 0, 0).empty());
}

// cuda_graphs: true at tp 2: planned where the two ranks get GPUs of their own (their graphs'
// estimate at tp 2, with the layers' all-reduces), refused naming the shared GPU where the config
// puts both ranks on one, and refused with --stage-collectives.
TEST_F(ServeDevicesTest, GraphsAtTpTwoNeedAGpuPerRank) {
    const DeviceQuery two{.devices = {Gpu(0, 40 * kGiB), Gpu(1, 40 * kGiB)}, .error = ""};
    const ServerConfig own = Config("backend: cuda\ncuda_graphs: true\ntp: 2\n");
    Result<DevicePlan> plan = Plan(own, two);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(RankGpus(*plan, 0, 0), (std::vector<int>{0, 1}));
    for (const RankPlacement& r : plan->ranks) {
        EXPECT_EQ(r.graph_bytes, CudaGraphBytes(model_->spec().num_layers, 4, 2));
    }
    EXPECT_GT(CudaGraphBytes(model_->spec().num_layers, 4, 2),
              CudaGraphBytes(model_->spec().num_layers, 4, 1));
    const std::string shared = Error(
        Config("backend: cuda\ncuda_graphs: true\npools:\n  - name: main\n    instances:\n"
               "      - tp: 2\n        devices: [1, 1]\n"),
        two);
    EXPECT_NE(shared.find("cuda_graphs: true with pools[0] (main).instances[0]: 2 of its 2 ranks "
                          "share GPU 1"),
              std::string::npos)
        << shared;
    const Result<DevicePlan> staged = PlanServeDevices(own, own.EffectivePools(), *model_, runner_,
                                                       512, true, two, /*force_staged=*/true);
    ASSERT_FALSE(staged.ok());
    EXPECT_NE(staged.status().message().find("--stage-collectives"), std::string::npos)
        << staged.status().message();
}

// A prefill and a decode instance on the one GPU, with cuda_graphs: both share its memory, each
// has its decode graphs' estimate (one per decode bucket of max_num_seqs 8: 1, 2, 4, 8) taken
// off its KV pool, and the log names the host-staged handoff. The CPU refuses cuda_graphs.
TEST_F(ServeDevicesTest, PrefillAndDecodeOnOneGpuWithGraphs) {
    const std::string pools =
        "pools:\n  - name: prefill\n    role: prefill\n    instances:\n      - devices: [0]\n"
        "  - name: decode\n    role: decode\n    instances:\n      - devices: [0]\n";
    const DeviceQuery q{.devices = {Gpu(0, 40 * kGiB)}, .error = ""};
    Result<DevicePlan> eager = Plan(Config("backend: cuda\n" + pools), q);
    Result<DevicePlan> graphs = Plan(Config("backend: cuda\ncuda_graphs: true\n" + pools), q);
    ASSERT_TRUE(eager.ok()) << eager.status().ToString();
    ASSERT_TRUE(graphs.ok()) << graphs.status().ToString();
    ASSERT_EQ(graphs->ranks.size(), 2u);
    const ModelSpec& s = model_->spec();
    const int64_t block = KvBlockBytes(s, runner_.kv_storage, 16, 1);
    for (size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(graphs->ranks[i].ranks_on_gpu, 2);
        EXPECT_EQ(eager->ranks[i].graph_bytes, 0);
        EXPECT_EQ(graphs->ranks[i].graph_bytes, CudaGraphBytes(s.num_layers, 4, 1));
        EXPECT_EQ(graphs->ranks[i].kv_blocks,
                  (graphs->ranks[i].usable_bytes - graphs->ranks[i].weight_bytes -
                   graphs->ranks[i].reserve_bytes - graphs->ranks[i].graph_bytes) /
                      block);
    }
    const ServerConfig c = Config("backend: cuda\n" + pools);
    const std::vector<std::string> lines = graphs->Describe(c.EffectivePools());
    ASSERT_EQ(lines.size(), 3u);
    EXPECT_NE(lines[2].find("KV handoff between pools: host-staged"), std::string::npos) << lines[2];
    EXPECT_NE(Error(Config("cuda_graphs: true\n"), {}, /*with_cuda=*/false).find(
                  "cuda_graphs: true with backend: cpu"),
              std::string::npos);
}

// kv_transfer.path: nccl: a prefill rank's buffers count the pair path's offer bound, a decode
// rank's its largest receive (one max_context prompt of its KV heads, in its size class), so
// their KV pools shrink by as much; other paths count neither.
TEST_F(ServeDevicesTest, TheKvPairPathsBuffersAreCountedPerRole) {
    const std::string setup =
        "backend: cuda\nworkers:\n  mode: processes\npools:\n"
        "  - name: prefill\n    role: prefill\n    instances:\n      - devices: [0]\n"
        "  - name: decode\n    role: decode\n    instances:\n      - devices: [1]\n";
    const DeviceQuery q{.devices = {Gpu(0, 40 * kGiB), Gpu(1, 40 * kGiB)}, .error = ""};
    Result<DevicePlan> staged = Plan(Config(setup), q);
    Result<DevicePlan> pairs = Plan(Config(setup + "kv_transfer:\n  path: nccl\n"), q);
    ASSERT_TRUE(staged.ok()) << staged.status().ToString();
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    ASSERT_EQ(pairs->ranks.size(), 2u);
    const ModelSpec& s = model_->spec();
    const int64_t base = GpuRankReserveBytes(s, runner_, 512, 1);
    const int64_t block = KvBlockBytes(s, runner_.kv_storage, 16, 1);
    // 512 tokens of context: 32 blocks of every layer, rounded up to a size class.
    const int64_t receive = KvPairReserveBytes(s, runner_, 512, PoolRole::kDecode, 1);
    EXPECT_GE(receive, 32 * block);
    EXPECT_LE(receive, std::max<int64_t>(32 * block * 9 / 8, 64 * 1024));
    EXPECT_EQ(KvPairReserveBytes(s, runner_, 512, PoolRole::kPrefill, 1), kKvPairMaxOfferBytes);
    EXPECT_EQ(KvPairReserveBytes(s, runner_, 512, PoolRole::kMixed, 1), 0);
    for (size_t i = 0; i < 2; ++i) EXPECT_EQ(staged->ranks[i].reserve_bytes, base) << i;
    EXPECT_EQ(pairs->ranks[0].reserve_bytes, base + kKvPairMaxOfferBytes);
    EXPECT_EQ(pairs->ranks[1].reserve_bytes, base + receive);
    for (size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(pairs->ranks[i].kv_blocks,
                  (pairs->ranks[i].usable_bytes - pairs->ranks[i].weight_bytes -
                   pairs->ranks[i].reserve_bytes) /
                      block)
            << i;
        EXPECT_LT(pairs->ranks[i].kv_blocks, staged->ranks[i].kv_blocks) << i;
    }
}

TEST_F(ServeDevicesTest, FixedBlockCountAndTheSingleInstanceOfTp) {
    const ServerConfig c = Config("backend: auto\nkv_cache:\n  num_blocks: 64\n");
    Result<DevicePlan> plan = Plan(c, {.devices = {Gpu(0, 10 * kGiB)}, .error = ""});
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    ASSERT_EQ(plan->ranks.size(), 1u);
    EXPECT_EQ(plan->ranks[0].gpu, 0);
    EXPECT_EQ(plan->ranks[0].kv_blocks, 64);
}

TEST_F(ServeDevicesTest, CpuLeavesTheRunnerAndWarnsAboutGpuOrdinals) {
    const ServerConfig c =
        Config("pools:\n  - name: main\n    instances:\n      - devices: [0]\n");
    Result<DevicePlan> plan = Plan(c, {});
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_FALSE(plan->cuda);
    ASSERT_EQ(plan->warnings.size(), 1u);
    EXPECT_NE(plan->warnings[0].find("GPU 0 ignored"), std::string::npos) << plan->warnings[0];
    RunnerOptions r = runner_;
    ApplyDevicePlan(*plan, 0, 0, &r);
    EXPECT_EQ(r.backend.kind, BackendKind::kCpu);
    EXPECT_EQ(r.num_kv_blocks, runner_.num_kv_blocks);
    // auto without a device is the CPU too.
    Result<DevicePlan> none = Plan(Config("backend: auto\n"), {.devices = {}, .error = "x"});
    ASSERT_TRUE(none.ok());
    EXPECT_FALSE(none->cuda);
}

TEST_F(ServeDevicesTest, RefusalsNameTheSettingAndTheNumbers) {
    const DeviceQuery one{.devices = {Gpu(0, 40 * kGiB)}, .error = ""};
    EXPECT_EQ(Error(Config("backend: cuda\n"),
                    {.devices = {}, .error = "cudaGetDeviceCount: cudaErrorNoDevice: no "
                                             "CUDA-capable device is detected"}),
              "backend: cuda: no CUDA device found (0 devices; cudaGetDeviceCount: "
              "cudaErrorNoDevice: no CUDA-capable device is detected)");
    EXPECT_EQ(Error(Config("backend: cuda\n"), one, /*with_cuda=*/false),
              "backend: cuda: this kvshard was built without CUDA");
    EXPECT_EQ(Error(Config("backend: cuda\ntp: 2\n"), one),
              "pools[0] (default).instances[0].tp: 2 is larger than the 1 GPUs present (0); list "
              "the same GPU more than once in devices to share one");
    EXPECT_EQ(Error(Config("backend: cuda\npools:\n  - name: main\n    instances:\n"
                           "      - devices: [2]\n"),
                    one),
              "pools[0] (main).instances[0].devices[0]: GPU 2 does not exist (1 devices: 0)");
    EXPECT_EQ(Error(Config("backend: cuda\n"), {.devices = {Gpu(0, 40 * kGiB, 7)}, .error = ""}),
              "pools[0] (default).instances[0]: GPU 0 (NVIDIA H200) has compute capability 7.0; "
              "the CUDA backend needs 8.0 or newer");
    const std::string small = Error(Config("backend: cuda\n"), {.devices = {Gpu(0, 64 * kMiB)}, .error = ""});
    EXPECT_NE(small.find("rank 0 on GPU 0: weights "), std::string::npos) << small;
    EXPECT_NE(small.find("do not fit in 64 MiB free × kv_cache.gpu_memory_utilization 0.90 = 57 MiB"),
              std::string::npos)
        << small;
}

}  // namespace
}  // namespace kvshard::cli
