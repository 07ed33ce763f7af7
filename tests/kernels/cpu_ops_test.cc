#include "kernels/cpu_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace kvshard::cpu {
namespace {

std::vector<float> RandomVector(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(gen);
    return v;
}

// ---------------------------------------------------------------------------------------------
// MatMulWT

struct MatMulCase {
    int64_t m, n, k;
    bool accumulate;
};

class MatMulWTTest : public ::testing::TestWithParam<MatMulCase> {};

TEST_P(MatMulWTTest, MatchesNaiveTripleLoop) {
    const MatMulCase c = GetParam();
    const auto x = RandomVector(c.m * c.k, 1);
    const auto w = RandomVector(c.n * c.k, 2);
    const auto y0 = RandomVector(c.m * c.n, 3);
    std::vector<float> y = y0;
    MatMulWT(x.data(), w.data(), y.data(), c.m, c.n, c.k, c.accumulate);
    for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
            double want = c.accumulate ? y0[i * c.n + j] : 0.0;
            double magnitude = std::abs(want);
            for (int64_t l = 0; l < c.k; ++l) {
                want += double{x[i * c.k + l]} * w[j * c.k + l];
                magnitude += std::abs(double{x[i * c.k + l]} * w[j * c.k + l]);
            }
            // fp32 rounding of a k-term sum: bounded by a small multiple of eps · Σ|terms|.
            ASSERT_NEAR(y[i * c.n + j], want, 1e-5 * magnitude + 1e-6)
                << "m=" << c.m << " n=" << c.n << " k=" << c.k << " at (" << i << ", " << j << ")";
        }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MatMulWTTest,
    ::testing::Values(MatMulCase{1, 1, 1, false}, MatMulCase{1, 33, 17, false},
                      MatMulCase{1, 33, 17, true}, MatMulCase{1, 576, 1536, false},
                      MatMulCase{7, 65, 129, false}, MatMulCase{7, 65, 129, true},
                      MatMulCase{64, 96, 80, false}, MatMulCase{64, 96, 80, true},
                      MatMulCase{64, 576, 288, false}));

TEST(MatMulWTTest, OverwritesNaNsWhenNotAccumulating) {
    const auto x = RandomVector(3 * 8, 4);
    const auto w = RandomVector(5 * 8, 5);
    for (int64_t m : {1, 3}) {
        std::vector<float> y(m * 5, std::numeric_limits<float>::quiet_NaN());
        MatMulWT(x.data(), w.data(), y.data(), m, 5, 8);
        for (float v : y) EXPECT_TRUE(std::isfinite(v)) << "m=" << m;
    }
}

// ---------------------------------------------------------------------------------------------
// RmsNorm

struct RmsNormCase {
    int64_t rows, dim;
    float eps;
};

class RmsNormTest : public ::testing::TestWithParam<RmsNormCase> {};

TEST_P(RmsNormTest, MatchesDoubleReferenceAndWorksInPlace) {
    const RmsNormCase c = GetParam();
    const auto x = RandomVector(c.rows * c.dim, 10, -3.0f, 3.0f);
    const auto weight = RandomVector(c.dim, 11, 0.5f, 1.5f);
    std::vector<float> out(x.size());
    RmsNorm(x.data(), weight.data(), out.data(), c.rows, c.dim, c.eps);
    for (int64_t r = 0; r < c.rows; ++r) {
        double ss = 0.0;
        for (int64_t i = 0; i < c.dim; ++i) ss += double{x[r * c.dim + i]} * x[r * c.dim + i];
        const double scale = 1.0 / std::sqrt(ss / c.dim + c.eps);
        for (int64_t i = 0; i < c.dim; ++i) {
            const double want = x[r * c.dim + i] * scale * weight[i];
            ASSERT_NEAR(out[r * c.dim + i], want, 1e-5 * std::abs(want) + 1e-7);
        }
    }
    std::vector<float> in_place = x;
    RmsNorm(in_place.data(), weight.data(), in_place.data(), c.rows, c.dim, c.eps);
    EXPECT_EQ(in_place, out);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormTest,
                         ::testing::Values(RmsNormCase{1, 1, 1e-5f}, RmsNormCase{1, 33, 1e-6f},
                                           RmsNormCase{5, 288, 1e-5f},
                                           RmsNormCase{64, 576, 1e-5f}));

TEST(RmsNormTest, ZeroRowStaysZero) {
    const std::vector<float> x(16, 0.0f), weight(16, 1.0f);
    std::vector<float> out(16, 1.0f);
    RmsNorm(x.data(), weight.data(), out.data(), 1, 16, 1e-5f);
    for (float v : out) EXPECT_EQ(v, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Rope

TEST(RopeTest, RotatesPairsByPositionTimesFrequency) {
    // One row, one head of dim 4: pairs (1, 0) and (0, 1), frequencies 1 and 0.5, position 1.
    std::vector<float> x = {1.0f, 0.0f, 0.0f, 1.0f};
    const float inv_freq[] = {1.0f, 0.5f};
    const int32_t pos[] = {1};
    Rope(x.data(), pos, 1, 1, 4, inv_freq);
    EXPECT_NEAR(x[0], std::cos(1.0), 1e-6);  // (1, 0) rotated by 1 rad
    EXPECT_NEAR(x[1], std::sin(1.0), 1e-6);
    EXPECT_NEAR(x[2], -std::sin(0.5), 1e-6);  // (0, 1) rotated by 0.5 rad
    EXPECT_NEAR(x[3], std::cos(0.5), 1e-6);
}

TEST(RopeTest, KnownValuesAtPosition3) {
    // (a, b) = (2, -1) at angle 3 · 0.25 = 0.75: (a cos - b sin, a sin + b cos).
    std::vector<float> x = {2.0f, -1.0f};
    const float inv_freq[] = {0.25f};
    const int32_t pos[] = {3};
    Rope(x.data(), pos, 1, 1, 2, inv_freq);
    EXPECT_NEAR(x[0], 2.0 * std::cos(0.75) + std::sin(0.75), 1e-6);
    EXPECT_NEAR(x[1], 2.0 * std::sin(0.75) - std::cos(0.75), 1e-6);
}

TEST(RopeTest, PositionZeroIsIdentity) {
    const int64_t rows = 3, heads = 4, head_dim = 16;
    const auto x = RandomVector(rows * heads * head_dim, 20);
    std::vector<float> inv_freq(head_dim / 2);
    RopeInvFreq(head_dim, 10000.0f, {}, inv_freq.data());
    std::vector<float> y = x;
    const std::vector<int32_t> pos(rows, 0);
    Rope(y.data(), pos.data(), rows, heads, head_dim, inv_freq.data());
    EXPECT_EQ(y, x);
}

TEST(RopeTest, PreservesPairNormsAndMatchesPerRowReference) {
    const int64_t rows = 5, heads = 3, head_dim = 8;
    const auto x = RandomVector(rows * heads * head_dim, 21);
    std::vector<float> inv_freq(head_dim / 2);
    RopeInvFreq(head_dim, 10000.0f, {}, inv_freq.data());
    const std::vector<int32_t> pos = {0, 1, 7, 100, 4095};
    std::vector<float> y = x;
    Rope(y.data(), pos.data(), rows, heads, head_dim, inv_freq.data());
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < heads; ++h) {
            for (int64_t i = 0; i < head_dim / 2; ++i) {
                const int64_t at = (r * heads + h) * head_dim + 2 * i;
                const double a = x[at], b = x[at + 1];
                const double angle = static_cast<float>(pos[r]) * inv_freq[i];
                EXPECT_NEAR(y[at], a * std::cos(angle) - b * std::sin(angle), 1e-5);
                EXPECT_NEAR(y[at + 1], a * std::sin(angle) + b * std::cos(angle), 1e-5);
                EXPECT_NEAR(std::hypot(y[at], y[at + 1]), std::hypot(a, b), 1e-5);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RopeInvFreq

TEST(RopeInvFreqTest, UnscaledIsLlama2cFormula) {
    const int64_t head_dim = 48;
    std::vector<float> inv_freq(head_dim / 2);
    RopeInvFreq(head_dim, 10000.0f, {}, inv_freq.data());
    for (int64_t i = 0; i < head_dim / 2; ++i) {
        // llama2.c: 1.0f / powf(10000.0f, head_dim / (float)head_size) with head_dim = 2i.
        EXPECT_EQ(inv_freq[i], 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / 48.0f));
    }
    EXPECT_EQ(inv_freq[0], 1.0f);
}

TEST(RopeInvFreqTest, LinearDividesByFactor) {
    std::vector<float> plain(32), scaled(32);
    RopeInvFreq(64, 10000.0f, {}, plain.data());
    RopeScalingParams linear;
    linear.type = RopeScalingParams::kLinear;
    linear.factor = 4.0f;
    RopeInvFreq(64, 10000.0f, linear, scaled.data());
    for (int i = 0; i < 32; ++i) EXPECT_FLOAT_EQ(scaled[i], plain[i] / 4.0f);
}

TEST(RopeInvFreqTest, Llama3ScalingMatchesHandComputedValues) {
    // Llama 3.1 8B: head_dim 128, theta 500000, factor 8, low 1, high 4, original context 8192.
    // Wavelengths 2π/f below 8192/4 = 2048 are kept (i <= 28), above 8192/1 are divided by 8
    // (i >= 35), in between smooth = (8192/wavelen - 1) / 3 blends f/8 and f.
    RopeScalingParams llama3;
    llama3.type = RopeScalingParams::kLlama3;
    llama3.factor = 8.0f;
    llama3.low_freq_factor = 1.0f;
    llama3.high_freq_factor = 4.0f;
    llama3.original_max_position = 8192;
    std::vector<float> inv_freq(64);
    RopeInvFreq(128, 500000.0f, llama3, inv_freq.data());
    struct Expected {
        int i;
        double value;
    };
    const Expected expected[] = {
        {0, 1.0},                      // wavelen 6.28: kept
        {28, 0.0032114461064338684},   // f = 500000^(-56/128), wavelen 1956.5: kept
        {29, 0.0021665704517852013},   // wavelen 2401.7, smooth 0.803621
        {30, 0.0013718936642866317},   // f = 0.0021311196, wavelen 2948.3, smooth 0.592849
        {34, 0.00017850780240757209},  // wavelen 6695.1, smooth 0.074527
        {35, 9.556212171446532e-05},   // f = 0.00076449697 / 8, wavelen 8218.7
        {63, 3.068925877869333e-07},   // f = 2.4551407e-06 / 8
    };
    for (const Expected& e : expected) {
        EXPECT_NEAR(inv_freq[e.i], e.value, 1e-6 * e.value) << "i=" << e.i;
    }
}

// ---------------------------------------------------------------------------------------------
// SiluMul, Add, Softmax

TEST(SiluMulTest, ExtremeInputs) {
    // silu saturates to g for large g and to 0 for very negative g (exp(-g) beyond float range).
    const std::vector<float> gate = {-200.0f, -90.0f, -30.0f, 0.0f, 30.0f, 90.0f, 200.0f};
    const std::vector<float> up(gate.size(), 2.0f);
    std::vector<float> out(gate.size());
    SiluMul(gate.data(), up.data(), out.data(), 1, static_cast<int64_t>(gate.size()));
    for (size_t i = 0; i < gate.size(); ++i) {
        const double g = gate[i];
        const double want = g / (1.0 + std::exp(-g)) * 2.0;
        EXPECT_NEAR(out[i], want, 1e-6 * std::abs(want) + 1e-30) << "g=" << g;
    }
}

TEST(SiluMulTest, MatchesFormulaAndWorksInPlace) {
    const int64_t rows = 3, dim = 1000;
    const auto gate = RandomVector(rows * dim, 30, -20.0f, 20.0f);
    const auto up = RandomVector(rows * dim, 31, -2.0f, 2.0f);
    std::vector<float> out(rows * dim);
    SiluMul(gate.data(), up.data(), out.data(), rows, dim);
    for (size_t i = 0; i < out.size(); ++i) {
        const double g = gate[i];
        const double want = g / (1.0 + std::exp(-g)) * up[i];
        EXPECT_NEAR(out[i], want, 1e-6 * std::abs(want) + 1e-7);
    }
    std::vector<float> in_place = gate;
    SiluMul(in_place.data(), up.data(), in_place.data(), rows, dim);
    EXPECT_EQ(in_place, out);
}

TEST(AddTest, AddsElementwise) {
    const auto x = RandomVector(101, 32), y = RandomVector(101, 33);
    std::vector<float> out(101);
    Add(x.data(), y.data(), out.data(), 101);
    for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], x[i] + y[i]);
}

struct SoftmaxCase {
    std::vector<float> logits;
    std::vector<double> expected;
};

class SoftmaxTest : public ::testing::TestWithParam<SoftmaxCase> {};

TEST_P(SoftmaxTest, SumsToOneAndMatches) {
    std::vector<float> x = GetParam().logits;
    Softmax(x.data(), static_cast<int64_t>(x.size()));
    double sum = 0.0;
    for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_TRUE(std::isfinite(x[i]));
        EXPECT_NEAR(x[i], GetParam().expected[i], 1e-6);
        sum += x[i];
    }
    EXPECT_NEAR(sum, 1.0, 1e-6);
}

const double kE = std::exp(1.0);
INSTANTIATE_TEST_SUITE_P(
    Values, SoftmaxTest,
    ::testing::Values(
        SoftmaxCase{{0.0f}, {1.0}}, SoftmaxCase{{1.0f, 1.0f}, {0.5, 0.5}},
        SoftmaxCase{{0.0f, 1.0f}, {1 / (1 + kE), kE / (1 + kE)}},
        // Large values: exp(1000) overflows unless the max is subtracted.
        SoftmaxCase{{1000.0f, 1001.0f}, {1 / (1 + kE), kE / (1 + kE)}},
        SoftmaxCase{{-1000.0f, -1000.0f, -1000.0f, -1000.0f}, {0.25, 0.25, 0.25, 0.25}},
        SoftmaxCase{{-std::numeric_limits<float>::infinity(), 3.0f, 3.0f}, {0.0, 0.5, 0.5}}));

// ---------------------------------------------------------------------------------------------
// Attention

struct AttentionCase {
    const char* name;
    int64_t num_q, q_pos0, num_kv, num_heads, num_kv_heads, head_dim, kv_stride_pad;
};

void NaiveAttention(const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, std::vector<double>& out, const AttentionCase& c,
                    int64_t kv_stride) {
    const int64_t group = c.num_heads / c.num_kv_heads;
    out.assign(c.num_q * c.num_heads * c.head_dim, 0.0);
    for (int64_t i = 0; i < c.num_q; ++i) {
        for (int64_t h = 0; h < c.num_heads; ++h) {
            const int64_t kvh = h / group;
            const int64_t len = c.q_pos0 + i + 1;
            std::vector<double> s(len);
            double max_s = -1e300;
            for (int64_t t = 0; t < len; ++t) {
                double dot = 0.0;
                for (int64_t d = 0; d < c.head_dim; ++d) {
                    dot += double{q[(i * c.num_heads + h) * c.head_dim + d]} *
                           k[t * kv_stride + kvh * c.head_dim + d];
                }
                s[t] = dot / std::sqrt(static_cast<double>(c.head_dim));
                max_s = std::max(max_s, s[t]);
            }
            double sum = 0.0;
            for (double& x : s) sum += (x = std::exp(x - max_s));
            for (int64_t t = 0; t < len; ++t) {
                for (int64_t d = 0; d < c.head_dim; ++d) {
                    out[(i * c.num_heads + h) * c.head_dim + d] +=
                        s[t] / sum * v[t * kv_stride + kvh * c.head_dim + d];
                }
            }
        }
    }
}

class AttentionTest : public ::testing::TestWithParam<AttentionCase> {
  protected:
    void SetUp() override {
        const AttentionCase& c = GetParam();
        kv_stride_ = c.num_kv_heads * c.head_dim + c.kv_stride_pad;
        q_ = RandomVector(c.num_q * c.num_heads * c.head_dim, 40, -2.0f, 2.0f);
        k_ = RandomVector(c.num_kv * kv_stride_, 41, -2.0f, 2.0f);
        v_ = RandomVector(c.num_kv * kv_stride_, 42);
    }
    int64_t kv_stride_ = 0;
    std::vector<float> q_, k_, v_;
};

TEST_P(AttentionTest, MatchesNaiveReference) {
    const AttentionCase& c = GetParam();
    std::vector<float> out(q_.size(), std::numeric_limits<float>::quiet_NaN());
    Attention(q_.data(), k_.data(), v_.data(), out.data(), c.num_q, c.q_pos0, c.num_kv, c.num_heads,
              c.num_kv_heads, c.head_dim, kv_stride_);
    std::vector<double> want;
    NaiveAttention(q_, k_, v_, want, c, kv_stride_);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 1e-5) << "at " << i;
}

TEST_P(AttentionTest, RowsTogetherEqualRowsOneAtATime) {
    // Batch invariance: a row's result does not depend on the other rows computed with it, nor on
    // KV positions after its own (each single-row call sees only its visible prefix).
    const AttentionCase& c = GetParam();
    std::vector<float> together(q_.size());
    Attention(q_.data(), k_.data(), v_.data(), together.data(), c.num_q, c.q_pos0, c.num_kv,
              c.num_heads, c.num_kv_heads, c.head_dim, kv_stride_);
    const int64_t row = c.num_heads * c.head_dim;
    for (int64_t i = 0; i < c.num_q; ++i) {
        std::vector<float> alone(row);
        Attention(q_.data() + i * row, k_.data(), v_.data(), alone.data(), 1, c.q_pos0 + i,
                  c.q_pos0 + i + 1, c.num_heads, c.num_kv_heads, c.head_dim, kv_stride_);
        for (int64_t j = 0; j < row; ++j) ASSERT_EQ(alone[j], together[i * row + j]) << i;
    }
}

TEST_P(AttentionTest, KvHeadMapComputesASliceOfTheHeads) {
    // What a tensor-parallel rank does: query heads [h0, h1) of every row, against the KV heads
    // they read (a window of the cache row), through an explicit query -> KV head map. Each head
    // gives the bits the full computation gives it, also when the split cuts a group.
    const AttentionCase& c = GetParam();
    std::vector<float> full(q_.size());
    Attention(q_.data(), k_.data(), v_.data(), full.data(), c.num_q, c.q_pos0, c.num_kv,
              c.num_heads, c.num_kv_heads, c.head_dim, kv_stride_);
    const int64_t group = c.num_heads / c.num_kv_heads;
    for (int64_t h0 : {int64_t{0}, c.num_heads / 2, c.num_heads / 3}) {
        const int64_t h1 = std::max(h0 + 1, c.num_heads - h0 / 2);
        const int64_t kv0 = h0 / group, kv1 = (h1 - 1) / group + 1;
        const int64_t n = h1 - h0, hd = c.head_dim;
        std::vector<int32_t> map;
        for (int64_t h = h0; h < h1; ++h) map.push_back(static_cast<int32_t>(h / group - kv0));
        std::vector<float> q(c.num_q * n * hd), out(q.size());
        for (int64_t i = 0; i < c.num_q; ++i) {
            std::copy_n(&q_[(i * c.num_heads + h0) * hd], n * hd, &q[i * n * hd]);
        }
        Attention(q.data(), k_.data() + kv0 * hd, v_.data() + kv0 * hd, out.data(), c.num_q,
                  c.q_pos0, c.num_kv, n, kv1 - kv0, hd, kv_stride_, map.data());
        for (int64_t i = 0; i < c.num_q; ++i) {
            for (int64_t j = 0; j < n * hd; ++j) {
                ASSERT_EQ(out[i * n * hd + j], full[(i * c.num_heads + h0) * hd + j])
                    << "heads [" << h0 << ", " << h1 << ") row " << i;
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AttentionTest,
    ::testing::Values(
        // name, num_q, q_pos0, num_kv, heads, kv_heads, head_dim, kv_stride padding
        AttentionCase{"FirstToken", 1, 0, 1, 4, 4, 8, 0},
        AttentionCase{"PrefillMha", 9, 0, 9, 4, 4, 16, 0},
        AttentionCase{"PrefillGqa2", 9, 0, 9, 4, 2, 16, 0},
        AttentionCase{"PrefillGqa3", 6, 0, 6, 6, 2, 8, 0},
        AttentionCase{"DecodeMha", 1, 20, 21, 4, 4, 32, 0},
        AttentionCase{"DecodeGqa2", 1, 20, 21, 8, 4, 64, 0},
        AttentionCase{"DecodeGqa3", 1, 33, 34, 9, 3, 64, 0},
        AttentionCase{"ChunkedPrefillGqa2", 5, 12, 17, 4, 2, 32, 0},
        AttentionCase{"ChunkedPrefillGqa3", 7, 40, 47, 6, 2, 48, 0},
        // KV with more positions than the queries need, rows padded (a wider cache row).
        AttentionCase{"ChunkedPrefillStridedKv", 4, 3, 16, 6, 3, 16, 5},
        AttentionCase{"LongPrefillGqa2", 64, 0, 64, 8, 4, 64, 0}),
    [](const ::testing::TestParamInfo<AttentionCase>& info) { return info.param.name; });

TEST(AttentionTest, SingleKeyReturnsItsValue) {
    // Position 0 attends only to itself: the output is V[0] whatever the scores.
    const std::vector<float> q = {5.0f, -3.0f, 1.0f, 2.0f};
    const std::vector<float> k = {0.3f, 0.1f, -0.2f, 0.9f};
    const std::vector<float> v = {1.5f, -2.5f, 0.25f, 7.0f};
    std::vector<float> out(4);
    Attention(q.data(), k.data(), v.data(), out.data(), 1, 0, 1, 1, 1, 4, 4);
    EXPECT_EQ(out, v);
}

TEST(BlasCoreTest, SuggestionIsEmptyOrAKnownCoreType) {
    EXPECT_FALSE(BlasCoreName().empty());
    const std::string suggested = SuggestedBlasCoreType();
    EXPECT_TRUE(suggested.empty() || suggested == "SkylakeX" || suggested == "Haswell")
        << suggested;
    if (!suggested.empty()) {
        EXPECT_NE(BlasCoreName(), suggested);
    }
    std::printf("OpenBLAS kernels: %s; suggested OPENBLAS_CORETYPE: %s\n", BlasCoreName().c_str(),
                suggested.empty() ? "(none)" : suggested.c_str());
}

TEST(SetNumThreadsTest, SetsOpenMpThreads) {
    const int before = NumThreads();
    SetNumThreads(1);
    EXPECT_EQ(NumThreads(), 1);
    SetNumThreads(0);  // leaves it as is
    EXPECT_EQ(NumThreads(), 1);
    SetNumThreads(before);
    EXPECT_EQ(NumThreads(), before);
}

}  // namespace
}  // namespace kvshard::cpu
