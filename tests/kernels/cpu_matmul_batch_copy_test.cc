// BatchWeightSource::kCopy (kernels/cpu_matmul.h): the products that dequantize weight rows (the
// batched-decode GEMM, the prefill panels, the bf16 kernel, the embedding gather) read the whole
// groups of the interleaved copy and give the same bits as with the stored rows; and they do read
// the copy: with the stored rows of the whole groups overwritten, kCopy still gives the original
// product and kStored does not.
#include "kernels/cpu_matmul_batch_copy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_gemm.h"
#include "kernels/cpu_matmul.h"
#include "tests/kernels/interleaved_matrix_test_util.h"

namespace kvshard::cpu {
namespace {

using Matrix = InterleavedTestMatrix;

class SourceScope {
  public:
    ~SourceScope() {
        ResetBatchWeightSource();
        gemm::ResetGemmMode();
    }
};

std::vector<float> Product(const std::vector<float>& x, int64_t m, const StoredMatrix& w) {
    std::vector<float> y(static_cast<size_t>(m * w.rows), -1.0f);
    MatMulStored(x.data(), m, w, y.data());
    return y;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CpuMatMulBatchCopy, SameBitsAsTheStoredRowsAndReadsTheCopy) {
    if (ActiveKernelIsa() != KernelIsa::kAvx512) GTEST_SKIP() << "no AVX-512 interleaved copies";
    SourceScope scope;
    std::mt19937 gen(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    int checked = 0;
    for (const DType dtype : {DType::kQ4_1, DType::kQ8_0}) {
        // Whole groups only; 7 rows past the last group (read from the stored rows); a product
        // whose GEMM strips of 12 rows and panels cut through groups.
        for (const auto& [rows, cols] :
             {std::pair<int64_t, int64_t>{96, 64}, {87, 96}, {200, 576}}) {
            Matrix w(dtype, rows, cols, static_cast<uint32_t>(rows * 31 + cols));
            // m = 20 and 128: the batched-decode GEMM; m = 150: the sgemm panels.
            for (const int64_t m : {int64_t{20}, int64_t{128}, int64_t{150}}) {
                std::vector<float> x(static_cast<size_t>(m * cols));
                for (float& v : x) v = normal(gen);
                ForceBatchWeightSource(BatchWeightSource::kStored);
                const std::vector<float> stored = Product(x, m, w.stored);
                ForceBatchWeightSource(BatchWeightSource::kCopy);
                EXPECT_TRUE(SameBits(Product(x, m, w.stored), stored))
                    << DTypeName(dtype) << " " << rows << "x" << cols << " m=" << m;

                // The stored rows of the whole groups overwritten: only the copy still holds them.
                const size_t group_rows_bytes =
                    RowBytes(dtype, cols) * static_cast<size_t>(rows / kInterleaveRows * 16);
                std::vector<uint8_t> other = w.bytes;
                std::fill(other.begin(), other.begin() + static_cast<ptrdiff_t>(group_rows_bytes),
                          uint8_t{0x11});
                StoredMatrix broken = w.stored;
                broken.data = other.data();
                EXPECT_TRUE(SameBits(Product(x, m, broken), stored))
                    << DTypeName(dtype) << " " << rows << "x" << cols << " m=" << m;
                ForceBatchWeightSource(BatchWeightSource::kStored);
                EXPECT_FALSE(SameBits(Product(x, m, broken), stored));
                ++checked;
            }
        }
    }
    EXPECT_EQ(checked, 18);
}

TEST(CpuMatMulBatchCopy, EmbeddingRowsFromTheCopy) {
    if (ActiveKernelIsa() != KernelIsa::kAvx512) GTEST_SKIP() << "no AVX-512 interleaved copies";
    SourceScope scope;
    for (const DType dtype : {DType::kQ4_1, DType::kQ8_0}) {
        Matrix table(dtype, 40, 64, 3);
        const std::vector<int32_t> ids = {0, 17, 31, 32, 39, 5};
        std::vector<float> stored(ids.size() * 64);
        std::vector<float> copy(ids.size() * 64);
        ForceBatchWeightSource(BatchWeightSource::kStored);
        EmbeddingRows(table.stored, 0, ids.data(), static_cast<int64_t>(ids.size()), stored.data());
        ForceBatchWeightSource(BatchWeightSource::kCopy);
        EmbeddingRows(table.stored, 0, ids.data(), static_cast<int64_t>(ids.size()), copy.data());
        EXPECT_TRUE(SameBits(stored, copy)) << DTypeName(dtype);
    }
}

TEST(CpuMatMulBatchCopy, SourceNames) {
    EXPECT_EQ(BatchWeightSourceName(BatchWeightSource::kStored), "stored");
    EXPECT_EQ(BatchWeightSourceName(BatchWeightSource::kCopy), "copy");
}

}  // namespace
}  // namespace kvshard::cpu
