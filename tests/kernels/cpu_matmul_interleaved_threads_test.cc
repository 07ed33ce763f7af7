// A single row against the interleaved copy (kernels/cpu_matmul.cc MatMulInterleaved): each thread
// of the team prepares the row itself (block sums, or its int16 rounding) for the groups it takes,
// so the product must be the same bit for bit with any number of threads, for Q4_1 and Q8_0, with
// fp32 and int16 activations, with and without rows past the last whole group of 16.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_ops.h"
#include "tests/kernels/interleaved_matrix_test_util.h"

namespace kvshard::cpu {
namespace {

using Matrix = InterleavedTestMatrix;

class ThreadsScope {
  public:
    ThreadsScope() : threads_(NumThreads()) {}
    ~ThreadsScope() {
        SetThisThreadNumThreads(threads_);
        ResetActivationFormat();
    }

  private:
    int threads_;
};

std::vector<float> Product(const std::vector<float>& x, const StoredMatrix& w, int threads) {
    SetThisThreadNumThreads(threads);
    std::vector<float> y(static_cast<size_t>(w.rows), -1.0f);
    MatMulStored(x.data(), 1, w, y.data());
    return y;
}

TEST(CpuMatMulInterleavedThreads, SameBitsWithAnyTeamSize) {
    if (ActiveKernelIsa() != KernelIsa::kAvx512) GTEST_SKIP() << "no AVX-512 interleaved kernels";
    ThreadsScope scope;
    std::mt19937 gen(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    int checked = 0;
    for (const ActivationFormat format : {ActivationFormat::kFp32, ActivationFormat::kInt16}) {
        ForceActivationFormat(format);
        for (const DType dtype : {DType::kQ4_1, DType::kQ8_0}) {
            // 576 x 576 (o), 968 x 576 (groups and 8 rows past the last), 576 x 1536 (down),
            // 4,104 x 256 (many groups, a short row).
            for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{576, 576},
                                            {968, 576},
                                            {576, 1536},
                                            {4104, 256}}) {
                Matrix m(dtype, rows, cols, static_cast<uint32_t>(rows + cols));
                ASSERT_NE(m.stored.interleaved, nullptr);
                std::vector<float> x(static_cast<size_t>(cols));
                for (float& v : x) v = normal(gen);
                const std::vector<float> alone = Product(x, m.stored, 1);
                for (const int threads : {2, 3, 4}) {
                    const std::vector<float> y = Product(x, m.stored, threads);
                    ASSERT_EQ(std::memcmp(y.data(), alone.data(), y.size() * sizeof(float)), 0)
                        << DTypeName(dtype) << " " << rows << "x" << cols << " "
                        << ActivationFormatName(format) << " with " << threads << " threads";
                }
                // Every output written, and not a constant: the product ran.
                for (const float v : alone) ASSERT_NE(v, -1.0f);
                ASSERT_NE(alone.front(), alone.back());
                ++checked;
            }
        }
    }
    EXPECT_EQ(checked, 16);
}

}  // namespace
}  // namespace kvshard::cpu
