// The synthetic prefill step the GPU benchmark times (kernels/cuda/synthetic_prefill.h,
// kvshard_cuda_prefill_step_bench): on the CPU backend, its logits depend on the prompt length
// only through the prompt (a shorter SetTokens gives a fresh instance's logits), its FLOP counts;
// on a device, the whole step with each prefill attention kernel against the CPU.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "common/build_config.h"
#include "common/device.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/synthetic_prefill.h"

#if KVSHARD_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace kvshard {
namespace {

// head_dim 64 and a bf16 pool: a layer the tensor-core kernel reads.
cuda::DecodeShape SmallShape() {
    return {.layers = 2, .hidden = 256, .heads = 4, .kv_heads = 2, .head_dim = 64, .ffn = 384,
            .vocab = 100, .block_size = 16};
}

double RelL2(const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < got.size(); ++i) {
        num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        den += double(want[i]) * want[i];
    }
    return std::sqrt(num / den);
}

std::vector<float> PrefillLogits(Backend& b, int64_t max_tokens, int64_t tokens) {
    auto p = cuda::SyntheticPrefill::Create(b, SmallShape(), max_tokens, 7);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return {};
    EXPECT_TRUE(p->SetTokens(tokens).ok());
    p->Step();
    auto l = p->Logits();
    EXPECT_TRUE(l.ok());
    return l.ok() ? *l : std::vector<float>{};
}

TEST(SyntheticPrefillTest, AShorterPromptGivesAFreshInstancesLogits) {
    CpuBackend cpu(BackendConfig{});
    const std::vector<float> long_prompt = PrefillLogits(cpu, 40, 40);
    const std::vector<float> short_of_long = PrefillLogits(cpu, 40, 23);
    const std::vector<float> fresh = PrefillLogits(cpu, 23, 23);
    ASSERT_EQ(long_prompt.size(), 100u);
    for (float x : long_prompt) ASSERT_TRUE(std::isfinite(x));
    // The same ids, weights and positions: the pool's extra blocks and rows are not read.
    EXPECT_LE(RelL2(short_of_long, fresh), 1e-6);
    // The last row of a longer prompt is another token's, seeing more keys.
    EXPECT_GT(RelL2(long_prompt, fresh), 1e-3);
}

TEST(SyntheticPrefillTest, CountsTheStepsFlops) {
    const cuda::DecodeShape s = cuda::DecodeShape::Llama3_8B();
    // Llama-3-8B: 6144x4096 QKV, 4096x4096 O, 28672x4096 gate|up, 4096x14336 down.
    EXPECT_EQ(s.layer_weight_elements(), 218103808);
    EXPECT_DOUBLE_EQ(cuda::SyntheticPrefill::GemmFlops(s, 2048),
                     2.0 * 2048 * 32 * 218103808.0 + 2.0 * 128256 * 4096);
    // Causal: 2048·2049/2 visible pairs, 4 FLOPs a pair and dim, 32 heads, 32 layers.
    EXPECT_DOUBLE_EQ(cuda::SyntheticPrefill::AttentionFlops(s, 2048),
                     4.0 * 32 * 32 * 128 * 2048.0 * 2049.0 / 2.0);
}

#if KVSHARD_WITH_CUDA
// The whole step on the device, with the fp32 and the tensor-core prefill attention, against the
// CPU backend (bf16 weights on both; the bound is the synthetic decode step's).
TEST(SyntheticPrefillGpuTest, StepMatchesTheCpuWithEitherKernel) {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
    CpuBackend cpu(BackendConfig{});
    auto gpu = MakeBackend({.kind = BackendKind::kCuda});
    ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
    auto* cuda = dynamic_cast<cuda::CudaBackend*>(gpu->get());
    ASSERT_NE(cuda, nullptr);
    const std::vector<float> want = PrefillLogits(cpu, 200, 200);
    for (cuda::PrefillKernel k : {cuda::PrefillKernel::kFp32, cuda::PrefillKernel::kTensorCore}) {
        cuda->set_prefill_kernel(k);
        const std::vector<float> got = PrefillLogits(**gpu, 200, 200);
        ASSERT_EQ(got.size(), want.size());
        EXPECT_LE(RelL2(got, want), 2e-2) << (k == cuda::PrefillKernel::kFp32 ? "fp32" : "tc");
    }
}
#endif

}  // namespace
}  // namespace kvshard
