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
#include "tests/kernels/cuda_gpu_test_util.h"

namespace kvshard {
namespace {

#if KVSHARD_WITH_CUDA

using cuda_test::LayOutPaged;
using cuda_test::PagedLayout;
using cuda_test::Random;
using cuda_test::RelL2;

class CudaPrefillTcGpuTest : public cuda_test::CudaGpuTest {};

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
            const PagedLayout layout = LayOutPaged(ctx, news, bs);
            const KvPools pools = WriteSameKv(layout, storage, bs, kv_heads, hd, 21, 22);
            const PagedKvLayer& cpu_kv = pools.cpu_kv;
            const PagedKvLayer& gpu_kv = pools.gpu_kv;
            std::vector<int32_t> kv_of_q;
            for (int64_t h = 0; h < heads; ++h) kv_of_q.push_back(int32_t(h % kv_heads));
            const int32_t* cpu_map = sh.interleaved ? kv_of_q.data() : nullptr;
            const int32_t* gpu_map = sh.interleaved ? Put(kv_of_q) : nullptr;
            const int64_t rows = layout.query_starts.back();
            const std::vector<float> q = Random(rows * heads * hd, 23);
            const float* gpu_q = Put(q);
            for (int64_t window : {0, 77}) {
                const PagedAttentionBatch cpu_batch = HostBatch(layout, ctx, window);
                const PagedAttentionBatch gpu_batch = DeviceBatch(layout, ctx, window);
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
