// Two terms of the CPU profile that a step's plan alone does not give (docs/simulate.md run S):
// - h per step of two or more rows (CpuProfilePoint::multi_row): the CPU engine runs a lone
//   decode row through its batch-1 kernels and anything more through the multi-row ones, so the
//   second row of a step costs a jump, not the slope of the rows after it;
// - w x WarmUp(decodes_since_prefill): a decode step is slower the sooner it follows a step with
//   a prefill chunk, decaying over tens of steps (warm_tau, chosen by the fit).
// The step log (StepLogExecutor, which sees every step) and the simulator must count both alike,
// and the fit must recover them where a fit without them mispredicts.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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

TEST(StepHistoryTermsTest, DecodesSincePrefillCountsDecodeOnlySteps) {
    struct Case {
        int64_t prefill_tokens, decode_seqs, previous, want;
    };
    for (const Case& c : std::vector<Case>{{512, 0, 7, 0},   // a prompt resets
                                           {24, 3, 7, 0},    // so does a mixed step
                                           {0, 1, 0, 1},     // the first decode after it
                                           {0, 4, 1, 2},     // any batch of decodes counts one
                                           {0, 0, 5, 5}}) {  // an empty step moves nothing
        EXPECT_EQ(NextDecodesSincePrefill(c.prefill_tokens, c.decode_seqs, c.previous), c.want)
            << c.prefill_tokens << " " << c.decode_seqs << " " << c.previous;
    }
}

TEST(StepHistoryTermsTest, ParsesTheFieldsAndRefusesABadOne) {
    Result<std::vector<CpuProfilePoint>> points = ParseCpuProfilePoints(
        R"({"prefill_tokens": 0, "decode_seqs": 2, "kv_tokens": 300, "seconds": 0.006,
            "multi_row": 1, "decodes_since_prefill": 3})",
        "p.jsonl");
    ASSERT_TRUE(points.ok()) << points.status().ToString();
    EXPECT_EQ((*points)[0].multi_row, 1);
    EXPECT_EQ((*points)[0].decodes_since_prefill, 3);
    Result<std::vector<CpuProfilePoint>> bad = ParseCpuProfilePoints(
        R"({"prefill_tokens": 0, "decode_seqs": 2, "kv_tokens": 300, "seconds": 0.006,
            "multi_row": 2})",
        "p.jsonl");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("multi_row"), std::string::npos)
        << bad.status().message();
}

// A calibration of decode runs after prompts, as a server logs them: each busy period is a
// prompt, then a run of decode steps of 1-4 sequences, counted as the step log counts them.
// Every step costs the true linear terms, plus `jump_s` when it has two or more rows, plus
// `warm_s` x exp(-(n - 1) / tau) for the n-th decode step after the prompt, times noise.
constexpr double kA = 1.8e-3, kB = 8e-4, kC = 1.1e-3, kD = 2.5e-6;

std::vector<CpuProfilePoint> Calibration(double jump_s, double warm_s, double tau, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> prompt(20, 500), run(10, 80), seqs(1, 4);
    std::uniform_real_distribution<double> noise(0.97, 1.03);
    std::vector<CpuProfilePoint> points;
    int64_t since = 0;
    while (points.size() < 3000) {
        CpuProfilePoint p{.prefill_tokens = prompt(rng), .decode_seqs = 0};
        p.kv_tokens = p.prefill_tokens;
        const int64_t batch = seqs(rng);
        const int64_t steps = run(rng);
        for (int64_t i = -1; i < steps; ++i) {
            if (i >= 0) p = CpuProfilePoint{.decode_seqs = batch, .kv_tokens = batch * (200 + i)};
            p.multi_row = p.prefill_tokens + p.decode_seqs >= 2 ? 1 : 0;
            since = NextDecodesSincePrefill(p.prefill_tokens, p.decode_seqs, since);
            p.decodes_since_prefill = since;
            const double warm =
                since > 0 ? warm_s * std::exp(-static_cast<double>(since - 1) / tau) : 0.0;
            p.seconds =
                (kA + kB * static_cast<double>(p.prefill_tokens) +
                 kC * static_cast<double>(p.decode_seqs) + kD * static_cast<double>(p.kv_tokens) +
                 jump_s * static_cast<double>(p.multi_row) + warm) *
                noise(rng);
            points.push_back(p);
        }
    }
    return points;
}

CpuProfilePoint Decode(int64_t seqs, int64_t since) {
    return {.decode_seqs = seqs,
            .kv_tokens = seqs * 300,
            .multi_row = seqs >= 2 ? 1 : 0,
            .decodes_since_prefill = since};
}

double Truth(const CpuProfilePoint& p, double jump_s, double warm_s, double tau) {
    return kA + kC * static_cast<double>(p.decode_seqs) + kD * static_cast<double>(p.kv_tokens) +
           jump_s * static_cast<double>(p.multi_row) +
           warm_s * std::exp(-static_cast<double>(p.decodes_since_prefill - 1) / tau);
}

TEST(StepHistoryTermsTest, TheFitRecoversTheJumpOfASecondRow) {
    const double jump_s = 1.5e-3;
    const std::vector<CpuProfilePoint> points = Calibration(jump_s, 0, 8, 3);
    Result<CpuProfile> fit = FitCpuProfile(points);
    ASSERT_TRUE(fit.ok()) << fit.status().ToString();
    EXPECT_NEAR(fit->h, jump_s, 0.1 * jump_s);
    EXPECT_NEAR(fit->w, 0, 1e-4);
    for (const int64_t seqs : {1, 2, 4}) {
        const CpuProfilePoint warm = Decode(seqs, 100);
        EXPECT_NEAR(fit->Seconds(warm) / Truth(warm, jump_s, 0, 8), 1, 0.02) << seqs;
    }
    // Without the field (a step log from before it) one slope cannot give both a lone row and
    // two rows their cost: one of them is off by more than 6% (with it, both within 2%).
    std::vector<CpuProfilePoint> old = points;
    for (CpuProfilePoint& p : old) p.multi_row = 0;
    Result<CpuProfile> old_fit = FitCpuProfile(old);
    ASSERT_TRUE(old_fit.ok()) << old_fit.status().ToString();
    EXPECT_EQ(old_fit->h, 0);
    double worst = 0;
    for (const int64_t seqs : {1, 2}) {
        CpuProfilePoint p = Decode(seqs, 100);
        const double truth = Truth(p, jump_s, 0, 8);
        p.multi_row = 0;
        worst = std::max(worst, std::fabs(old_fit->Seconds(p) / truth - 1));
    }
    EXPECT_GT(worst, 0.06);
}

TEST(StepHistoryTermsTest, TheFitRecoversTheWarmUpAfterAPrefillAndItsLength) {
    const double warm_s = 2e-3, tau = 16;  // tau one of kWarmTaus
    const std::vector<CpuProfilePoint> points = Calibration(0, warm_s, tau, 5);
    Result<CpuProfile> fit = FitCpuProfile(points);
    ASSERT_TRUE(fit.ok()) << fit.status().ToString();
    EXPECT_EQ(fit->warm_tau, tau);
    EXPECT_NEAR(fit->w, warm_s, 0.1 * warm_s);
    for (const int64_t since : {1, 4, 16, 60}) {
        const CpuProfilePoint p = Decode(1, since);
        EXPECT_NEAR(fit->Seconds(p) / Truth(p, 0, warm_s, tau), 1, 0.03) << since;
    }
    // Without the field the first decode steps after a prompt are predicted at the average.
    std::vector<CpuProfilePoint> old = points;
    for (CpuProfilePoint& p : old) p.decodes_since_prefill = 0;
    Result<CpuProfile> old_fit = FitCpuProfile(old);
    ASSERT_TRUE(old_fit.ok()) << old_fit.status().ToString();
    EXPECT_EQ(old_fit->w, 0);
    EXPECT_EQ(old_fit->warm_tau, 0);
    CpuProfilePoint first = Decode(1, 1);
    const double truth = Truth(first, 0, warm_s, tau);
    first.decodes_since_prefill = 0;
    EXPECT_LT(old_fit->Seconds(first) / truth, 0.8);
}

// The step log counts every step the engine ran, logged or not: a step whose cycle is not
// written (the last of a busy period) still moves the count.
class FakeExecutor : public StepExecutor {
  public:
    explicit FakeExecutor(VirtualClock& clock) : clock_(clock) {}
    Result<StepResult> Execute(const StepPlan&) override {
        clock_.AdvanceSeconds(0.01);
        return StepResult{};
    }

  private:
    VirtualClock& clock_;
};

StepPlan PlanOf(const std::vector<std::array<int64_t, 3>>& seqs) {  // {seq id, start, tokens}
    StepPlan plan;
    for (const auto& [id, start, tokens] : seqs) {
        ScheduledSequence s;
        s.seq_id = id;
        s.start_pos = start;
        s.token_ids.assign(static_cast<size_t>(tokens), 7);
        plan.sequences.push_back(s);
    }
    return plan;
}

TEST(StepHistoryTermsTest, TheStepLogWritesBothFields) {
    VirtualClock clock;
    FakeExecutor inner(clock);
    const std::string path =
        (std::filesystem::temp_directory_path() /
         ("step_history." + std::to_string(::testing::UnitTest::GetInstance()->random_seed())))
            .string();
    Result<std::unique_ptr<StepLog>> log = StepLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status().message();
    StepLogExecutor executor(inner, **log, "mixed-0", clock);
    const std::vector<StepPlan> plans = {
        PlanOf({{1, 0, 40}}),             // prompt: 0, multi-row
        PlanOf({{1, 40, 1}}),             // decode 1, one row
        PlanOf({{1, 41, 1}}),             // decode 2 (its successor has no common sequence)
        PlanOf({{2, 30, 1}}),             // decode 3: counted though the step before is unlogged
        PlanOf({{2, 31, 1}, {3, 0, 1}}),  // a one-token prompt joins: 0, two rows
        PlanOf({{2, 32, 1}, {3, 1, 1}}),  // decode 1, two rows
        PlanOf({{2, 33, 1}}),             // (the last, never written)
    };
    for (const StepPlan& plan : plans) ASSERT_TRUE(executor.Execute(plan).ok());
    log->reset();
    Result<std::vector<CpuProfilePoint>> points =
        ParseCpuProfilePoints(testing::ReadFile(path), path);
    std::filesystem::remove(path);
    ASSERT_TRUE(points.ok()) << points.status().ToString();
    ASSERT_EQ(points->size(), 5u);  // plans 0, 1, 3, 4, 5: 2 has no common sequence with 3
    const std::vector<int64_t> since = {0, 1, 3, 0, 1}, multi_row = {1, 0, 0, 1, 1};
    for (size_t i = 0; i < points->size(); ++i) {
        EXPECT_EQ((*points)[i].decodes_since_prefill, since[i]) << i;
        EXPECT_EQ((*points)[i].multi_row, multi_row[i]) << i;
    }
}

// The simulator's virtual clock keeps nanoseconds: each step's end is rounded to one.
constexpr double kClockS = 1e-7;

// The simulator charges its own steps alike: one request alone on a profile with h and w, its
// steps a prompt then decodes of one row, each n-th decode w x exp(-(n - 1) / tau) longer; a
// second request at the same time makes every step two rows, each h longer.
TEST(StepHistoryTermsTest, TheSimulatorCountsItsOwnStepsAlike) {
    SimulationOptions o = OneH200Instance(512);
    o.device = *FindAccelerator("cpu");
    o.blocks.num_blocks = 256;
    o.profile = CpuProfile{.a = 0.004};
    const int64_t output = 20;  // a prefill step and 19 decodes
    const std::vector<SimRequest> one = {{0.0, 10, output, -1, 0}};
    Result<SimulationResult> base = Simulate(o, one);
    o.profile->w = 0.002;
    o.profile->warm_tau = 8;
    o.profile->h = 0.001;
    Result<SimulationResult> with = Simulate(o, one);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    ASSERT_TRUE(with.ok()) << with.status().ToString();
    double warm = 0;
    for (int n = 1; n < output; ++n) warm += 0.002 * std::exp(-(n - 1) / 8.0);
    // The prompt's step is two or more rows (10 tokens): h once.
    EXPECT_NEAR(with->run.outcomes[0].e2e_s - base->run.outcomes[0].e2e_s, warm + 0.001, kClockS);
    ASSERT_EQ(with->run.outcomes[0].itl_s.size(), static_cast<size_t>(output - 1));
    EXPECT_NEAR(with->run.outcomes[0].itl_s[0], 0.004 + 0.002, kClockS);
    EXPECT_NEAR(with->run.outcomes[0].itl_s[8], 0.004 + 0.002 * std::exp(-1.0), kClockS);

    const std::vector<SimRequest> two = {{0.0, 10, output, -1, 0}, {0.0, 10, output, -1, 0}};
    o.profile->w = 0;
    Result<SimulationResult> pair = Simulate(o, two);
    ASSERT_TRUE(pair.ok()) << pair.status().ToString();
    for (const double gap : pair->run.outcomes[0].itl_s) EXPECT_NEAR(gap, 0.004 + 0.001, kClockS);
}

}  // namespace
}  // namespace kvshard::sim
