// The CPU profile's estimator is a median fit (sim/cpu_profile.h): on synthetic steps with known
// coefficients and right-skewed noise (a step is sometimes much slower than usual, never much
// faster), the median of measured / predicted is 1 for every kind of step, where least squares of
// the relative error comes out low; stalled steps still get weight 0.
#include "sim/cpu_profile.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace kvshard::sim {
namespace {

struct Coefficients {
    double a, b, c, d, e;
};

double TrueSeconds(const Coefficients& k, const CpuProfilePoint& p) {
    return k.a + k.b * static_cast<double>(p.prefill_tokens) +
           k.c * static_cast<double>(p.decode_seqs) + k.d * static_cast<double>(p.kv_tokens) +
           k.e * static_cast<double>(p.prefill_pairs);
}

// Noise with median exactly 1 (so the true coefficients are the conditional median).
enum class Noise {
    kExponential,  // 1 + s (E - ln 2), E ~ Exp(1): a long right tail
    kLognormal,    // exp(s Z)
    kUniform,      // 1 + U(-s, s): symmetric
};

double Draw(Noise noise, double s, std::mt19937_64& rng) {
    switch (noise) {
        case Noise::kExponential:
            return 1 + s * (std::exponential_distribution<double>(1.0)(rng) - std::log(2.0));
        case Noise::kLognormal:
            return std::exp(s * std::normal_distribution<double>(0, 1)(rng));
        case Noise::kUniform:
            return 1 + std::uniform_real_distribution<double>(-s, s)(rng);
    }
    return 1;
}

// Serving-like steps of the three kinds: decodes of 1-8 sequences (most of them 1-2), prefill
// chunks from scratch or after a cached prefix, and chunks mixed with decodes.
std::vector<CpuProfilePoint> Steps(const Coefficients& k, Noise noise, double s, int n,
                                   double stall_fraction, uint64_t seed,
                                   std::vector<bool>* stalled) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> context(50, 900), chunk(8, 512), seqs(1, 8);
    std::uniform_real_distribution<double> unit(0, 1), stall(3.0, 30.0);
    std::vector<CpuProfilePoint> points;
    for (int i = 0; i < n; ++i) {
        CpuProfilePoint p;
        const double kind = unit(rng);
        const int64_t decode_seqs = unit(rng) < 0.6 ? 1 + (unit(rng) < 0.3) : seqs(rng);
        if (kind < 0.7 || i % 3 == 0) {  // decode only
            p.decode_seqs = decode_seqs;
            for (int64_t j = 0; j < p.decode_seqs; ++j) p.kv_tokens += context(rng);
        } else {
            const int64_t q = chunk(rng);
            const int64_t start = unit(rng) < 0.3 ? context(rng) : 0;
            p.prefill_tokens = q;
            p.prefill_pairs = q * start + q * (q + 1) / 2;
            p.kv_tokens = start + q;
            p.cached_chunks = start > 0 ? 1 : 0;  // the "cached" kind
            if (kind > 0.85) {  // mixed
                p.decode_seqs = decode_seqs;
                for (int64_t j = 0; j < p.decode_seqs; ++j) p.kv_tokens += context(rng);
            }
        }
        p.seconds = TrueSeconds(k, p) * Draw(noise, s, rng);
        const bool stall_this = unit(rng) < stall_fraction;
        if (stall_this) p.seconds *= stall(rng);  // 3-30x: far beyond the noise
        stalled->push_back(stall_this);
        points.push_back(p);
    }
    return points;
}

double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

struct Case {
    const char* name;
    Noise noise;
    double spread;
    double stall_fraction;
    double typical_tolerance;  // relative, on typical steps' predicted time
};

class CpuProfileMedianTest : public ::testing::TestWithParam<Case> {};

TEST_P(CpuProfileMedianTest, MedianResidualIsZeroPerKindOfStep) {
    const Case& t = GetParam();
    const Coefficients k{2.7e-3, 1.5e-3, 2.3e-3, 4.8e-6, 6e-7};
    std::vector<bool> stalled;
    const std::vector<CpuProfilePoint> points =
        Steps(k, t.noise, t.spread, 2400, t.stall_fraction, 7, &stalled);
    const auto stalls = static_cast<int64_t>(std::count(stalled.begin(), stalled.end(), true));
    Result<CpuProfile> p = FitCpuProfile(points);
    ASSERT_TRUE(p.ok()) << p.status().ToString();

    // Measured / predicted per kind over the steps not stalled, each counted once per token it
    // produced.
    std::vector<double> ratios[kNumStepKinds];
    for (size_t i = 0; i < points.size(); ++i) {
        const CpuProfilePoint& q = points[i];
        if (stalled[i]) continue;
        for (int64_t token = 0; token < std::max<int64_t>(1, q.decode_seqs); ++token)
            ratios[static_cast<int>(KindOf(q))].push_back(q.seconds / p->Predict(q));
    }
    for (int kind = 0; kind < kNumStepKinds; ++kind) {
        SCOPED_TRACE(std::string(StepKindName(static_cast<StepKind>(kind))));
        ASSERT_GT(ratios[kind].size(), 100u);
        const double median = Median(ratios[kind]);
        EXPECT_NEAR(median, 1.0, 0.005);
        EXPECT_EQ(p->kind_points[kind], static_cast<int64_t>(std::count_if(  // stalls too
            points.begin(), points.end(),
            [&](const CpuProfilePoint& q) { return static_cast<int>(KindOf(q)) == kind; })));
    }
    // Typical steps of each kind come out at their true median time.
    const CpuProfilePoint typical[] = {
        {.prefill_tokens = 0, .decode_seqs = 1, .kv_tokens = 480},
        {.prefill_tokens = 0, .decode_seqs = 4, .kv_tokens = 1900},
        {.prefill_tokens = 256, .decode_seqs = 0, .kv_tokens = 256, .prefill_pairs = 256 * 257 / 2},
        {.prefill_tokens = 128, .decode_seqs = 2, .kv_tokens = 1100, .prefill_pairs = 128 * 129 / 2}};
    for (const CpuProfilePoint& q : typical) {
        EXPECT_NEAR(p->Predict(q) / TrueSeconds(k, q), 1.0, t.typical_tolerance)
            << q.prefill_tokens << " prefill tokens, " << q.decode_seqs << " decodes";
    }
    // Stalls get weight 0; few of the ordinary steps do.
    EXPECT_GE(p->num_outliers, stalls * 9 / 10);
    EXPECT_LE(p->num_outliers, stalls + static_cast<int64_t>(points.size()) / 20);
}

INSTANTIATE_TEST_SUITE_P(
    SkewedNoise, CpuProfileMedianTest,
    ::testing::Values(Case{"exponential_tail", Noise::kExponential, 0.3, 0.0, 0.08},
                      Case{"exponential_tail_with_stalls", Noise::kExponential, 0.1, 0.05, 0.05},
                      Case{"lognormal", Noise::kLognormal, 0.25, 0.0, 0.08},
                      Case{"lognormal_with_stalls", Noise::kLognormal, 0.08, 0.08, 0.05},
                      Case{"symmetric", Noise::kUniform, 0.05, 0.0, 0.03}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// What the median fit fixes, on one constant term over exponential-tailed times: least squares
// of the relative error gives (sum 1/y) / (sum 1/y^2), below the times' median; the fit gives the
// median.
TEST(CpuProfileTest, OneTermFitIsTheMedianNotTheRelativeLeastSquaresOptimum) {
    std::mt19937_64 rng(3);
    std::vector<CpuProfilePoint> points;
    std::vector<double> times;
    double s1 = 0, s2 = 0;
    for (int i = 0; i < 501; ++i) {
        const double t = 0.01 * Draw(Noise::kExponential, 0.5, rng);
        points.push_back({.prefill_tokens = 0, .decode_seqs = 0, .kv_tokens = 0, .seconds = t});
        times.push_back(t);
        s1 += 1 / t;
        s2 += 1 / (t * t);
    }
    Result<CpuProfile> p = FitCpuProfile(points);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    const double median = Median(times);
    const double relative_least_squares = s1 / s2;
    EXPECT_LT(relative_least_squares, 0.95 * median);  // the bias the median fit removes
    EXPECT_NEAR(p->Predict(points[0]), median, 0.005 * median);
    EXPECT_GT(p->kind_scale[static_cast<int>(StepKind::kDecode)], 1.02);  // (1) alone is low
}

TEST(CpuProfileTest, KindsAndScaling) {
    EXPECT_EQ(KindOf({.prefill_tokens = 0, .decode_seqs = 3}), StepKind::kDecode);
    EXPECT_EQ(KindOf({.prefill_tokens = 12, .decode_seqs = 0}), StepKind::kPrefill);
    EXPECT_EQ(KindOf({.prefill_tokens = 12, .decode_seqs = 1}), StepKind::kMixed);
    const CpuProfile p{.a = 1e-3, .b = 2e-4, .c = 3e-3, .d = 1e-6, .e = 1e-7, .f = 5e-4};
    const CpuProfile q = p.Scaled(1.25);
    const CpuProfilePoint step{.prefill_tokens = 100,
                               .decode_seqs = 2,
                               .kv_tokens = 900,
                               .seconds = 0,
                               .prefill_pairs = 5050,
                               .arrivals = 1};
    EXPECT_NEAR(q.Predict(step), 1.25 * p.Predict(step), 1e-15);
    EXPECT_DOUBLE_EQ(q.f, 1.25 * p.f);
}

}  // namespace
}  // namespace kvshard::sim
