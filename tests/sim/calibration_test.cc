// What validating the simulator against the CPU server rests on (docs/simulate.md, "Against
// this machine"): `kvshard bench --trace-out` writes a trace the simulator reads back as the
// same requests, and `kvshard serve --step-log` writes serving steps the CPU profile fits.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/clock.h"
#include "coordinator/step_log.h"
#include "loadgen/bench_report.h"
#include "loadgen/trace_file.h"
#include "sim/cost_model.h"
#include "sim/workload.h"
#include "tests/sim/sim_test_util.h"
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

TEST(BenchTraceTest, EachLineCarriesWhatTheClientMeasured) {
    std::vector<loadgen::BenchPrompt> prompts(2);
    loadgen::BenchRun run;
    run.outcomes = {Completed(0.0, 40, 4), Completed(0.3, 12, 1)};
    run.outcomes[0].ttft_s = 0.125;
    run.outcomes[0].e2e_s = 0.2;
    run.outcomes[0].itl_s = {0.03, 0.02, 0.025};
    run.outcomes[1].ttft_s = 0.05;
    run.outcomes[1].e2e_s = 0.05;  // one chunk: no gap
    const loadgen::TokenCounter count = [](const std::string&, bool) { return Result<int64_t>(1); };
    Result<std::vector<loadgen::TraceLineFields>> trace = loadgen::MakeTrace(prompts, run, count);
    ASSERT_TRUE(trace.ok()) << trace.status().message();
    ASSERT_EQ(trace->size(), 2u);
    const nlohmann::json first = nlohmann::json::parse(loadgen::TraceLine((*trace)[0]));
    EXPECT_NEAR(first.at("ttft_ms").get<double>(), 125.0, 1e-9);
    EXPECT_NEAR(first.at("e2el_ms").get<double>(), 200.0, 1e-9);
    EXPECT_NEAR(first.at("itl_median_ms").get<double>(), 25.0, 1e-9);
    // Every gap in the order received, for a bootstrap over tokens.
    const std::vector<double> gaps = first.at("itl_ms").get<std::vector<double>>();
    ASSERT_EQ(gaps.size(), 3u);
    EXPECT_NEAR(gaps[0], 30.0, 1e-9);
    EXPECT_NEAR(gaps[1], 20.0, 1e-9);
    EXPECT_NEAR(gaps[2], 25.0, 1e-9);
    const nlohmann::json second = nlohmann::json::parse(loadgen::TraceLine((*trace)[1]));
    EXPECT_NEAR(second.at("ttft_ms").get<double>(), 50.0, 1e-9);
    EXPECT_FALSE(second.contains("itl_median_ms"));
    EXPECT_FALSE(second.contains("itl_ms"));
}

TEST(BenchTraceTest, SimulatorsPerRequestLinesAnswerTheTracesLines) {
    // A trace as bench writes it (sorted by arrival); the simulator's line i is the trace's line i.
    const std::string trace_path = TempPath("per_request.trace.jsonl");
    std::vector<loadgen::TraceLineFields> lines;
    for (int i = 0; i < 6; ++i) {
        lines.push_back({.arrival_s = 0.02 * i, .prompt_len = 100 + 60 * i, .output_len = 3 + i,
                         .ttft_ms = 99, .e2el_ms = 199, .itl_median_ms = 9});
    }
    ASSERT_TRUE(loadgen::WriteTraceFile(trace_path, lines).ok());
    Result<std::vector<sim::SimRequest>> requests = sim::ReadTrace(trace_path);
    std::filesystem::remove(trace_path);
    ASSERT_TRUE(requests.ok()) << requests.status().message();
    Result<sim::SimulationResult> r = sim::Simulate(sim::OneH200Instance(512), *requests);
    ASSERT_TRUE(r.ok()) << r.status().ToString();

    const std::string path = TempPath("per_request.jsonl");
    ASSERT_TRUE(loadgen::WritePerRequestFile(path, r->run.outcomes).ok());
    const std::string text = testing::ReadFile(path);
    std::filesystem::remove(path);
    std::vector<nlohmann::json> got;
    size_t begin = 0;
    for (size_t end; (end = text.find('\n', begin)) != std::string::npos; begin = end + 1)
        got.push_back(nlohmann::json::parse(text.substr(begin, end - begin)));
    ASSERT_EQ(got.size(), lines.size());
    for (size_t i = 0; i < lines.size(); ++i) {
        const loadgen::RequestOutcome& o = r->run.outcomes[i];
        EXPECT_EQ(got[i].at("request").get<size_t>(), i);
        EXPECT_NEAR(got[i].at("arrival_s").get<double>(), lines[i].arrival_s, 1e-9) << i;
        EXPECT_EQ(got[i].at("prompt_len").get<int64_t>(), lines[i].prompt_len) << i;
        EXPECT_EQ(got[i].at("output_len").get<int64_t>(), lines[i].output_len) << i;
        EXPECT_TRUE(got[i].at("ok").get<bool>());
        EXPECT_NEAR(got[i].at("ttft_ms").get<double>(), 1000 * o.ttft_s, 1e-9) << i;
        EXPECT_NEAR(got[i].at("e2el_ms").get<double>(), 1000 * o.e2e_s, 1e-9) << i;
        EXPECT_NEAR(got[i].at("itl_median_ms").get<double>(),
                    1000 * loadgen::Summarize(o.itl_s).median, 1e-9)
            << i;
        const std::vector<double> gaps = got[i].at("itl_ms").get<std::vector<double>>();
        ASSERT_EQ(gaps.size(), o.itl_s.size()) << i;
        for (size_t g = 0; g < gaps.size(); ++g) EXPECT_NEAR(gaps[g], 1000 * o.itl_s[g], 1e-9) << i;
    }
    EXPECT_FALSE(loadgen::WritePerRequestFile("/nonexistent-dir/x.jsonl", {}).ok());
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

    const std::string text = testing::ReadFile(path);
    Result<std::vector<sim::CpuProfilePoint>> points = sim::ParseCpuProfilePoints(text, path);
    std::filesystem::remove(path);
    ASSERT_TRUE(points.ok()) << points.status().message();
    ASSERT_EQ(points->size(), 2u);
    // Each line says when its step started on the log's clock (here the virtual one, from 0).
    const size_t newline = text.find('\n');
    ASSERT_NE(newline, std::string::npos);
    EXPECT_NEAR(nlohmann::json::parse(text.substr(0, newline)).at("start_clock_s").get<double>(),
                0.0, 1e-9);
    EXPECT_NEAR(nlohmann::json::parse(text.substr(newline + 1, text.find('\n', newline + 1) -
                                                                   newline - 1))
                    .at("start_clock_s")
                    .get<double>(),
                0.12, 1e-9);
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
