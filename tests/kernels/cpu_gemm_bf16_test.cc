// The bf16 prefill kernel (kernels/cpu_gemm_bf16.h): its product against the sum it promises (the
// bf16-rounded operands' products summed in double, within fp32 accumulation's bound) and against
// the fp32 product (within bf16 rounding's bound); a row's result independent of the batch, the
// tile and the team (with AMX tiles and with AVX512-BF16 registers); the rule by which MatMulStored
// picks it, the fp32 fallback when the ISA is pinned below AVX-512 (a CPU without AVX512-BF16 takes
// the same branch), and the setting's parse.
#include "kernels/cpu_gemm_bf16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_matmul_internal.h"
#include "kernels/cpu_ops.h"

namespace kvshard::cpu::gemm_bf16 {
namespace {

// A {rows, cols} matrix of `dtype` at an odd byte offset (the kernel must not assume alignment):
// random quants with small finite fp16 scales (and Q4_1's and Q4_K's fp16 mins), or random values
// in [-1, 1] (F16, BF16).
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
            uint16_t h[2] = {FloatToHalf(0.02f * unit(gen)), FloatToHalf(0.4f * unit(gen))};
            if (dtype == DType::kF16) h[0] = FloatToHalf(unit(gen));
            if (dtype == DType::kBF16) h[0] = FloatToBF16(unit(gen));
            const bool two = dtype == DType::kQ4_1 || dtype == DType::kQ4_K;
            std::memcpy(p, h, two ? 4 : 2);
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

float RoundBf16(float f) { return BF16ToFloat(FloatToBF16(f)); }

struct Case {
    DType dtype;
    int64_t m, n, k;
};

// m across the 12-row tile and its tails (49 = 4 × 12 + 1, 60 whole, 130); n across the 32-row
// strip (one half of it valid, both, a tail); k = the default model's 576 and 1536, the smallest
// block, and an odd k (F16) that the kernel pads.
constexpr Case kCases[] = {
    {DType::kQ4_1, 49, 1, 32},     {DType::kQ4_1, 60, 31, 576}, {DType::kQ4_1, 61, 32, 576},
    {DType::kQ4_1, 130, 33, 576},  {DType::kQ8_0, 64, 70, 576}, {DType::kQ8_0, 49, 17, 1536},
    {DType::kQ4_0, 100, 96, 1536}, {DType::kF16, 50, 19, 45},   {DType::kBF16, 72, 40, 96},
    {DType::kQ4_K, 53, 35, 256},   {DType::kQ4_1, 512, 64, 64},
};

// The units this CPU can run (AMX, when it has it, and AVX512-BF16), each pinned in turn.
std::vector<Bf16Unit> Units() {
    std::vector<Bf16Unit> units = {Bf16Unit::kAvx512Bf16};
    if (CpuHasAmxBf16()) units.push_back(Bf16Unit::kAmx);
    return units;
}

TEST(GemmBf16, WithinFp32AccumulationOfTheBf16Products) {
    if (!CpuHasAvx512Bf16()) GTEST_SKIP() << "no AVX512-BF16";
    for (const Bf16Unit unit : Units())
        for (const Case& c : kCases) {
            ForceBf16Unit(unit);
            SCOPED_TRACE(std::string(Bf16UnitName(unit)) + " " + std::string(DTypeName(c.dtype)) +
                         " m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) +
                         " k=" + std::to_string(c.k));
            const RandomMatrix w(c.dtype, c.n, c.k, 7);
            const std::vector<float> x = RandomFloats(static_cast<size_t>(c.m * c.k), 11);
            std::vector<float> rows(static_cast<size_t>(c.n * c.k));
            matmul_internal::DequantizeRowsAvx512(w.matrix(), 0, c.n, rows.data());
            std::vector<float> y(static_cast<size_t>(c.m * c.n), NAN);
            GemmBf16(x.data(), c.m, w.matrix(), y.data());
            ResetBf16Unit();
            EXPECT_EQ(ActiveBf16Unit(), CpuHasAmxBf16() ? Bf16Unit::kAmx : Bf16Unit::kAvx512Bf16);
            double worst_bf16 = 0;  // error over its bound, for the message
            double worst_fp32 = 0;
            for (int64_t i = 0; i < c.m; ++i) {
                for (int64_t j = 0; j < c.n; ++j) {
                    double ref = 0, abs_sum = 0, exact = 0, exact_abs = 0;
                    for (int64_t p = 0; p < c.k; ++p) {
                        const double xv = x[i * c.k + p];
                        const double wv = rows[j * c.k + p];
                        const double prod = double(RoundBf16(float(xv))) * RoundBf16(float(wv));
                        ref += prod;
                        abs_sum += std::fabs(prod);
                        exact += xv * wv;
                        exact_abs += std::fabs(xv * wv);
                    }
                    const double got = y[i * c.n + j];
                    // Recursive fp32 summation of k exact products: at most k · 2^-24 of their
                    // |sum|.
                    const double bound = double(c.k) * std::ldexp(1.0, -24) * abs_sum + 1e-30;
                    worst_bf16 = std::max(worst_bf16, std::fabs(got - ref) / bound);
                    // Both operands rounded to 8 significant bits: each product within ~2^-8 of its
                    // own.
                    const double bound32 = std::ldexp(1.0, -7) * exact_abs + 1e-30;
                    worst_fp32 = std::max(worst_fp32, std::fabs(got - exact) / bound32);
                }
            }
            EXPECT_LE(worst_bf16, 1.0);
            EXPECT_LE(worst_fp32, 1.0);
        }
}

TEST(GemmBf16, ARowsProductDoesNotDependOnTheBatchTileOrTeam) {
    if (!CpuHasAvx512Bf16()) GTEST_SKIP() << "no AVX512-BF16";
    const int64_t n = 100, k = 576, m = 130, offset = 5, sub = 60;
    const RandomMatrix w(DType::kQ4_1, n, k, 3);
    const std::vector<float> x = RandomFloats(static_cast<size_t>(m * k), 4);
    for (const Bf16Unit unit : Units()) {
        SCOPED_TRACE(Bf16UnitName(unit));
        ForceBf16Unit(unit);
        std::vector<float> all(static_cast<size_t>(m * n));
        SetNumThreads(2);
        GemmBf16(x.data(), m, w.matrix(), all.data());
        // Rows offset .. offset + sub - 1 as a product of their own: row offset is now row 0 of a
        // tile instead of row 5, and the tiles end elsewhere.
        std::vector<float> part(static_cast<size_t>(sub * n));
        SetNumThreads(1);
        GemmBf16(x.data() + offset * k, sub, w.matrix(), part.data());
        SetNumThreads(2);
        EXPECT_EQ(std::memcmp(part.data(), all.data() + offset * n, part.size() * sizeof(float)),
                  0);
    }
    ResetBf16Unit();
}

TEST(GemmBf16, MatMulStoredTakesItByTheRuleAndFallsBackToFp32) {
    ForcePrefillMode(PrefillMode::kBf16);
    const bool bf16 = CpuHasAvx512Bf16();
    EXPECT_EQ(UsesGemmBf16(KernelIsa::kAvx512, DType::kQ4_1, kMinBf16Rows), bf16);
    EXPECT_EQ(UsesGemmBf16(KernelIsa::kAvx512, DType::kQ8_0, 512), bf16);
    EXPECT_FALSE(UsesGemmBf16(KernelIsa::kAvx512, DType::kQ4_1, kMinBf16Rows - 1));
    EXPECT_FALSE(UsesGemmBf16(KernelIsa::kAvx512, DType::kF32, 512));   // F32 stays on sgemm
    EXPECT_FALSE(UsesGemmBf16(KernelIsa::kAvx512, DType::kQ3_K, 512));  // portable only
    EXPECT_FALSE(UsesGemmBf16(KernelIsa::kAvx2, DType::kQ4_1, 512));
    EXPECT_FALSE(UsesGemmBf16(KernelIsa::kPortable, DType::kQ4_1, 512));
    ForcePrefillMode(PrefillMode::kFp32);
    EXPECT_FALSE(UsesGemmBf16(KernelIsa::kAvx512, DType::kQ4_1, 512));

    const int64_t m = 96, n = 70, k = 576;
    const RandomMatrix w(DType::kQ4_1, n, k, 5);
    const std::vector<float> x = RandomFloats(static_cast<size_t>(m * k), 13);
    const auto run = [&](PrefillMode mode, KernelIsa isa) {
        ForcePrefillMode(mode);
        ForceKernelIsa(isa);
        std::vector<float> y(static_cast<size_t>(m * n));
        MatMulStored(x.data(), m, w.matrix(), y.data());
        ResetKernelIsa();
        return y;
    };
    // The fallback: with the ISA pinned to AVX2, bf16 asks for what fp32 gives, bit for bit.
    const std::vector<float> fp32_avx2 = run(PrefillMode::kFp32, KernelIsa::kAvx2);
    const std::vector<float> bf16_avx2 = run(PrefillMode::kBf16, KernelIsa::kAvx2);
    EXPECT_EQ(std::memcmp(fp32_avx2.data(), bf16_avx2.data(), fp32_avx2.size() * sizeof(float)), 0);
    if (bf16) {
        // Through MatMulStored at AVX-512: the kernel's own result, and not fp32's.
        const std::vector<float> got = run(PrefillMode::kBf16, KernelIsa::kAvx512);
        std::vector<float> direct(static_cast<size_t>(m * n));
        GemmBf16(x.data(), m, w.matrix(), direct.data());
        EXPECT_EQ(std::memcmp(got.data(), direct.data(), got.size() * sizeof(float)), 0);
        const std::vector<float> fp32 = run(PrefillMode::kFp32, KernelIsa::kAvx512);
        EXPECT_NE(std::memcmp(got.data(), fp32.data(), got.size() * sizeof(float)), 0);
    }
    ResetPrefillMode();
}

TEST(GemmBf16, SettingParse) {
    std::string warning;
    EXPECT_EQ(PrefillModeFromSetting(nullptr, &warning), kDefaultPrefillMode);
    EXPECT_TRUE(warning.empty());
    EXPECT_EQ(PrefillModeFromSetting("fp32", &warning), PrefillMode::kFp32);
    EXPECT_TRUE(warning.empty());
    EXPECT_EQ(PrefillModeFromSetting("bf16", &warning), PrefillMode::kBf16);
    EXPECT_TRUE(warning.empty());
    EXPECT_EQ(PrefillModeFromSetting("BF16x", &warning), kDefaultPrefillMode);
    EXPECT_EQ(warning, "KVSHARD_MATMUL_PREFILL=BF16x is not fp32 or bf16; using " +
                           std::string(PrefillModeName(kDefaultPrefillMode)));
}

}  // namespace
}  // namespace kvshard::cpu::gemm_bf16
