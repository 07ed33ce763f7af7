#include "kernels/cpu_matmul.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_matmul_internal.h"
#include "kernels/cpu_ops.h"
#include "tests/kernels/quant_scale_offsets.h"

namespace kvshard::cpu {
namespace {

constexpr KernelIsa kAllIsas[] = {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512};

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (float& f : v) f = dist(gen);
    return v;
}

void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }

using test::HalfScaleOffsets;

// A {rows, cols} matrix of `dtype` with random contents, placed at byte `misalign` of its buffer
// (the kernels must not assume alignment). Quantized blocks get random bytes for the quants and
// small finite fp16 scales, like a real model's.
class RandomStoredMatrix {
  public:
    RandomStoredMatrix(DType dtype, int64_t rows, int64_t cols, uint32_t seed, size_t misalign = 1)
        : bytes_(RowBytes(dtype, cols) * static_cast<size_t>(rows) + misalign) {
        std::mt19937 gen(seed);
        std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
        std::uniform_real_distribution<float> scale(0.002f, 0.05f);
        std::uniform_int_distribution<int> byte(0, 255);
        uint8_t* p = bytes_.data() + misalign;
        const int64_t count = rows * cols / BlockElements(dtype);
        for (int64_t b = 0; b < count; ++b) {
            switch (dtype) {
                case DType::kF32: {
                    const float f = unit(gen);
                    std::memcpy(p, &f, sizeof(f));
                    break;
                }
                case DType::kF16:
                    StoreU16(p, FloatToHalf(unit(gen)));
                    break;
                case DType::kBF16:
                    StoreU16(p, FloatToBF16(unit(gen)));
                    break;
                case DType::kQ8_0:
                case DType::kQ4_0:
                case DType::kQ4_1: {
                    const float sign = unit(gen) < 0 ? -1.0f : 1.0f;
                    StoreU16(p, FloatToHalf(sign * scale(gen)));
                    size_t at = 2;
                    if (dtype == DType::kQ4_1) {
                        StoreU16(p + 2, FloatToHalf(0.4f * unit(gen)));
                        at = 4;
                    }
                    for (; at < BlockBytes(dtype); ++at) p[at] = static_cast<uint8_t>(byte(gen));
                    break;
                }
                default: {
                    // Q5_0/Q5_1 and the K-quants: random quants (and 6-bit sub-block scales),
                    // small finite fp16 super-block scales at their offsets.
                    for (size_t at = 0; at < BlockBytes(dtype); ++at) {
                        p[at] = static_cast<uint8_t>(byte(gen));
                    }
                    for (size_t off : HalfScaleOffsets(dtype)) {
                        const float sign = unit(gen) < 0 ? -1.0f : 1.0f;
                        StoreU16(p + off, FloatToHalf(sign * scale(gen)));
                    }
                    break;
                }
            }
            p += BlockBytes(dtype);
        }
        matrix_ = {dtype, bytes_.data() + misalign, rows, cols};
    }

    const StoredMatrix& matrix() const { return matrix_; }

    // The dequantize-at-load reference: row r as DequantizeRow gives it.
    std::vector<float> Row(int64_t r) const {
        std::vector<float> out(static_cast<size_t>(matrix_.cols));
        DequantizeRow(matrix_.dtype, matrix_.data + r * RowBytes(matrix_.dtype, matrix_.cols),
                      matrix_.cols, out.data());
        return out;
    }

  private:
    std::vector<uint8_t> bytes_;
    StoredMatrix matrix_;
};

// y = x · W^T from dequantized rows, in double.
std::vector<double> Reference(const std::vector<float>& x, int64_t m, const RandomStoredMatrix& w) {
    const int64_t n = w.matrix().rows;
    const int64_t k = w.matrix().cols;
    std::vector<double> y(static_cast<size_t>(m * n));
    for (int64_t j = 0; j < n; ++j) {
        const std::vector<float> row = w.Row(j);
        for (int64_t i = 0; i < m; ++i) {
            double sum = 0.0;
            for (int64_t l = 0; l < k; ++l) sum += double{x[i * k + l]} * row[l];
            y[i * n + j] = sum;
        }
    }
    return y;
}

// max |y - ref| / max |ref|: fp32 accumulation in any order stays far below 1e-5 of the largest
// output, while a wrong block, nibble or scale shows up as O(1).
double NormalizedError(const std::vector<float>& y, const std::vector<double>& ref) {
    double max_diff = 0.0;
    double max_ref = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        max_diff = std::max(max_diff, std::abs(double{y[i]} - ref[i]));
        max_ref = std::max(max_ref, std::abs(ref[i]));
    }
    if (!std::isfinite(max_diff)) return max_diff;
    return max_ref > 0 ? max_diff / max_ref : max_diff;
}

// The exact reference: fp32 activations (MatMulInt8Test below bounds the 8-bit ones).
class KernelIsaScope {
  public:
    explicit KernelIsaScope(KernelIsa isa) {
        ForceKernelIsa(isa);
        ForceActivationFormat(ActivationFormat::kFp32);
    }
    ~KernelIsaScope() {
        ResetKernelIsa();
        ResetActivationFormat();
    }
};

// ---------------------------------------------------------------------------------------------
// MatMulStored against the reference, for every dtype, batch size, shape and ISA.

struct Shape {
    int64_t n, k;
};

// Model shapes (SmolLM2-135M's kv projection, its down projection's k), n not a multiple of the
// kernels' strip of 4 or chunk of 16, the smallest k; k not a multiple of 32 for the float types.
constexpr Shape kQuantShapes[] = {{192, 576}, {70, 1536}, {37, 32}, {13, 64}, {1, 96}};
// The K-quants' rows are whole super-blocks of 256: the default model's k = 576 is not one, so
// SmolLM2's Q4_K_M file stores those matrices as Q5_0 (1536 is).
constexpr Shape kSuperBlockShapes[] = {{70, 1536}, {37, 256}, {5, 512}};
constexpr Shape kFloatOnlyShapes[] = {{7, 45}, {19, 1000}, {5, 1}};

using MatMulParam = std::tuple<DType, int64_t, Shape>;

class MatMulStoredTest : public ::testing::TestWithParam<MatMulParam> {};

TEST_P(MatMulStoredTest, MatchesDequantizedReferenceOnEveryIsa) {
    const auto [dtype, m, shape] = GetParam();
    const RandomStoredMatrix w(dtype, shape.n, shape.k, /*seed=*/static_cast<uint32_t>(m * 7 + 1));
    const std::vector<float> x = RandomFloats(static_cast<size_t>(m * shape.k), 99);
    const std::vector<double> ref = Reference(x, m, w);
    for (KernelIsa isa : kAllIsas) {
        const KernelIsaScope scope(isa);
        if (ActiveKernelIsa() != isa) continue;  // the CPU lacks it
        std::vector<float> y(static_cast<size_t>(m * shape.n), std::nanf(""));
        MatMulStored(x.data(), m, w.matrix(), y.data());
        EXPECT_LE(NormalizedError(y, ref), 1e-5)
            << KernelIsaName(isa) << " " << DTypeName(dtype) << " m=" << m << " n=" << shape.n
            << " k=" << shape.k;
    }
}

std::vector<MatMulParam> AllCases() {
    std::vector<MatMulParam> cases;
    for (DType dtype :
         {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1,
          DType::kQ5_0, DType::kQ5_1, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K}) {
        for (int64_t m : {1, 2, 3, 5, 16, 17, 32, 48, 64, 130}) {
            if (IsKQuant(dtype)) {
                for (const Shape& shape : kSuperBlockShapes) cases.emplace_back(dtype, m, shape);
                continue;
            }
            for (const Shape& shape : kQuantShapes) cases.emplace_back(dtype, m, shape);
            if (BlockElements(dtype) > 1) continue;
            for (const Shape& shape : kFloatOnlyShapes) cases.emplace_back(dtype, m, shape);
        }
    }
    return cases;
}

std::string MatMulParamName(const ::testing::TestParamInfo<MatMulParam>& info) {
    const auto [dtype, m, shape] = info.param;
    return std::string(DTypeName(dtype)) + "_m" + std::to_string(m) + "_n" +
           std::to_string(shape.n) + "_k" + std::to_string(shape.k);
}

INSTANTIATE_TEST_SUITE_P(All, MatMulStoredTest, ::testing::ValuesIn(AllCases()), MatMulParamName);

// F32 weights go to sgemm directly when aligned and through the panel copy when not: both agree.
TEST(MatMulStoredF32Test, AlignedAndUnalignedWeightsAgree) {
    const int64_t m = 3;
    const RandomStoredMatrix aligned(DType::kF32, 33, 64, 5, /*misalign=*/0);
    const RandomStoredMatrix unaligned(DType::kF32, 33, 64, 5, /*misalign=*/2);
    const std::vector<float> x = RandomFloats(m * 64, 6);
    std::vector<float> y0(m * 33);
    std::vector<float> y1(m * 33);
    MatMulStored(x.data(), m, aligned.matrix(), y0.data());
    MatMulStored(x.data(), m, unaligned.matrix(), y1.data());
    EXPECT_LE(NormalizedError(y1, Reference(x, m, aligned)), 1e-5);
    EXPECT_LE(NormalizedError(y0, Reference(x, m, aligned)), 1e-5);
}

// ---------------------------------------------------------------------------------------------
// The interleaved copy of Q4_1 and Q8_0 rows that single-row products read (cpu_matmul.h).

// `w` with its interleaved copy (when the active ISA has one).
class InterleavedCopy {
  public:
    explicit InterleavedCopy(const StoredMatrix& w) : matrix_(w) {
        bytes_.resize(InterleavedBytes(w));
        if (bytes_.empty()) return;
        InterleaveRows(w, bytes_.data());
        matrix_.interleaved = bytes_.data();
    }
    const StoredMatrix& matrix() const { return matrix_; }
    size_t bytes() const { return bytes_.size(); }

  private:
    std::vector<uint8_t> bytes_;
    StoredMatrix matrix_;
};

std::vector<float> Product(const std::vector<float>& x, int64_t m, const StoredMatrix& w) {
    std::vector<float> y(static_cast<size_t>(m * w.rows), std::nanf(""));
    MatMulStored(x.data(), m, w, y.data());
    return y;
}

class TeamSizeScope {
  public:
    explicit TeamSizeScope(int threads) : saved_(NumThreads()) { SetThisThreadNumThreads(threads); }
    ~TeamSizeScope() { SetThisThreadNumThreads(saved_); }

  private:
    int saved_;
};

// Whole groups and a tail (70 = 4 x 16 + 6), the default model's qkv and down, one group.
constexpr Shape kInterleavedShapes[] = {{960, 576}, {70, 1536}, {576, 1536}, {16, 32}, {37, 64}};

constexpr DType kInterleavedDTypes[] = {DType::kQ4_1, DType::kQ8_0};

TEST(InterleavedTest, SingleRowMatchesReferenceAndIsTheSameOnEveryTeamSize) {
    const KernelIsaScope scope(KernelIsa::kAvx512);
    if (ActiveKernelIsa() != KernelIsa::kAvx512) GTEST_SKIP() << "no AVX-512 on this CPU";
    for (DType dtype : kInterleavedDTypes) {
        for (const Shape& shape : kInterleavedShapes) {
            const RandomStoredMatrix w(dtype, shape.n, shape.k, 31);
            const InterleavedCopy copy(w.matrix());
            const std::string what = std::string(DTypeName(dtype)) +
                                     " n=" + std::to_string(shape.n) +
                                     " k=" + std::to_string(shape.k);
            ASSERT_EQ(copy.bytes(),
                      static_cast<size_t>(shape.n / kInterleaveRows * kInterleaveRows) *
                          RowBytes(dtype, shape.k))
                << what;
            const std::vector<float> x = RandomFloats(static_cast<size_t>(shape.k), 32);
            std::vector<float> alone;
            {
                const TeamSizeScope one(1);
                alone = Product(x, 1, copy.matrix());
            }
            EXPECT_LE(NormalizedError(alone, Reference(x, 1, w)), 1e-5) << what;
            const TeamSizeScope two(2);
            // The team's split (and who takes the tail) does not change a single bit.
            EXPECT_EQ(Product(x, 1, copy.matrix()), alone) << what;
            EXPECT_EQ(Product(x, 1, copy.matrix()), alone) << what;
            // Not the stored layout's kernel: the sums run in another order.
            EXPECT_NE(Product(x, 1, w.matrix()), alone) << what;
        }
    }
}

TEST(InterleavedTest, OtherProductsReadTheStoredRows) {
    const std::vector<float> x = RandomFloats(3 * 576, 42);
    for (DType dtype : kInterleavedDTypes) {
        const RandomStoredMatrix w(dtype, 70, 576, 41);
        for (KernelIsa isa : kAllIsas) {
            const KernelIsaScope scope(KernelIsa::kAvx512);
            const InterleavedCopy copy(w.matrix());
            if (copy.bytes() == 0) GTEST_SKIP() << "no AVX-512 on this CPU";
            ForceKernelIsa(isa);
            // Batches, and a single row on an ISA without the interleaved kernel.
            for (int64_t m : {1, 2, 3}) {
                if (m == 1 && ActiveKernelIsa() == KernelIsa::kAvx512) continue;
                EXPECT_EQ(Product(x, m, copy.matrix()), Product(x, m, w.matrix()))
                    << KernelIsaName(isa) << " " << DTypeName(dtype) << " m=" << m;
            }
            // 8-bit activations.
            ForceActivationFormat(ActivationFormat::kInt8);
            EXPECT_EQ(Product(x, 1, copy.matrix()), Product(x, 1, w.matrix()))
                << KernelIsaName(isa) << " " << DTypeName(dtype);
        }
    }
}

// x rounded as the int16 activations are (cpu_matmul.h, ActivationFormat::kInt16): per block of
// 32, s = max|x| / 32767 and x' = s · round(x / s).
std::vector<float> RoundedToInt16(const std::vector<float>& x) {
    std::vector<float> out(x.size());
    for (size_t b = 0; b < x.size(); b += 32) {
        float amax = 0.0f;
        for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float s = amax / 32767.0f;
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (size_t i = b; i < b + 32; ++i) out[i] = s * std::nearbyint(x[i] * inv);
    }
    return out;
}

// Single Q4_1 rows against the copy with int16 activations (AVX512_VNNI): the product of the
// rounded row (the tail rows past the last group too), within 1e-4 of the exact one, the same on
// every team size. (Batches and the stored rows: cpu_matmul_int16_test.cc.)
TEST(InterleavedTest, Int16SingleRowIsTheRoundedRowsProduct) {
    const KernelIsaScope scope(KernelIsa::kAvx512);
    ForceActivationFormat(ActivationFormat::kInt16);
    if (ActiveKernelIsa() != KernelIsa::kAvx512) GTEST_SKIP() << "no AVX-512 on this CPU";
    for (DType dtype : {DType::kQ4_1}) {
        for (const Shape& shape : kInterleavedShapes) {
            const RandomStoredMatrix w(dtype, shape.n, shape.k, 61);
            const InterleavedCopy copy(w.matrix());
            const std::string what = std::string(DTypeName(dtype)) +
                                     " n=" + std::to_string(shape.n) +
                                     " k=" + std::to_string(shape.k);
            if (!RoundsToInt16(dtype)) GTEST_SKIP() << "no AVX512_VNNI on this CPU";
            // Activations of mixed magnitudes, as a model's are: block maxima 1e-3 .. 30.
            std::vector<float> x = RandomFloats(static_cast<size_t>(shape.k), 62);
            for (size_t i = 0; i < x.size(); ++i) x[i] *= std::pow(10.0f, float(i / 32 % 5) - 3);
            x[7] = 30.0f;
            std::vector<float> alone;
            {
                const TeamSizeScope one(1);
                alone = Product(x, 1, copy.matrix());
            }
            const std::vector<double> rounded = Reference(RoundedToInt16(x), 1, w);
            const std::vector<double> exact = Reference(x, 1, w);
            EXPECT_LE(NormalizedError(alone, rounded), 1e-5) << what;
            const double error = NormalizedError(alone, exact);
            EXPECT_LE(error, 1e-4) << what;
            EXPECT_GT(error, 0.0) << what;
            const TeamSizeScope two(2);
            EXPECT_EQ(Product(x, 1, copy.matrix()), alone) << what;
        }
    }
}

// Q8_0 single rows keep the fp32 kernel under kInt16 (cpu_matmul.h).
TEST(InterleavedTest, Int16LeavesQ80RowsInFp32) {
    const KernelIsaScope scope(KernelIsa::kAvx512);
    const RandomStoredMatrix w(DType::kQ8_0, 70, 576, 65);
    const InterleavedCopy copy(w.matrix());
    if (copy.bytes() == 0) GTEST_SKIP() << "no AVX-512 on this CPU";
    const std::vector<float> x = RandomFloats(576, 66);
    const std::vector<float> fp32 = Product(x, 1, copy.matrix());
    ForceActivationFormat(ActivationFormat::kInt16);
    EXPECT_FALSE(RoundsToInt16(DType::kQ8_0));
    EXPECT_EQ(Product(x, 1, copy.matrix()), fp32);
}

// Block maxima at the ends of the int16 range: zeros, one huge element, denormal-sized values.
TEST(InterleavedTest, Int16HandlesZeroAndExtremeBlocks) {
    const KernelIsaScope scope(KernelIsa::kAvx512);
    ForceActivationFormat(ActivationFormat::kInt16);
    for (DType dtype : {DType::kQ4_1}) {
        const RandomStoredMatrix w(dtype, 32, 128, 71);
        const InterleavedCopy copy(w.matrix());
        if (!RoundsToInt16(dtype)) GTEST_SKIP() << "no AVX512_VNNI on this CPU";
        std::vector<float> x(128, 0.0f);  // block 0 zeros
        for (size_t i = 32; i < 64; ++i) x[i] = (i % 2 ? -1.0f : 1.0f) * 1e-30f * float(i);
        x[70] = -3e4f;  // block 2: one large element, the others tiny
        for (size_t i = 71; i < 96; ++i) x[i] = 1e-3f;
        for (size_t i = 96; i < 128; ++i) x[i] = -2.5f;  // block 3: all at the maximum
        const std::vector<float> y = Product(x, 1, copy.matrix());
        EXPECT_LE(NormalizedError(y, Reference(RoundedToInt16(x), 1, w)), 1e-5)
            << DTypeName(dtype);
        EXPECT_LE(NormalizedError(y, Reference(x, 1, w)), 1e-4) << DTypeName(dtype);
    }
}

TEST(InterleavedTest, OnlyQ41AndQ80OnAvx512HaveACopy) {
    for (DType dtype : {DType::kQ4_0, DType::kQ5_0, DType::kF16}) {
        const RandomStoredMatrix w(dtype, 64, 64, 51);
        EXPECT_EQ(InterleavedBytes(w.matrix()), 0u) << DTypeName(dtype);
    }
    const RandomStoredMatrix small(DType::kQ4_1, 15, 64, 52);
    EXPECT_EQ(InterleavedBytes(small.matrix()), 0u);  // no whole group
    const RandomStoredMatrix w(DType::kQ4_1, 64, 64, 53);
    const KernelIsaScope scope(KernelIsa::kAvx2);
    EXPECT_EQ(InterleavedBytes(w.matrix()), 0u);
}

TEST(MatMulStoredTest, EmptyMatrices) {
    const std::vector<float> x(4, 1.0f);
    std::vector<float> y(2, 7.0f);
    MatMulStored(x.data(), 2, StoredMatrix{DType::kQ4_1, nullptr, 0, 64}, y.data());
    EXPECT_EQ(y[0], 7.0f);  // n = 0: nothing written
    MatMulStored(x.data(), 2, StoredMatrix{DType::kQ8_0, nullptr, 1, 0}, y.data());
    EXPECT_EQ(y[0], 0.0f);  // k = 0: empty sums
    EXPECT_EQ(y[1], 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Int8 activations (ActivationFormat::kInt8).

class ActivationScope {
  public:
    ActivationScope(KernelIsa isa, ActivationFormat format) {
        ForceKernelIsa(isa);
        ForceActivationFormat(format);
    }
    ~ActivationScope() {
        ResetKernelIsa();
        ResetActivationFormat();
    }
};

// The activations as kInt8 rounds them: each block of 32 to 8 bits and back
// (matmul_internal::QuantizeBlock32).
std::vector<float> Int8RoundTrip(const std::vector<float>& x) {
    std::vector<float> out(x.size());
    for (size_t b = 0; b + 32 <= x.size(); b += 32) {
        int8_t q[32];
        int32_t sum_q;
        const float d = matmul_internal::QuantizeBlock32(&x[b], q, &sum_q);
        for (int i = 0; i < 32; ++i) out[b + i] = d * q[i];
    }
    return out;
}

std::string CaseName(KernelIsa isa, DType dtype, int64_t m, const Shape& shape) {
    return std::string(KernelIsaName(isa)) + " " + std::string(DTypeName(dtype)) +
           " m=" + std::to_string(m) + " n=" + std::to_string(shape.n) +
           " k=" + std::to_string(shape.k);
}

using Int8Param = std::tuple<DType, int64_t, Shape>;
class MatMulInt8Test : public ::testing::TestWithParam<Int8Param> {};

// On every ISA and at every m (the int8 dot-product kernels at m <= 16 on AVX2/AVX-512, the fp32
// kernels on rounded activations otherwise) the product is that of the dequantized weights and
// the 8-bit round trip of the activations up to fp32 rounding (a wrong lane, nibble, offset or
// scale would be O(1)); against the fp32-activation product it is within the 8-bit error,
// bounded here at 3% of the largest output (measured: at most 1.24%, Q4_1 with k = 96 and one
// output column; the offset term m·sum(x) takes the rounding too).
TEST_P(MatMulInt8Test, IsTheProductOfTheRoundedActivations) {
    const auto [dtype, m, shape] = GetParam();
    const RandomStoredMatrix w(dtype, shape.n, shape.k, static_cast<uint32_t>(m * 5 + 3));
    const std::vector<float> x = RandomFloats(static_cast<size_t>(m * shape.k), 7);
    const std::vector<double> exact = Reference(x, m, w);
    const std::vector<double> rounded = Reference(Int8RoundTrip(x), m, w);
    for (KernelIsa isa : kAllIsas) {
        const ActivationScope scope(isa, ActivationFormat::kInt8);
        if (ActiveKernelIsa() != isa) continue;  // the CPU lacks it
        ASSERT_TRUE(QuantizesActivations(dtype));
        EXPECT_EQ(UsesInt8Kernels(dtype, m), isa != KernelIsa::kPortable && m <= 16);
        std::vector<float> y(static_cast<size_t>(m * shape.n), std::nanf(""));
        MatMulStored(x.data(), m, w.matrix(), y.data());
        EXPECT_LE(NormalizedError(y, rounded), 1e-5) << CaseName(isa, dtype, m, shape);
        EXPECT_LE(NormalizedError(y, exact), 3e-2) << CaseName(isa, dtype, m, shape);
    }
}

std::vector<Int8Param> Int8Cases() {
    std::vector<Int8Param> cases;
    for (DType dtype : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
        for (int64_t m : {1, 2, 3, 4, 5, 16, 17, 64}) {
            for (const Shape& shape : kQuantShapes) cases.emplace_back(dtype, m, shape);
        }
    }
    return cases;
}

INSTANTIATE_TEST_SUITE_P(All, MatMulInt8Test, ::testing::ValuesIn(Int8Cases()), MatMulParamName);

// The rule: 8-bit activations for Q8_0/Q4_0/Q4_1 while the format is kInt8, the dot-product
// kernels at m <= kMaxInt8KernelRows on AVX2/AVX-512; kFp32 and the other types are exact.
TEST(MatMulInt8Test, TheRuleAndTheExactFormat) {
    // Unforced and without KVSHARD_MATMUL_ACTIVATIONS, products are exact.
    if (std::getenv("KVSHARD_MATMUL_ACTIVATIONS") == nullptr) {
        EXPECT_EQ(ActiveActivationFormat(), ActivationFormat::kFp32);
        EXPECT_FALSE(QuantizesActivations(DType::kQ4_1));
    }
    const KernelIsa best = DetectedKernelIsa();
    {
        const ActivationScope scope(best, ActivationFormat::kInt8);
        EXPECT_TRUE(QuantizesActivations(DType::kQ4_1));
        EXPECT_EQ(UsesInt8Kernels(DType::kQ4_1, 1), best != KernelIsa::kPortable);
        EXPECT_EQ(UsesInt8Kernels(DType::kQ8_0, kMaxInt8KernelRows), best != KernelIsa::kPortable);
        EXPECT_FALSE(UsesInt8Kernels(DType::kQ4_1, kMaxInt8KernelRows + 1));
        for (DType other : {DType::kF32, DType::kF16, DType::kQ5_0, DType::kQ4_K, DType::kQ6_K}) {
            EXPECT_FALSE(QuantizesActivations(other)) << DTypeName(other);
            EXPECT_FALSE(UsesInt8Kernels(other, 1)) << DTypeName(other);
        }
    }
    {
        const ActivationScope scope(best, ActivationFormat::kFp32);
        EXPECT_EQ(ActiveActivationFormat(), ActivationFormat::kFp32);
        EXPECT_FALSE(QuantizesActivations(DType::kQ4_1));
        EXPECT_FALSE(UsesInt8Kernels(DType::kQ4_1, 1));
    }
    const RandomStoredMatrix w(DType::kQ4_1, 70, 1536, 11);
    for (int64_t m : {2, 40}) {
        const std::vector<float> x = RandomFloats(static_cast<size_t>(m * 1536), 12);
        const std::vector<double> exact = Reference(x, m, w);
        for (KernelIsa isa : kAllIsas) {
            for (ActivationFormat format : {ActivationFormat::kFp32, ActivationFormat::kInt8}) {
                const ActivationScope scope(isa, format);
                if (ActiveKernelIsa() != isa) continue;
                std::vector<float> y(static_cast<size_t>(m * 70), std::nanf(""));
                MatMulStored(x.data(), m, w.matrix(), y.data());
                const double err = NormalizedError(y, exact);
                const std::string what = std::string(KernelIsaName(isa)) + " " +
                                         std::string(ActivationFormatName(format)) +
                                         " m=" + std::to_string(m);
                if (format == ActivationFormat::kFp32) {
                    EXPECT_LE(err, 1e-5) << what;
                } else {
                    EXPECT_LE(err, 1e-2) << what;
                    EXPECT_GT(err, 1e-6) << what << ": activations not rounded";
                }
            }
        }
    }
}

// A row's product does not depend on the batch it is in: alone (m = 1, the int8 kernels) and
// among 39 others (m = 40, rounded activations through the fp32 kernels) it agrees up to fp32
// rounding.
TEST(MatMulInt8Test, ARowsProductDoesNotDependOnTheBatch) {
    const ActivationScope scope(DetectedKernelIsa(), ActivationFormat::kInt8);
    for (DType dtype : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
        const RandomStoredMatrix w(dtype, 96, 576, 21);
        const int64_t m = 40;
        const std::vector<float> x = RandomFloats(static_cast<size_t>(m * 576), 22);
        std::vector<float> batch(static_cast<size_t>(m * 96));
        MatMulStored(x.data(), m, w.matrix(), batch.data());
        std::vector<float> alone(96);
        MatMulStored(x.data() + 7 * 576, 1, w.matrix(), alone.data());
        const std::vector<double> ref(batch.begin() + 7 * 96, batch.begin() + 8 * 96);
        EXPECT_LE(NormalizedError(alone, ref), 1e-5) << DTypeName(dtype);
    }
}

// ---------------------------------------------------------------------------------------------
// Kernel ISA selection.

TEST(KernelIsaTest, ForcingPicksTheIsaOrTheBestSupportedBelowIt) {
    const KernelIsa detected = DetectedKernelIsa();
    EXPECT_EQ(ActiveKernelIsa(), detected);
    {
        const KernelIsaScope scope(KernelIsa::kPortable);
        EXPECT_EQ(ActiveKernelIsa(), KernelIsa::kPortable);
    }
    {
        const KernelIsaScope scope(KernelIsa::kAvx2);
        EXPECT_EQ(ActiveKernelIsa(),
                  detected == KernelIsa::kPortable ? KernelIsa::kPortable : KernelIsa::kAvx2);
    }
    {
        const KernelIsaScope scope(KernelIsa::kAvx512);
        EXPECT_EQ(ActiveKernelIsa(), detected);
    }
    EXPECT_EQ(ActiveKernelIsa(), detected);
}

TEST(KernelIsaTest, Names) {
    EXPECT_EQ(KernelIsaName(KernelIsa::kPortable), "portable");
    EXPECT_EQ(KernelIsaName(KernelIsa::kAvx2), "avx2");
    EXPECT_EQ(KernelIsaName(KernelIsa::kAvx512), "avx512");
}

// ---------------------------------------------------------------------------------------------
// EmbeddingRows

class EmbeddingRowsTest : public ::testing::TestWithParam<DType> {};

TEST_P(EmbeddingRowsTest, GathersTheSliceAndZeroesIdsOutsideIt) {
    // This rank holds vocabulary rows [5, 15) of a larger table.
    const int64_t row_offset = 5;
    const int64_t cols = 96;
    const RandomStoredMatrix table(GetParam(), 10, cols, 17);
    const std::vector<int32_t> ids = {5, 14, 4, 15, 9, -1, 0, 1000, 5};
    for (KernelIsa isa : kAllIsas) {
        const KernelIsaScope scope(isa);
        if (ActiveKernelIsa() != isa) continue;
        std::vector<float> out(ids.size() * cols, std::nanf(""));
        EmbeddingRows(table.matrix(), row_offset, ids.data(), static_cast<int64_t>(ids.size()),
                      out.data());
        for (size_t i = 0; i < ids.size(); ++i) {
            const int64_t r = ids[i] - row_offset;
            const bool inside = r >= 0 && r < 10;
            const std::vector<float> want =
                inside ? table.Row(r) : std::vector<float>(static_cast<size_t>(cols), 0.0f);
            for (int64_t c = 0; c < cols; ++c) {
                // A fused d*q+m may differ from the reference's rounding by an ulp.
                ASSERT_NEAR(out[i * cols + c], want[c], 1e-6f * std::abs(want[c]))
                    << KernelIsaName(isa) << " id " << ids[i] << " col " << c;
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, EmbeddingRowsTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0,
                                           DType::kQ4_0, DType::kQ4_1, DType::kQ5_0, DType::kQ5_1),
                         [](const ::testing::TestParamInfo<DType>& info) {
                             return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace kvshard::cpu
