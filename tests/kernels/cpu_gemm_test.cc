// The batched-decode kernel (kernels/cpu_gemm.h): its product bit for bit against the sum it
// promises (fp32 FMAs in order of k from zero, on the weights its dequantizer gives), a row's
// result independent of the batch, and the rule by which MatMulStored picks it.
#include "kernels/cpu_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_matmul_internal.h"

namespace kvshard::cpu::gemm {
namespace {

bool HasAvx512() { return DetectedKernelIsa() == KernelIsa::kAvx512; }

// A {rows, cols} matrix of `dtype`: random quants, small finite fp16 scales (Q8_0/Q4_0/Q4_1) or
// random values in [-1, 1] (F16), at an odd byte offset (the kernel must not assume alignment).
class RandomMatrix {
  public:
    RandomMatrix(DType dtype, int64_t rows, int64_t cols, uint32_t seed)
        : bytes_(RowBytes(dtype, cols) * static_cast<size_t>(rows) + 1) {
        std::mt19937 gen(seed);
        std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
        uint8_t* p = bytes_.data() + 1;
        const int64_t blocks = rows * cols / BlockElements(dtype);
        for (int64_t b = 0; b < blocks; ++b, p += BlockBytes(dtype)) {
            for (size_t at = 0; at < BlockBytes(dtype); ++at) p[at] = static_cast<uint8_t>(gen());
            const uint16_t d =
                dtype == DType::kF16 ? FloatToHalf(unit(gen)) : FloatToHalf(0.02f * unit(gen));
            std::memcpy(p, &d, sizeof(d));
            if (dtype == DType::kQ4_1) {
                const uint16_t mn = FloatToHalf(0.4f * unit(gen));
                std::memcpy(p + 2, &mn, sizeof(mn));
            }
        }
        matrix_ = {dtype, bytes_.data() + 1, rows, cols};
    }
    const StoredMatrix& matrix() const { return matrix_; }

  private:
    std::vector<uint8_t> bytes_;
    StoredMatrix matrix_;
};

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (float& f : v) f = unit(gen);
    return v;
}

// y[i, j] = fma(x[i, p], w[j, p], ...) over p = 0 .. k-1 from 0, in float, on the rows the
// AVX-512 dequantizer writes: what GemmAvx512 promises, bit for bit.
std::vector<float> SequentialFma(const std::vector<float>& x, int64_t m, const StoredMatrix& w) {
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    std::vector<float> rows(static_cast<size_t>(n * k));
    matmul_internal::DequantizeRowsAvx512(w, 0, n, rows.data());
    std::vector<float> y(static_cast<size_t>(m * n));
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
            float acc = 0.0f;
            for (int64_t p = 0; p < k; ++p) acc = std::fma(x[i * k + p], rows[j * k + p], acc);
            y[i * n + j] = acc;
        }
    }
    return y;
}

struct Case {
    DType dtype;
    int64_t m, n, k;
};

// m across the tiles (16 and 32 rows) and their tails; n across the strip of 12 and its tail;
// the default model's k = 576 and the smallest block; k large enough for several row blocks.
constexpr Case kCases[] = {
    {DType::kQ4_1, 1, 12, 32},
    {DType::kQ4_1, 15, 13, 64},
    {DType::kQ4_1, 16, 24, 576},
    {DType::kQ4_1, 17, 37, 576},
    {DType::kQ4_1, 32, 192, 576},
    {DType::kQ4_1, 33, 5, 96},
    {DType::kQ4_1, 48, 100, 576},
    {DType::kQ8_0, 32, 960, 576},
    {DType::kQ8_0, 47, 11, 1536},
    {DType::kQ4_0, 24, 70, 1536},
    {DType::kF16, 40, 19, 45},
    {DType::kQ4_1, 130, 30, 64},
    // Several blocks of activation rows (32 rows each at k >= 1536) and chunks of strips.
    {DType::kQ4_1, 100, 100, 1536},
    {DType::kQ8_0, 77, 37, 2048},
};

TEST(GemmAvx512, EqualsTheSequentialFmaSumBitForBit) {
    if (!HasAvx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
    for (const Case& c : kCases) {
        const RandomMatrix w(c.dtype, c.n, c.k, static_cast<uint32_t>(c.m * 31 + c.n));
        const std::vector<float> x = RandomFloats(static_cast<size_t>(c.m * c.k), 7);
        std::vector<float> y(static_cast<size_t>(c.m * c.n), std::nanf(""));
        GemmAvx512(x.data(), c.m, w.matrix(), y.data());
        const std::vector<float> ref = SequentialFma(x, c.m, w.matrix());
        int64_t differ = 0;
        for (size_t i = 0; i < y.size(); ++i) differ += std::memcmp(&y[i], &ref[i], 4) != 0;
        EXPECT_EQ(differ, 0) << DTypeName(c.dtype) << " m=" << c.m << " n=" << c.n << " k=" << c.k;
    }
}

TEST(GemmAvx512, ARowsProductDoesNotDependOnTheBatch) {
    if (!HasAvx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
    const RandomMatrix w(DType::kQ4_1, 100, 576, 3);
    const int64_t k = 576;
    const std::vector<float> x = RandomFloats(static_cast<size_t>(48 * k), 11);
    std::vector<float> all(static_cast<size_t>(48 * 100));
    GemmAvx512(x.data(), 48, w.matrix(), all.data());
    // Row 37 alone, and rows 20..36 as a batch of 17 (a different tile position and tail).
    std::vector<float> one(100);
    GemmAvx512(x.data() + 37 * k, 1, w.matrix(), one.data());
    EXPECT_EQ(std::memcmp(one.data(), &all[37 * 100], 100 * sizeof(float)), 0);
    std::vector<float> some(static_cast<size_t>(17 * 100));
    GemmAvx512(x.data() + 20 * k, 17, w.matrix(), some.data());
    EXPECT_EQ(std::memcmp(some.data(), &all[20 * 100], some.size() * sizeof(float)), 0);
}

TEST(GemmAvx512, MatMulStoredTakesItByTheRule) {
    EXPECT_FALSE(UsesGemm(KernelIsa::kAvx512, DType::kQ4_1, kMinGemmRows - 1));
    EXPECT_TRUE(UsesGemm(KernelIsa::kAvx512, DType::kQ4_1, kMinGemmRows));
    EXPECT_TRUE(UsesGemm(KernelIsa::kAvx512, DType::kQ8_0, kMaxGemmRows));
    EXPECT_FALSE(UsesGemm(KernelIsa::kAvx512, DType::kQ4_1, kMaxGemmRows + 1));
    EXPECT_FALSE(UsesGemm(KernelIsa::kAvx2, DType::kQ4_1, kMinGemmRows));
    EXPECT_FALSE(UsesGemm(KernelIsa::kAvx512, DType::kF32, kMinGemmRows));   // sgemm reads F32
    EXPECT_FALSE(UsesGemm(KernelIsa::kAvx512, DType::kQ3_K, kMinGemmRows));  // portable only
    ForceGemmMode(GemmMode::kOff);
    EXPECT_FALSE(UsesGemm(KernelIsa::kAvx512, DType::kQ4_1, kMinGemmRows));
    ForceGemmMode(GemmMode::kOn);
    EXPECT_TRUE(UsesGemm(KernelIsa::kAvx512, DType::kQ4_1, 1));
    ResetGemmMode();
    if (!HasAvx512()) return;
    // Through MatMulStored at a batch the rule gives it: the kernel's own sum.
    const RandomMatrix w(DType::kQ4_1, 60, 576, 5);
    const std::vector<float> x = RandomFloats(static_cast<size_t>(32 * 576), 13);
    std::vector<float> y(static_cast<size_t>(32 * 60));
    MatMulStored(x.data(), 32, w.matrix(), y.data());
    const std::vector<float> ref = SequentialFma(x, 32, w.matrix());
    EXPECT_EQ(std::memcmp(y.data(), ref.data(), y.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace kvshard::cpu::gemm
