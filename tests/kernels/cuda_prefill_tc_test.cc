// The tensor-core prefill kernel (kernels/cuda/prefill_attention_tc.cu) on a GPU against the CPU
// attention (bf16 bound: relative L2 error 1e-2, a NaN fails) and against the fp32 kernel it is
// checked by (KVSHARD_CUDA_PREFILL=fp32, within 1e-5 of the CPU), and the setting's refusal of a
// layer the kernel cannot read. The suite carries "Gpu" in its name; it skips without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "common/device.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/paged_attention.h"
#if KVSHARD_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace kvshard {
namespace {

#if KVSHARD_WITH_CUDA

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return v;
}

// Relative L2 error of the rows of prefill chunks; infinite when any of them is NaN.
double RelL2(const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i])) return INFINITY;
        num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        den += double(want[i]) * want[i];
    }
    return std::sqrt(num / den);
}

class CudaPrefillTcGpuTest : public ::testing::Test {
  protected:
    void SetUp() override {
        if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
        Result<std::unique_ptr<Backend>> b = MakeBackend({.kind = BackendKind::kCuda});
        ASSERT_TRUE(b.ok()) << b.status().ToString();
        gpu_ = std::move(*b);
        cuda_ = static_cast<cuda::CudaBackend*>(gpu_.get());
        cpu_ = std::make_unique<CpuBackend>(BackendConfig{});
    }

    template <typename T>
    T* Put(const std::vector<T>& host) {
        Result<BackendBuffer> buf = gpu_->Allocate(std::max<size_t>(64, host.size() * sizeof(T)));
        KV_CHECK(buf.ok()) << buf.status().ToString();
        KV_CHECK(gpu_->CopyToDevice(buf->data(), host.data(), host.size() * sizeof(T)).ok());
        buffers_.push_back(std::move(*buf));
        return buffers_.back().As<T>();
    }
    template <typename T>
    std::vector<T> Get(const T* dev, size_t n) {
        std::vector<T> out(n);
        KV_CHECK(gpu_->CopyToHost(out.data(), dev, n * sizeof(T)).ok());
        const Status st = gpu_->Synchronize();
        KV_CHECK(st.ok()) << st.ToString();
        return out;
    }

    std::unique_ptr<Backend> gpu_;
    cuda::CudaBackend* cuda_ = nullptr;
    std::unique_ptr<CpuBackend> cpu_;
    std::vector<BackendBuffer> buffers_;
};

struct Shape {
    int64_t heads, kv_heads, hd;
    bool interleaved;  // kv_head_of_q: h % kv_heads instead of contiguous groups
};

// Every storage the kernel reads, head_dim 64 and 128, GQA groups of 1 to 65 (two head passes of
// a 64-query tile), interleaved groups, chunks behind cached prefixes mixed with a decode row,
// with and without a window.
TEST_F(CudaPrefillTcGpuTest, TensorCoreTilesMatchTheCpuWithinTheBf16Bound) {
    for (const Shape sh :
         {Shape{32, 8, 128, false}, Shape{9, 3, 64, false}, Shape{130, 2, 64, false},
          Shape{4, 4, 128, false}, Shape{12, 4, 128, true}}) {
        for (KvDtype storage : {KvDtype::kBf16, KvDtype::kFp8, KvDtype::kInt8}) {
            const int64_t bs = 16, heads = sh.heads, kv_heads = sh.kv_heads, hd = sh.hd;
            const std::vector<int32_t> ctx = {500, 90, 333}, news = {200, 1, 333};
            int64_t total = 0, blocks = 0;
            for (int32_t c : ctx) {
                total += c;
                blocks += (c + bs - 1) / bs;
            }
            const int64_t block_bytes = cpu::PagedLayerBytes(storage, bs, kv_heads, hd);
            std::vector<uint8_t> cpu_pool(static_cast<size_t>(blocks * block_bytes), 0);
            auto* gpu_pool = Put(cpu_pool);
            std::vector<int32_t> flat, ts = {0}, qs = {0};
            std::vector<int64_t> slots;
            int32_t next = int32_t(blocks);
            for (size_t s = 0; s < ctx.size(); ++s) {
                const size_t first = flat.size();
                for (int32_t p = 0; p < ctx[s]; p += bs) flat.push_back(--next);
                for (int32_t p = 0; p < ctx[s]; ++p) {
                    slots.push_back(int64_t(flat[first + p / bs]) * bs + p % bs);
                }
                ts.push_back(int32_t(flat.size()));
                qs.push_back(qs.back() + news[s]);
            }
            const int64_t kvw = kv_heads * hd;
            const std::vector<float> k = Random(total * kvw, 21, 2.0f), v = Random(total * kvw, 22);
            const PagedKvLayer cpu_kv =
                cpu::MakePagedKvLayer(cpu_pool.data(), block_bytes, 0, storage, bs, kv_heads, hd);
            const PagedKvLayer gpu_kv =
                cpu::MakePagedKvLayer(gpu_pool, block_bytes, 0, storage, bs, kv_heads, hd);
            cpu_->KvWrite(cpu_kv, k.data(), v.data(), kvw, slots.data(), total);
            gpu_->KvWrite(gpu_kv, Put(k), Put(v), kvw, Put(slots), total);
            std::vector<int32_t> kv_of_q;
            for (int64_t h = 0; h < heads; ++h) kv_of_q.push_back(int32_t(h % kv_heads));
            const int32_t* cpu_map = sh.interleaved ? kv_of_q.data() : nullptr;
            const int32_t* gpu_map = sh.interleaved ? Put(kv_of_q) : nullptr;
            const int64_t rows = qs.back();
            const std::vector<float> q = Random(rows * heads * hd, 23);
            const float* gpu_q = Put(q);
            for (int64_t window : {0, 77}) {
                const PagedAttentionBatch cpu_batch{.num_seqs = 3,
                                                    .query_starts = qs.data(),
                                                    .context_lens = ctx.data(),
                                                    .block_table_starts = ts.data(),
                                                    .block_tables = flat.data(),
                                                    .window = window};
                const PagedAttentionBatch gpu_batch{.num_seqs = 3,
                                                    .query_starts = Put(qs),
                                                    .context_lens = Put(ctx),
                                                    .block_table_starts = Put(ts),
                                                    .block_tables = Put(flat),
                                                    .window = window};
                std::vector<float> want(rows * heads * hd);
                cpu_->PagedAttention(q.data(), heads * hd, cpu_kv, cpu_batch, want.data(), heads,
                                     cpu_map);
                const std::string what =
                    "heads " + std::to_string(heads) + "/" + std::to_string(kv_heads) +
                    " head_dim " + std::to_string(hd) + " storage " +
                    std::string(KvDtypeName(storage)) + " window " + std::to_string(window);
                for (cuda::PrefillKernel kernel :
                     {cuda::PrefillKernel::kTensorCore, cuda::PrefillKernel::kFp32}) {
                    cuda_->set_prefill_kernel(kernel);
                    float* out = Put(std::vector<float>(want.size(), NAN));
                    gpu_->PagedAttention(gpu_q, heads * hd, gpu_kv, gpu_batch, out, heads, gpu_map);
                    const double err = RelL2(Get(out, want.size()), want);
                    if (kernel == cuda::PrefillKernel::kTensorCore) {
                        EXPECT_LE(err, 1e-2) << "tc " << what;
                        // bf16 operands: not the fp32 kernel's result in disguise.
                        EXPECT_GT(err, 1e-6) << "tc " << what;
                    } else {
                        EXPECT_LE(err, 1e-5) << "fp32 " << what;
                    }
                }
            }
        }
    }
}

TEST_F(CudaPrefillTcGpuTest, PinnedOnALayerItCannotReadIsAnErrorNamingTheSetting) {
    const int64_t bs = 16, heads = 4, kv_heads = 2, hd = 128;
    const int64_t block_bytes = cpu::PagedLayerBytes(KvDtype::kFp32, bs, kv_heads, hd);
    auto* pool = Put(std::vector<uint8_t>(static_cast<size_t>(block_bytes), 0));
    const PagedKvLayer kv =
        cpu::MakePagedKvLayer(pool, block_bytes, 0, KvDtype::kFp32, bs, kv_heads, hd);
    const PagedAttentionBatch batch{.num_seqs = 1,
                                    .query_starts = Put(std::vector<int32_t>{0, 4}),
                                    .context_lens = Put(std::vector<int32_t>{4}),
                                    .block_table_starts = Put(std::vector<int32_t>{0, 1}),
                                    .block_tables = Put(std::vector<int32_t>{0})};
    cuda_->set_prefill_kernel(cuda::PrefillKernel::kTensorCore);
    float* out = Put(std::vector<float>(4 * heads * hd, 0.0f));
    gpu_->PagedAttention(Put(std::vector<float>(4 * heads * hd, 0.5f)), heads * hd, kv, batch, out,
                         heads, nullptr);
    const Status st = gpu_->Synchronize();
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.ToString().find("KVSHARD_CUDA_PREFILL=tc"), std::string::npos) << st.ToString();
}

#endif  // KVSHARD_WITH_CUDA

}  // namespace
}  // namespace kvshard
