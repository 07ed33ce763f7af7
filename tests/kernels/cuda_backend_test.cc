// CudaBackend against the CPU backend on the same inputs: what the op table
// (backend_ops_test.cc) does not reach — long contexts that take the split-KV path, 8-bit KV
// bytes identical to the CPU's, prefill chunks in FA2-style query tiles, the cuBLASLt plan cache.
// The suite carries "Gpu" in its name; cases that need a device skip without one. The first
// case, the refusal without a device, runs on every machine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "common/device.h"
#include "common/dtype.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/synthetic_decode.h"
#include "kernels/paged_attention.h"
#include "tests/kernels/cuda_gpu_test_util.h"

namespace kvshard {
namespace {

TEST(CudaBackendFactoryTest, RefusedWithAClearErrorWithoutADevice) {
    if (DeviceCount() > 0) {
        // With a device, a missing ordinal is the refusal to check.
        Result<std::unique_ptr<Backend>> b =
            MakeBackend({.kind = BackendKind::kCuda, .device = DeviceCount() + 3});
        ASSERT_FALSE(b.ok());
        EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
        EXPECT_NE(b.status().message().find("does not exist"), std::string::npos)
            << b.status().message();
        return;
    }
    Result<std::unique_ptr<Backend>> b = MakeBackend({.kind = BackendKind::kCuda});
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(b.status().message().rfind("backend: cuda: ", 0), 0u) << b.status().message();
    EXPECT_NE(b.status().message().find("use backend cpu"), std::string::npos);
}

cuda::DecodeShape TinyShape() {
    return {.layers = 2,
            .hidden = 64,
            .heads = 4,
            .kv_heads = 2,
            .head_dim = 16,
            .ffn = 96,
            .vocab = 50,
            .block_size = 4};
}

// The synthetic decode step the GPU benchmark times runs the runner's ops on the CPU backend:
// finite logits that differ across the batch's rows, the same for the same seed.
TEST(SyntheticDecodeTest, RunsADecodeStepOnTheCpuBackend) {
    CpuBackend cpu(BackendConfig{});
    auto a = cuda::SyntheticDecode::Create(cpu, TinyShape(), 3, 9, 5);
    auto b = cuda::SyntheticDecode::Create(cpu, TinyShape(), 3, 9, 5);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    a->Step(3);
    b->Step(3);
    auto la = a->Logits(3), lb = b->Logits(3);
    ASSERT_TRUE(la.ok() && lb.ok());
    ASSERT_EQ(la->size(), 3u * 50);
    for (float x : *la) ASSERT_TRUE(std::isfinite(x));
    EXPECT_EQ(*la, *lb);
    EXPECT_NE(std::vector<float>(la->begin(), la->begin() + 50),
              std::vector<float>(la->begin() + 50, la->begin() + 100));
    const auto times = a->OpTimes(3, 2);
    ASSERT_EQ(times.size(), 12u);  // the CPU backend has the fused RoPE + KV write too
    EXPECT_EQ(times.front().first, "embedding");
    EXPECT_EQ(times.back().first, "rope_kv_write");
    for (const auto& [name, ms] : times) EXPECT_GE(ms, 0.0) << name;
    EXPECT_EQ(TinyShape().weight_bytes(),
              2 * (2 * (128 * 64 + 64 * 64 + 2 * 96 * 64 + 64 * 96) + 2 * 50 * 64));
}

#if KVSHARD_WITH_CUDA

using cuda_test::LayOutPaged;
using cuda_test::PagedLayout;
using cuda_test::Random;
using cuda_test::RelL2;

// The fp32 prefill kernel, whose bounds these cases state; the tensor-core kernel has its own
// (cuda_prefill_tc_test.cc).
class CudaBackendGpuTest : public cuda_test::CudaGpuTest {
  protected:
    void SetUp() override {
        CudaGpuTest::SetUp();
        if (IsSkipped() || HasFatalFailure()) return;
        cuda_->set_prefill_kernel(cuda::PrefillKernel::kFp32);
    }
};

// K/V written on both backends from the same rows give the same pool bytes (fp32, bf16 and fp16
// rounded to nearest even, int8 and fp8 with their scales); attention over one pool (long decode
// contexts split over many blocks, and a prefill chunk) agrees with the CPU's.
TEST_F(CudaBackendGpuTest, KvBytesAndSplitAttentionMatchTheCpu) {
    for (KvDtype storage :
         {KvDtype::kFp32, KvDtype::kInt8, KvDtype::kFp8, KvDtype::kBf16, KvDtype::kFp16}) {
        const int64_t bs = 16, heads = 8, kv_heads = 2, hd = 128, layers = 1;
        const std::vector<int32_t> ctx = {1000, 37, 300}, news = {1, 1, 45};
        const PagedLayout layout = LayOutPaged(ctx, news, bs);
        const KvPools pools = WriteSameKv(layout, storage, bs, kv_heads, hd, 1, 2, layers);
        const PagedKvLayer& cpu_kv = pools.cpu_kv;
        const PagedKvLayer& gpu_kv = pools.gpu_kv;
        const std::vector<uint8_t> got_pool = Get(pools.gpu_pool, pools.cpu_pool.size());
        EXPECT_EQ(0, std::memcmp(got_pool.data(), pools.cpu_pool.data(), pools.cpu_pool.size()))
            << "storage " << KvDtypeName(storage);

        const int64_t rows = layout.query_starts.back();
        const std::vector<float> q = Random(rows * heads * hd, 3);
        // Without a window, and a window of 100 (the decode row's splits mostly empty; the
        // prefill chunk's rows each starting at their own key).
        for (int64_t window : {0, 100}) {
            const PagedAttentionBatch cpu_batch = HostBatch(layout, ctx, window);
            const PagedAttentionBatch gpu_batch = DeviceBatch(layout, ctx, window);
            std::vector<float> want(rows * heads * hd);
            cpu_->PagedAttention(q.data(), heads * hd, cpu_kv, cpu_batch, want.data(), heads,
                                 nullptr);
            float* out = Put(std::vector<float>(want.size(), NAN));
            gpu_->PagedAttention(Put(q), heads * hd, gpu_kv, gpu_batch, out, heads, nullptr);
            EXPECT_LE(RelL2(Get(out, want.size()), want), 1e-5)
                << "storage " << KvDtypeName(storage) << " window " << window;
        }
    }
}

// The FA2-style prefill kernel at each head-dim class it is compiled for (64, 128, 256; 80 pads
// to 128), GQA groups of 1 to 8 and a group wider than one tile's 64 queries (65 heads a KV
// head: two head passes, the second of one head), long chunks over many query tiles behind a
// cached prefix,
// mixed with decode rows, with and without a window: the CPU's attention within 1e-5.
TEST_F(CudaBackendGpuTest, PrefillTilesMatchTheCpuAtEveryHeadDim) {
    struct Shape {
        int64_t heads, kv_heads, hd;
    };
    for (const Shape sh : {Shape{9, 3, 64}, Shape{32, 8, 128}, Shape{8, 1, 256}, Shape{4, 4, 80},
                           Shape{130, 2, 64}}) {
        for (KvDtype storage : {KvDtype::kFp32, KvDtype::kBf16}) {
            const int64_t bs = 16, heads = sh.heads, kv_heads = sh.kv_heads, hd = sh.hd;
            const std::vector<int32_t> ctx = {500, 90, 333}, news = {200, 1, 333};
            const PagedLayout layout = LayOutPaged(ctx, news, bs);
            const KvPools pools = WriteSameKv(layout, storage, bs, kv_heads, hd, 11, 12);
            const PagedKvLayer& cpu_kv = pools.cpu_kv;
            const PagedKvLayer& gpu_kv = pools.gpu_kv;
            const int64_t rows = layout.query_starts.back();
            const std::vector<float> q = Random(rows * heads * hd, 13);
            for (int64_t window : {0, 77}) {
                const PagedAttentionBatch cpu_batch = HostBatch(layout, ctx, window);
                const PagedAttentionBatch gpu_batch = DeviceBatch(layout, ctx, window);
                std::vector<float> want(rows * heads * hd);
                cpu_->PagedAttention(q.data(), heads * hd, cpu_kv, cpu_batch, want.data(), heads,
                                     nullptr);
                float* out = Put(std::vector<float>(want.size(), NAN));
                gpu_->PagedAttention(Put(q), heads * hd, gpu_kv, gpu_batch, out, heads, nullptr);
                EXPECT_LE(RelL2(Get(out, want.size()), want), 1e-5)
                    << "heads " << heads << "/" << kv_heads << " head_dim " << hd << " storage "
                    << KvDtypeName(storage) << " window " << window;
            }
        }
    }
}

TEST_F(CudaBackendGpuTest, Bf16ProductsAgreeAndPlansAreCachedPerShape) {
    auto* cuda = dynamic_cast<cuda::CudaBackend*>(gpu_.get());
    ASSERT_NE(cuda, nullptr);
    const int64_t n = 1024, k = 576;
    std::vector<uint8_t> w(RowBytes(DType::kQ8_0, k) * n);
    std::mt19937 rng(7);
    for (uint8_t& b : w) b = uint8_t(rng());
    for (size_t at = 0; at < w.size(); at += BlockBytes(DType::kQ8_0)) {
        const uint16_t d = FloatToHalf(0.01f);
        std::memcpy(&w[at], &d, 2);
    }
    const WeightView cpu_w{.dtype = DType::kQ8_0, .data = w.data(), .rows = n, .cols = k};
    const WeightView gpu_w{.dtype = DType::kQ8_0, .data = Put(w), .rows = n, .cols = k};
    ASSERT_TRUE(cuda->PrepareWeight(gpu_w, false).ok());
    const size_t plans0 = cuda->gemm_plans();
    for (int64_t m : {1, 8, 8, 37}) {
        const std::vector<float> x = Random(m * k, uint32_t(m));
        std::vector<float> want(m * n);
        cpu_->MatMul(x.data(), m, cpu_w, want.data());
        float* y = Put(std::vector<float>(want.size(), NAN));
        gpu_->MatMul(Put(x), m, gpu_w, y);
        EXPECT_LE(RelL2(Get(y, want.size()), want), 1e-2) << "m=" << m;
    }
    EXPECT_EQ(cuda->gemm_plans(), plans0 + 3) << "m = 1, 8, 37: one plan each";
}

// A weight's bf16 copy is freed with the weight's allocation: another weight later stored at the
// same address (cudaMalloc reuses it) is multiplied as itself, not as the old copy.
TEST_F(CudaBackendGpuTest, WeightCopiesGoWithTheirAllocation) {
    const int64_t n = 64, k = 128, m = 2;
    const std::vector<float> x = Random(m * k, 11);
    float* dx = Put(x);
    for (uint32_t seed : {1u, 2u, 3u}) {
        std::vector<uint8_t> w(RowBytes(DType::kF16, k) * n);
        const std::vector<float> f = Random(n * k, seed);
        for (size_t i = 0; i < f.size(); ++i) {
            const uint16_t h = FloatToHalf(f[i]);
            std::memcpy(&w[2 * i], &h, 2);
        }
        Result<BackendBuffer> buf = gpu_->Allocate(w.size());
        ASSERT_TRUE(buf.ok());
        ASSERT_TRUE(gpu_->CopyToDevice(buf->data(), w.data(), w.size()).ok());
        const WeightView view{.dtype = DType::kF16, .data = buf->data(), .rows = n, .cols = k};
        std::vector<float> want(m * n);
        cpu_->MatMul(x.data(), m, {.dtype = DType::kF16, .data = w.data(), .rows = n, .cols = k},
                     want.data());
        float* y = Put(std::vector<float>(want.size(), NAN));
        gpu_->MatMul(dx, m, view, y);
        EXPECT_LE(RelL2(Get(y, want.size()), want), 1e-2) << "seed " << seed;
    }  // the weight's buffer is freed here, and its copy with it
}

// A whole synthetic decode step (bf16 weights) on the device against the CPU backend.
TEST_F(CudaBackendGpuTest, SyntheticDecodeStepMatchesTheCpu) {
    auto on_cpu = cuda::SyntheticDecode::Create(*cpu_, TinyShape(), 5, 40, 3);
    auto on_gpu = cuda::SyntheticDecode::Create(*gpu_, TinyShape(), 5, 40, 3);
    ASSERT_TRUE(on_cpu.ok()) << on_cpu.status().ToString();
    ASSERT_TRUE(on_gpu.ok()) << on_gpu.status().ToString();
    on_cpu->Step(5);
    on_gpu->Step(5);
    auto want = on_cpu->Logits(5), got = on_gpu->Logits(5);
    ASSERT_TRUE(want.ok() && got.ok()) << got.status().ToString();
    EXPECT_LE(RelL2(*got, *want), 2e-2);
}

// A captured decode step replayed as a CUDA graph gives the eager step's logits, bit for bit;
// a capture that would have to make a weight copy is refused with the reason.
TEST_F(CudaBackendGpuTest, GraphReplayGivesTheEagerLogits) {
    auto* cuda = dynamic_cast<cuda::CudaBackend*>(gpu_.get());
    ASSERT_NE(cuda, nullptr);
    auto d = cuda::SyntheticDecode::Create(*gpu_, TinyShape(), 4, 30, 8);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    d->Step(4);
    auto eager = d->Logits(4);
    ASSERT_TRUE(eager.ok()) << eager.status().ToString();
    ASSERT_TRUE(cuda->BeginCapture().ok());
    d->Step(4);
    Result<int> graph = cuda->EndCapture();
    ASSERT_TRUE(graph.ok()) << graph.status().ToString();
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(cuda->Replay(*graph).ok());
    auto replayed = d->Logits(4);
    ASSERT_TRUE(replayed.ok()) << replayed.status().ToString();
    EXPECT_EQ(*replayed, *eager);
    EXPECT_FALSE(cuda->Replay(*graph + 1).ok());
}

// Graphs stay valid when a later, larger product outgrows the activation copy they were captured
// with (the old copy is kept), and a capture refused for a missing weight copy fails EndCapture
// only: the backend runs eagerly after it.
TEST_F(CudaBackendGpuTest, GraphsOutliveActivationGrowthAndRefusedCapturesDoNotStick) {
    auto* cuda = dynamic_cast<cuda::CudaBackend*>(gpu_.get());
    ASSERT_NE(cuda, nullptr);
    const int64_t n = 64, k = 256;
    std::vector<uint16_t> wb(static_cast<size_t>(n * k));
    const std::vector<float> wf = Random(wb.size(), 6);
    for (size_t i = 0; i < wb.size(); ++i) wb[i] = FloatToBF16(wf[i]);
    const WeightView w{.dtype = DType::kBF16, .data = Put(wb), .rows = n, .cols = k};
    float* x = Put(Random(k, 7));
    float* y = Put(std::vector<float>(n, 0.0f));
    gpu_->MatMul(x, 1, w, y);
    const std::vector<float> eager = Get(y, n);
    ASSERT_TRUE(cuda->BeginCapture().ok());
    gpu_->MatMul(x, 1, w, y);
    Result<int> graph = cuda->EndCapture();
    ASSERT_TRUE(graph.ok()) << graph.status().ToString();
    // 40000 rows × 256 columns of bf16 activations: 20 MB, past the initial 16 MiB copy.
    const int64_t big = 40000;
    float* bx = Put(Random(static_cast<size_t>(big * k), 8));
    float* by = Put(std::vector<float>(static_cast<size_t>(big * n)));
    gpu_->MatMul(bx, big, w, by);
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const std::vector<float> zeros(n, 0.0f);
    ASSERT_TRUE(gpu_->CopyToDevice(y, zeros.data(), n * sizeof(float)).ok());
    ASSERT_TRUE(cuda->Replay(*graph).ok());
    EXPECT_EQ(Get(y, n), eager);

    // A Q8_0 weight (all zeros: scale 0) has no bf16 copy yet: refused inside the capture.
    const std::vector<uint8_t> q8(RowBytes(DType::kQ8_0, k) * static_cast<size_t>(n), 0);
    const WeightView wq{.dtype = DType::kQ8_0, .data = Put(q8), .rows = n, .cols = k};
    ASSERT_TRUE(cuda->BeginCapture().ok());
    gpu_->MatMul(x, 1, wq, y);
    Result<int> refused = cuda->EndCapture();
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("run the step once eagerly"), std::string::npos)
        << refused.status().message();
    gpu_->MatMul(x, 1, w, y);
    EXPECT_TRUE(gpu_->Synchronize().ok());
    EXPECT_EQ(Get(y, n), eager);
}

#endif  // KVSHARD_WITH_CUDA

}  // namespace
}  // namespace kvshard
