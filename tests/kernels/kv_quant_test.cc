// The 16-bit KV encodings of the CPU pools (kernels/kv_quant.h) on every ISA the kernels can take:
// the values of common/dtype.h's scalar conversions, element for element, whatever the length
// (full vectors and masked tails).
#include "kernels/kv_quant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_matmul.h"

namespace kvshard::cpu {
namespace {

class KvQuantIsaTest : public ::testing::TestWithParam<KernelIsa> {
  protected:
    void SetUp() override { ForceKernelIsa(GetParam()); }
    void TearDown() override { ResetKernelIsa(); }
};

// Floats of every class: random bit patterns (NaNs, infinities, subnormals, every binade) and the
// edges of both formats.
std::vector<float> AllKindsOfFloats() {
    std::vector<float> xs = {0.0f,
                             -0.0f,
                             1.0f,
                             -1.0f,
                             65504.0f,
                             65519.0f,
                             65520.0f,
                             std::ldexp(1.0f, -24),
                             std::ldexp(1.0f, -25),
                             std::ldexp(3.0f, -26),
                             1.0f + 0x1p-8f,
                             1.0f + 3 * 0x1p-8f,
                             std::numeric_limits<float>::max(),
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN()};
    std::mt19937 rng(3);
    for (int i = 0; i < 100003; ++i)
        xs.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
    return xs;
}

TEST_P(KvQuantIsaTest, SixteenBitEncodingsAreTheScalarConversions) {
    const std::vector<float> xs = AllKindsOfFloats();
    const int64_t n = static_cast<int64_t>(xs.size());
    std::vector<uint16_t> bf16(xs.size()), fp16(xs.size());
    EncodeBf16(xs.data(), n, bf16.data());
    EncodeFp16(xs.data(), n, fp16.data());
    // vcvtneps2bf16 (AVX512_BF16) takes fp32 subnormals as zero; nothing else differs.
    const bool flushes = GetParam() == KernelIsa::kAvx512 &&
                         ActiveKernelIsa() == KernelIsa::kAvx512 &&
                         __builtin_cpu_supports("avx512bf16");
    int64_t subnormals = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
        const float x = xs[i];
        if (std::isnan(x)) {
            EXPECT_TRUE(std::isnan(BF16ToFloat(bf16[i]))) << i;
            EXPECT_TRUE(std::isnan(HalfToFloat(fp16[i]))) << i;
            continue;
        }
        EXPECT_EQ(fp16[i], FloatToHalf(x)) << x;
        if (flushes && std::fpclassify(x) == FP_SUBNORMAL) {
            ++subnormals;
            EXPECT_EQ(bf16[i], std::signbit(x) ? 0x8000 : 0x0000) << x;
            continue;
        }
        EXPECT_EQ(bf16[i], FloatToBF16(x)) << x;
    }
    if (flushes) {
        EXPECT_GT(subnormals, 0);
    }

    // Decoding every code, at a length with a masked tail.
    std::vector<uint16_t> codes(65536 + 7);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint16_t>(i);
    std::vector<float> from_bf16(codes.size()), from_fp16(codes.size());
    DecodeBf16(codes.data(), static_cast<int64_t>(codes.size()), from_bf16.data());
    DecodeFp16(codes.data(), static_cast<int64_t>(codes.size()), from_fp16.data());
    for (size_t i = 0; i < codes.size(); ++i) {
        EXPECT_EQ(std::bit_cast<uint32_t>(from_bf16[i]),
                  std::bit_cast<uint32_t>(BF16ToFloat(codes[i])))
            << i;
        const float want = HalfToFloat(codes[i]);
        if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(from_fp16[i])) << i;
        } else {
            EXPECT_EQ(std::bit_cast<uint32_t>(from_fp16[i]), std::bit_cast<uint32_t>(want)) << i;
        }
    }
}

// Lengths around the 16-element vectors: nothing is written past n.
TEST_P(KvQuantIsaTest, ShortRowsStopAtTheirLength) {
    for (int64_t n : {0, 1, 7, 15, 16, 17, 31, 33}) {
        std::vector<float> x(static_cast<size_t>(n) + 4, 1.5f), back(x.size(), -7.0f);
        std::vector<uint16_t> q(x.size(), 0xABCD);
        EncodeBf16(x.data(), n, q.data());
        for (size_t i = 0; i < q.size(); ++i) EXPECT_EQ(q[i], i < size_t(n) ? 0x3FC0 : 0xABCD);
        DecodeBf16(q.data(), n, back.data());
        for (size_t i = 0; i < back.size(); ++i) EXPECT_EQ(back[i], i < size_t(n) ? 1.5f : -7.0f);
        std::fill(q.begin(), q.end(), 0xABCD);
        EncodeFp16(x.data(), n, q.data());
        for (size_t i = 0; i < q.size(); ++i) EXPECT_EQ(q[i], i < size_t(n) ? 0x3E00 : 0xABCD);
        std::fill(back.begin(), back.end(), -7.0f);
        DecodeFp16(q.data(), n, back.data());
        for (size_t i = 0; i < back.size(); ++i) EXPECT_EQ(back[i], i < size_t(n) ? 1.5f : -7.0f);
    }
}

INSTANTIATE_TEST_SUITE_P(Isas, KvQuantIsaTest,
                         ::testing::Values(KernelIsa::kPortable, KernelIsa::kAvx2,
                                           KernelIsa::kAvx512),
                         [](const auto& info) { return std::string(KernelIsaName(info.param)); });

}  // namespace
}  // namespace kvshard::cpu
