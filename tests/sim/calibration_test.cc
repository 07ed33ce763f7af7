// What validating the simulator against the CPU server rests on (docs/simulate.md, "Against
// this machine"): `kvshard bench --trace-out` writes a trace the simulator reads back as the
// same requests, and `kvshard serve --step-log` writes serving steps the CPU profile fits.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "common/clock.h"
#include "coordinator/step_log.h"
#include "loadgen/trace_file.h"
#include "sim/cost_model.h"
#include "sim/workload.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

std::string TempPath(const std::string& name) {
    return (std::filesystem::temp_directory_path() /
            (name + "." + std::to_string(::testing::UnitTest::GetInstance()->random_seed())))
        .string();
}

loadgen::RequestOutcome Completed(double start_s, int64_t prompt_tokens, int64_t output_tokens) {
    loadgen::RequestOutcome o;
    o.ok = true;
    o.start_s = start_s;
    o.prompt_tokens = prompt_tokens;
    o.output_tokens = output_tokens;
    return o;
}

TEST(BenchTraceTest, SimulatorReadsBackTheRequestsBenchSent) {
    // Two prefix groups and a prompt without one; request 2 failed; request 3 was sent before
    // request 1 finished being sent (arrivals out of dataset order are sorted).
    std::vector<loadgen::BenchPrompt> prompts(5);
    prompts[0].prefix = "alpha beta";
    prompts[1].prefix = "gamma";
    prompts[2].prefix = "alpha beta";
    prompts[3].prefix = "alpha beta";
    loadgen::BenchRun run;
    run.outcomes = {Completed(0.0, 40, 8),
                    Completed(0.9, 33, 8),
                    {},
                    Completed(0.5, 41, 6),
                    Completed(1.5, 12, 3)};
    run.outcomes[2].start_s = 0.7;
    int counted = 0;
    const loadgen::TokenCounter count = [&](const std::string& text, bool add_special) {
        ++counted;
        EXPECT_TRUE(add_special);
        return Result<int64_t>(text == "alpha beta" ? 30 : 50);  // "gamma" longer than its prompt
    };
    Result<std::vector<loadgen::TraceLineFields>> trace = loadgen::MakeTrace(prompts, run, count);
    ASSERT_TRUE(trace.ok()) << trace.status().message();
    EXPECT_EQ(counted, 2);  // once per prefix
    const std::string path = TempPath("bench_trace.jsonl");
    ASSERT_TRUE(loadgen::WriteTraceFile(path, *trace).ok());

    Result<std::vector<sim::SimRequest>> read = sim::ReadTrace(path);
    std::filesystem::remove(path);
    ASSERT_TRUE(read.ok()) << read.status().message();
    const std::vector<sim::SimRequest> want = {
        {.arrival_s = 0.0, .prompt_len = 40, .output_len = 8, .prefix_group = 0, .prefix_len = 30},
        {.arrival_s = 0.5, .prompt_len = 41, .output_len = 6, .prefix_group = 0, .prefix_len = 30},
        {.arrival_s = 0.9, .prompt_len = 33, .output_len = 8, .prefix_group = 1, .prefix_len = 33},
        {.arrival_s = 1.5, .prompt_len = 12, .output_len = 3},
    };
    EXPECT_EQ(*read, want);
}

TEST(BenchTraceTest, RefusesARunWhoseServerDidNotCountThePrompt) {
    std::vector<loadgen::BenchPrompt> prompts(1);
    loadgen::BenchRun run;
    run.outcomes = {Completed(0.0, -1, 8)};
    const loadgen::TokenCounter count = [](const std::string&, bool) { return Result<int64_t>(1); };
    Result<std::vector<loadgen::TraceLineFields>> trace = loadgen::MakeTrace(prompts, run, count);
    ASSERT_FALSE(trace.ok());
    EXPECT_NE(trace.status().message().find("prompt_tokens"), std::string::npos);
}

// Runs each plan in `cost_s` seconds of the virtual clock; the engine's output stage and the
// next plan take `gap_s` more (the test advances the clock between steps).
class FakeExecutor : public StepExecutor {
  public:
    explicit FakeExecutor(VirtualClock& clock) : clock_(clock) {}
    Result<StepResult> Execute(const StepPlan&) override {
        clock_.AdvanceSeconds(cost_s);
        return StepResult{};
    }
    double cost_s = 0;

  private:
    VirtualClock& clock_;
};

ScheduledSequence Seq(int64_t seq_id, int64_t start_pos, int64_t num_tokens) {
    ScheduledSequence s;
    s.seq_id = seq_id;
    s.start_pos = start_pos;
    s.token_ids.assign(static_cast<size_t>(num_tokens), 7);
    return s;
}

TEST(StepLogTest, WritesEachBusyCycleAsAProfilePoint) {
    VirtualClock clock;
    FakeExecutor inner(clock);
    const std::string path = TempPath("step_log.jsonl");
    Result<std::unique_ptr<StepLog>> log = StepLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status().message();
    StepLogExecutor executor(inner, **log, "mixed-0", clock);

    struct Step {
        std::vector<ScheduledSequence> sequences;
        double cost_s, gap_s;
    };
    const std::vector<Step> steps = {
        // a prefill chunk of seq 1 and a new 3-token prompt (seq 2), then 0.02 s of output stage
        {{Seq(1, 0, 8), Seq(2, 0, 3)}, 0.10, 0.02},
        // seq 1's next chunk and seq 2's first decode: continues -> step 1's cycle is 0.12 s
        {{Seq(1, 8, 4), Seq(2, 3, 1)}, 0.05, 0.01},
        // both decode
        {{Seq(1, 12, 1), Seq(2, 4, 1)}, 0.03, 2.0},
        // every sequence had finished and the engine slept 2 s: step 3's cycle is not written
        {{Seq(3, 0, 5)}, 0.04, 0.0},
    };
    for (const Step& s : steps) {
        StepPlan plan;
        plan.sequences = s.sequences;
        inner.cost_s = s.cost_s;
        ASSERT_TRUE(executor.Execute(plan).ok());
        clock.AdvanceSeconds(s.gap_s);
    }
    log->reset();  // closes the file

    Result<std::vector<sim::CpuProfilePoint>> points =
        sim::ParseCpuProfilePoints(testing::ReadFile(path), path);
    std::filesystem::remove(path);
    ASSERT_TRUE(points.ok()) << points.status().message();
    ASSERT_EQ(points->size(), 2u);
    EXPECT_EQ((*points)[0].prefill_tokens, 11);
    EXPECT_EQ((*points)[0].decode_seqs, 0);
    EXPECT_EQ((*points)[0].kv_tokens, 8 + 3);
    EXPECT_EQ((*points)[0].prefill_pairs, 8 * 9 / 2 + 3 * 4 / 2);
    EXPECT_NEAR((*points)[0].seconds, 0.12, 1e-9);
    EXPECT_EQ((*points)[1].prefill_tokens, 4);
    EXPECT_EQ((*points)[1].decode_seqs, 1);
    EXPECT_EQ((*points)[1].kv_tokens, 12 + 4);
    EXPECT_EQ((*points)[1].prefill_pairs, 4 * 8 + 4 * 5 / 2);  // the second chunk sees the first
    EXPECT_NEAR((*points)[1].seconds, 0.06, 1e-9);
}

TEST(StepLogTest, ProfileFittedFromAStepLogRecoversTheStepCost) {
    // A step log of mixed steps whose cycles follow
    // t = 0.01 + 0.002 p + 0.003 d + 1e-5 k + 1e-7 pairs.
    std::string text;
    for (int64_t p : {0, 16, 128, 512}) {
        for (int64_t d : {0, 1, 4, 16}) {
            if (p == 0 && d == 0) continue;
            // decodes at a short and a long context, so KV tokens vary apart from sequences;
            // chunks from scratch and after 400 cached tokens, so pairs vary apart from tokens
            const int64_t start = d % 2 == 1 ? 400 : 0;
            const int64_t pairs = p * start + p * (p + 1) / 2;
            const int64_t k = p + start + (d % 2 == 1 ? 700 : 100) * d;
            const double t = 0.01 + 0.002 * p + 0.003 * d + 1e-5 * k + 1e-7 * pairs;
            text += StepLogLine({.instance = "mixed-0",
                                 .shape = {.prefill_tokens = p,
                                           .decode_seqs = d,
                                           .kv_tokens = k,
                                           .prefill_pairs = pairs},
                                 .seconds = t,
                                 .execute_seconds = t * 0.9}) +
                    "\n";
        }
    }
    Result<std::vector<sim::CpuProfilePoint>> points =
        sim::ParseCpuProfilePoints(text, "steps.jsonl");
    ASSERT_TRUE(points.ok()) << points.status().message();
    Result<sim::CpuProfile> fit = sim::FitCpuProfile(*points);
    ASSERT_TRUE(fit.ok()) << fit.status().message();
    EXPECT_NEAR(fit->a, 0.01, 1e-6);
    EXPECT_NEAR(fit->b, 0.002, 1e-8);
    EXPECT_NEAR(fit->c, 0.003, 1e-8);
    EXPECT_NEAR(fit->d, 1e-5, 1e-9);
    EXPECT_NEAR(fit->e, 1e-7, 1e-11);
}

}  // namespace
}  // namespace kvshard
