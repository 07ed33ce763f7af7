// The CPU profile's spread (CpuProfile::kind_spread) and the simulator's draws from it
// (SimulationOptions::profile_spread, `kvshard simulate --profile-spread`; docs/simulate.md run
// W): a deterministic profile gives every lone decode step of one shape one time, where the
// machine's spread around it; the validated ITL median, between the steps of one sequence and of
// two, falls on that spread. The fit keeps measured / predicted of every point it kept, per kind;
// the simulator multiplies each decode-only step by one of them, seeded, and leaves steps with a
// prefill chunk at the profile's time.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "sim/cluster/simulator.h"
#include "sim/cpu_profile.h"
#include "tests/sim/sim_test_util.h"

namespace kvshard::sim {
namespace {

constexpr double kA = 2.0e-3, kB = 9.0e-4, kC = 1.5e-3, kD = 3.0e-6;

// Prompts of 50-400 tokens each followed by 20 lone decode steps; every step the linear terms
// times a factor uniform in [0.9, 1.1], and every 500th decode step a stall (x 5).
std::vector<CpuProfilePoint> Calibration() {
    std::mt19937_64 rng(5);
    std::uniform_int_distribution<int64_t> prompt(50, 400);
    std::uniform_real_distribution<double> noise(0.9, 1.1);
    std::vector<CpuProfilePoint> points;
    int decodes = 0;
    while (points.size() < 2100) {
        const int64_t tokens = prompt(rng);
        points.push_back({.prefill_tokens = tokens,
                          .kv_tokens = tokens,
                          .seconds = (kA + kB * static_cast<double>(tokens) +
                                      kD * static_cast<double>(tokens)) *
                                     noise(rng)});
        for (int64_t i = 1; i <= 20; ++i) {
            const double stall = ++decodes % 500 == 0 ? 5.0 : 1.0;
            points.push_back({.decode_seqs = 1,
                              .kv_tokens = tokens + i,
                              .seconds = (kA + kC + kD * static_cast<double>(tokens + i)) *
                                         noise(rng) * stall});
        }
    }
    return points;
}

TEST(ProfileSpreadTest, TheFitKeepsEachKindsRatiosWithoutItsStalls) {
    const std::vector<CpuProfilePoint> points = Calibration();
    Result<CpuProfile> fit = FitCpuProfile(points);
    ASSERT_TRUE(fit.ok()) << fit.status().ToString();
    const std::vector<double>& decode = fit->kind_spread[static_cast<int>(StepKind::kDecode)];
    const std::vector<double>& prefill = fit->kind_spread[static_cast<int>(StepKind::kPrefill)];
    const int64_t decode_points = fit->kind_points[static_cast<int>(StepKind::kDecode)];
    const int64_t stalls = decode_points / 500;
    ASSERT_GT(stalls, 0);
    // Every decode point but the stalls (the robust fit's outliers), sorted, around 1: the
    // noise's +-10% relative to the kind's median.
    EXPECT_EQ(static_cast<int64_t>(decode.size()), decode_points - stalls);
    EXPECT_EQ(static_cast<int64_t>(prefill.size()),
              fit->kind_points[static_cast<int>(StepKind::kPrefill)]);
    EXPECT_TRUE(std::is_sorted(decode.begin(), decode.end()));
    EXPECT_NEAR(decode[decode.size() / 2], 1.0, 0.01);
    EXPECT_NEAR(decode.front(), 0.9, 0.02);
    EXPECT_NEAR(decode.back(), 1.1, 0.02);
    EXPECT_LT(decode.back(), 2.0) << "a stall was kept";
    // Scale-free: a profile scaled for a slower machine keeps them.
    EXPECT_EQ(fit->Scaled(1.3).kind_spread[static_cast<int>(StepKind::kDecode)], decode);
    // No points of a kind, no spread.
    EXPECT_TRUE(fit->kind_spread[static_cast<int>(StepKind::kMixed)].empty());
}

SimulationOptions CpuInstance(const CpuProfile& profile) {
    SimulationOptions o = OneH200Instance(512);
    o.device = *FindAccelerator("cpu");
    o.blocks.num_blocks = 256;
    o.profile = profile;
    return o;
}

TEST(ProfileSpreadTest, DecodeStepsDrawFromTheSpreadAndPrefillStepsDoNot) {
    CpuProfile profile{.a = 0.004};
    const std::vector<double> spread = {0.8, 0.9, 1.0, 1.1, 1.5};
    profile.kind_spread[static_cast<int>(StepKind::kDecode)] = spread;
    profile.kind_spread[static_cast<int>(StepKind::kPrefill)] = {3.0};  // would be seen in TTFT
    const std::vector<SimRequest> one = {{0.0, 10, 200, -1, 0}};
    SimulationOptions o = CpuInstance(profile);
    Result<SimulationResult> plain = Simulate(o, one, 1);
    o.profile_spread = true;
    Result<SimulationResult> drawn = Simulate(o, one, 1);
    Result<SimulationResult> again = Simulate(o, one, 1);
    Result<SimulationResult> other = Simulate(o, one, 2);
    for (const auto* r : {&plain, &drawn, &again, &other})
        ASSERT_TRUE(r->ok()) << r->status().ToString();
    constexpr double kClockS = 1e-7;  // the virtual clock rounds each step's end to a nanosecond

    // Without the flag every decode step costs the profile's 4 ms.
    for (const double gap : plain->run.outcomes[0].itl_s) EXPECT_NEAR(gap, 0.004, kClockS);
    // With it each gap is 4 ms times one of the spread's values, and over 199 gaps every value
    // comes up; the prompt's step is not drawn (its kind's spread of 3.0 would triple it).
    std::set<long> seen;
    for (const double gap : drawn->run.outcomes[0].itl_s) {
        const double factor = gap / 0.004;
        const auto it = std::min_element(spread.begin(), spread.end(), [&](double x, double y) {
            return std::fabs(x - factor) < std::fabs(y - factor);
        });
        EXPECT_NEAR(*it, factor, 1e-4);
        seen.insert(std::lround(*it * 10));
    }
    EXPECT_EQ(seen.size(), spread.size());
    EXPECT_NEAR(drawn->run.outcomes[0].ttft_s, plain->run.outcomes[0].ttft_s, kClockS);
    // Seeded: the same seed draws the same steps, another seed others.
    EXPECT_EQ(again->run.outcomes[0].itl_s, drawn->run.outcomes[0].itl_s);
    EXPECT_NE(other->run.outcomes[0].itl_s, drawn->run.outcomes[0].itl_s);
}

TEST(ProfileSpreadTest, AnEmptySpreadLeavesTheProfilesTime) {
    SimulationOptions o = CpuInstance(CpuProfile{.a = 0.004});  // a profile from no kept decode
    o.profile_spread = true;
    Result<SimulationResult> r = Simulate(o, {{0.0, 10, 20, -1, 0}}, 3);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    for (const double gap : r->run.outcomes[0].itl_s) EXPECT_NEAR(gap, 0.004, 1e-7);
}

}  // namespace
}  // namespace kvshard::sim
