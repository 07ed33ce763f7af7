// The CPU profile's term k per step with a prefill chunk (CpuProfilePoint::prefill_step,
// docs/simulate.md run T): on kvshard's CPU engine a step that runs a prefill chunk costs a
// constant over its tokens' terms that a decode step does not, so one intercept shared by both
// prices small prefills low and large ones high (run S's calibration: 1.17x and 0.92x). The step
// log writes the field, the fit recovers the constant, and the simulator charges it to its own
// prefill and mixed steps only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/clock.h"
#include "coordinator/step_log.h"
#include "sim/cluster/simulator.h"
#include "sim/cost_model.h"
#include "sim/cpu_profile.h"
#include "tests/sim/sim_test_util.h"
#include "tests/test_util.h"

namespace kvshard::sim {
namespace {

constexpr double kA = 1.0e-3, kB = 6.7e-4, kC = 1.4e-3, kD = 2.8e-6, kK = 1.0e-2;

// Busy periods as a server logs them: a prompt of 20-500 tokens, then 10-60 decode steps of 1-4
// sequences. Each step costs the linear terms, plus kK when it has a prefill chunk, times noise.
std::vector<CpuProfilePoint> Calibration(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> prompt(20, 500), run(10, 60), seqs(1, 4);
    std::uniform_real_distribution<double> noise(0.97, 1.03);
    std::vector<CpuProfilePoint> points;
    while (points.size() < 3000) {
        const int64_t tokens = prompt(rng);
        const int64_t batch = seqs(rng);
        const int64_t steps = run(rng);
        for (int64_t i = -1; i < steps; ++i) {
            CpuProfilePoint p =
                i < 0 ? CpuProfilePoint{.prefill_tokens = tokens, .kv_tokens = tokens}
                      : CpuProfilePoint{.decode_seqs = batch, .kv_tokens = batch * (tokens + i)};
            p.prefill_step = p.prefill_tokens > 0 ? 1 : 0;
            p.seconds = (kA + kB * static_cast<double>(p.prefill_tokens) +
                         kC * static_cast<double>(p.decode_seqs) +
                         kD * static_cast<double>(p.kv_tokens) +
                         kK * static_cast<double>(p.prefill_step)) *
                        noise(rng);
            points.push_back(p);
        }
    }
    return points;
}

CpuProfilePoint Prefill(int64_t tokens) {
    return {.prefill_tokens = tokens, .kv_tokens = tokens, .prefill_step = 1};
}

double Truth(const CpuProfilePoint& p) {
    return kA + kB * static_cast<double>(p.prefill_tokens) +
           kC * static_cast<double>(p.decode_seqs) + kD * static_cast<double>(p.kv_tokens) +
           kK * static_cast<double>(p.prefill_step);
}

TEST(PrefillStepTermTest, ParsesTheFieldAndRefusesABadOne) {
    Result<std::vector<CpuProfilePoint>> points = ParseCpuProfilePoints(
        R"({"prefill_tokens": 24, "decode_seqs": 0, "kv_tokens": 24, "seconds": 0.03,
            "prefill_step": 1})",
        "p.jsonl");
    ASSERT_TRUE(points.ok()) << points.status().ToString();
    EXPECT_EQ((*points)[0].prefill_step, 1);
    Result<std::vector<CpuProfilePoint>> bad = ParseCpuProfilePoints(
        R"({"prefill_tokens": 24, "decode_seqs": 0, "kv_tokens": 24, "seconds": 0.03,
            "prefill_step": 2})",
        "p.jsonl");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("'prefill_step'"), std::string::npos)
        << bad.status().message();
    EXPECT_NE(bad.status().message().find("p.jsonl"), std::string::npos)
        << bad.status().message();
}

TEST(PrefillStepTermTest, TheFitRecoversTheConstantAndPricesSmallAndLargePrefills) {
    const std::vector<CpuProfilePoint> points = Calibration(11);
    Result<CpuProfile> fit = FitCpuProfile(points);
    ASSERT_TRUE(fit.ok()) << fit.status().ToString();
    EXPECT_NEAR(fit->k, kK, 0.1 * kK);
    EXPECT_NEAR(fit->a, kA, 0.3 * kA);
    for (const int64_t tokens : {24, 100, 480}) {
        const CpuProfilePoint p = Prefill(tokens);
        EXPECT_NEAR(fit->Seconds(p) / Truth(p), 1, 0.03) << tokens;
    }
    // Without the field (a step log from before it) the prefill kind's median factor levels the
    // prefills as a whole, but one intercept cannot price a 24-token and a 480-token prefill
    // both: the small one comes out more than 10% short.
    std::vector<CpuProfilePoint> old = points;
    for (CpuProfilePoint& p : old) p.prefill_step = 0;
    Result<CpuProfile> old_fit = FitCpuProfile(old);
    ASSERT_TRUE(old_fit.ok()) << old_fit.status().ToString();
    EXPECT_EQ(old_fit->k, 0);
    CpuProfilePoint small = Prefill(24);
    const double truth = Truth(small);
    small.prefill_step = 0;
    EXPECT_LT(old_fit->Seconds(small) / truth, 0.9);
}

// The simulator charges k to a step with a prefill chunk (the prompt's step and a mixed one),
// never to a decode-only step.
TEST(PrefillStepTermTest, TheSimulatorChargesItToPrefillStepsOnly) {
    SimulationOptions o = OneH200Instance(512);
    o.device = *FindAccelerator("cpu");
    o.blocks.num_blocks = 256;
    o.profile = CpuProfile{.a = 0.004};
    const int64_t output = 8;  // a prefill step and 7 decodes
    const std::vector<SimRequest> one = {{0.0, 10, output, -1, 0}};
    Result<SimulationResult> base = Simulate(o, one);
    o.profile->k = 0.01;
    Result<SimulationResult> with = Simulate(o, one);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    ASSERT_TRUE(with.ok()) << with.status().ToString();
    constexpr double kClockS = 1e-7;  // the virtual clock rounds each step's end to a nanosecond
    EXPECT_NEAR(with->run.outcomes[0].ttft_s - base->run.outcomes[0].ttft_s, 0.01, kClockS);
    EXPECT_NEAR(with->run.outcomes[0].e2e_s - base->run.outcomes[0].e2e_s, 0.01, kClockS);
    for (const double gap : with->run.outcomes[0].itl_s) EXPECT_NEAR(gap, 0.004, kClockS);

    // A second request arriving while the first decodes joins a mixed step: k once more, on the
    // first request's gap that the mixed step makes.
    const std::vector<SimRequest> two = {{0.0, 10, output, -1, 0}, {0.0155, 10, output, -1, 0}};
    Result<SimulationResult> pair = Simulate(o, two);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    const std::vector<double>& gaps = pair->run.outcomes[0].itl_s;
    const auto slow = std::count_if(gaps.begin(), gaps.end(),
                                    [](double gap) { return gap > 0.004 + 0.005; });
    EXPECT_EQ(slow, 1);
}

TEST(PrefillStepTermTest, TheStepLogWritesIt) {
    StepPlan plan;
    ScheduledSequence prompt;
    prompt.seq_id = 1;
    prompt.token_ids.assign(40, 7);
    plan.sequences.push_back(prompt);
    EXPECT_EQ(ShapeOfStep(plan).prefill_step, 1);
    ScheduledSequence decode;
    decode.seq_id = 2;
    decode.start_pos = 30;
    decode.token_ids.assign(1, 7);
    StepPlan decodes;
    decodes.sequences.push_back(decode);
    EXPECT_EQ(ShapeOfStep(decodes).prefill_step, 0);
    Result<std::vector<CpuProfilePoint>> points = ParseCpuProfilePoints(
        StepLogLine({.instance = "mixed-0", .shape = ShapeOfStep(plan), .seconds = 0.05}),
        "line");
    ASSERT_TRUE(points.ok()) << points.status().ToString();
    EXPECT_EQ((*points)[0].prefill_step, 1);
}

}  // namespace
}  // namespace kvshard::sim
