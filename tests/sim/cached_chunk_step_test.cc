// The CPU profile's fourth kind of step, "cached" (sim/cpu_profile.h StepKind): a step holding
// a prefill chunk that starts after a context (start_pos > 0) its sequence did not compute in the
// previous step, i.e. a suffix after a prefix-cache hit; a prompt's next chunk, which follows its
// previous one, is not. The step log (through StepLogExecutor) and the simulator's cost model
// must classify the same plans alike, and the kind's median correction must reach such steps when
// they run slower than the linear terms say (docs/simulate.md, runs N-P: 1.15-1.26x).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/clock.h"
#include "coordinator/step_log.h"
#include "sim/cost_model.h"
#include "sim/cpu_profile.h"
#include "tests/sim/sim_test_util.h"
#include "tests/test_util.h"

namespace kvshard::sim {
namespace {

struct Chunk {
    int64_t start_pos;
    int64_t num_tokens;
    int64_t seq_id = -1;  // -1: its index in the plan
};

StepPlan Plan(const std::vector<Chunk>& chunks) {
    StepPlan plan;
    int64_t id = 0;
    for (const Chunk& c : chunks) {
        ScheduledSequence s;
        s.seq_id = c.seq_id >= 0 ? c.seq_id : id;
        ++id;
        s.start_pos = c.start_pos;
        s.token_ids.assign(static_cast<size_t>(c.num_tokens), 1);
        plan.sequences.push_back(s);
    }
    return plan;
}

// The point a step log line of `plan` reads back as, after a step of `previous` (sorted ids).
CpuProfilePoint LoggedPoint(const StepPlan& plan, double seconds,
                            const std::vector<int64_t>& previous = {}) {
    const std::string line = StepLogLine(
        {.instance = "mixed-0", .shape = ShapeOfStep(plan, previous), .seconds = seconds});
    Result<std::vector<CpuProfilePoint>> points = ParseCpuProfilePoints(line, "steps.jsonl");
    KV_CHECK(points.ok() && points->size() == 1) << points.status().ToString();
    return points->front();
}

TEST(CachedChunkStepTest, KindOfAPoint) {
    EXPECT_EQ(KindOf({.prefill_tokens = 24, .decode_seqs = 0, .cached_chunks = 1}),
              StepKind::kCached);
    EXPECT_EQ(KindOf({.prefill_tokens = 24, .decode_seqs = 3, .cached_chunks = 1}),
              StepKind::kCached);
    EXPECT_EQ(KindOf({.prefill_tokens = 24, .decode_seqs = 0}), StepKind::kPrefill);
    EXPECT_EQ(KindOf({.prefill_tokens = 24, .decode_seqs = 3}), StepKind::kMixed);
    // A decode step is a decode step, whatever else the point says.
    EXPECT_EQ(KindOf({.prefill_tokens = 0, .decode_seqs = 3, .cached_chunks = 1}),
              StepKind::kDecode);
    EXPECT_EQ(StepKindName(StepKind::kCached), "cached");
}

// Every kind gets its own scale, and a = 1 s is the only term: the cost of a plan is its kind's
// scale, so the simulator's kind can be read off the cost and compared with the step log's.
TEST(CachedChunkStepTest, StepLogAndCostModelClassifyAPlanAlike) {
    CpuProfile profile{.a = 1.0};
    profile.kind_scale[static_cast<int>(StepKind::kDecode)] = 2;
    profile.kind_scale[static_cast<int>(StepKind::kPrefill)] = 3;
    profile.kind_scale[static_cast<int>(StepKind::kMixed)] = 5;
    profile.kind_scale[static_cast<int>(StepKind::kCached)] = 7;
    Result<CostModel> model =
        CostModel::CreateWithProfile(Config("llama-3-8b.json"), kv::WeightDtype::kBf16,
                                     KvDtype::kBf16, 1, *FindAccelerator("cpu"), profile);
    ASSERT_TRUE(model.ok()) << model.status().ToString();

    struct Case {
        const char* name;
        std::vector<Chunk> chunks;
        std::vector<int64_t> previous;  // the previous step's sequences
        StepKind kind;
        int64_t cached_chunks;
    };
    const Case cases[] = {
        {"decodes", {{399, 1}, {80, 1}}, {0, 1}, StepKind::kDecode, 0},
        {"prompt from scratch", {{0, 512}}, {}, StepKind::kPrefill, 0},
        {"prompt and decodes", {{0, 100}, {80, 1}}, {1}, StepKind::kMixed, 0},
        {"suffix after a cached prefix", {{400, 24}}, {}, StepKind::kCached, 1},
        {"suffix after a cached prefix, others before", {{400, 24}}, {3, 4}, StepKind::kCached, 1},
        {"suffix and decodes", {{400, 24}, {433, 1}, {80, 1}}, {1, 2}, StepKind::kCached, 1},
        {"a prompt's second chunk", {{512, 230}}, {0}, StepKind::kPrefill, 0},
        {"second chunk and decodes", {{512, 230}, {80, 1}}, {0, 1}, StepKind::kMixed, 0},
        {"second chunk and a suffix", {{512, 230}, {400, 24}}, {0}, StepKind::kCached, 1},
        {"two suffixes", {{400, 24}, {256, 30}}, {}, StepKind::kCached, 2},
        // One token after a context decodes; a one-token prompt from scratch is a prefill.
        {"one-token prompt", {{0, 1}}, {}, StepKind::kPrefill, 0},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.name);
        const StepPlan plan = Plan(c.chunks);
        const CpuProfilePoint logged = LoggedPoint(plan, 0.1, c.previous);
        EXPECT_EQ(logged.cached_chunks, c.cached_chunks);
        EXPECT_EQ(KindOf(logged), c.kind);
        EXPECT_DOUBLE_EQ(model->Cost(plan, Link::kIntraNode, c.previous).total_s,
                         profile.kind_scale[static_cast<int>(c.kind)]);
        EXPECT_DOUBLE_EQ(profile.Seconds(logged), profile.kind_scale[static_cast<int>(c.kind)]);
    }
}

// Runs each step in 10 ms of the virtual clock.
class TenMsExecutor : public StepExecutor {
  public:
    explicit TenMsExecutor(VirtualClock& clock) : clock_(clock) {}
    Result<StepResult> Execute(const StepPlan&) override {
        clock_.AdvanceSeconds(0.01);
        return StepResult{};
    }

  private:
    VirtualClock& clock_;
};

// Through the serving path: StepLogExecutor tells a prompt's next chunk (its sequence ran in the
// step before) from a suffix after a cached prefix (a sequence it has not just run).
TEST(CachedChunkStepTest, StepLogExecutorCountsChunksAfterACachedContext) {
    VirtualClock clock;
    TenMsExecutor inner(clock);
    const std::string path = ::testing::TempDir() + "cached_chunk_steps.jsonl";
    Result<std::unique_ptr<StepLog>> log = StepLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status().ToString();
    StepLogExecutor executor(inner, **log, "mixed-0", clock);
    const std::vector<std::vector<Chunk>> steps = {
        {{0, 512, 1}},                             // seq 1's first chunk
        {{512, 200, 1}},                           // its second chunk: not cached
        {{712, 1, 1}, {400, 24, 2}},               // seq 1 decodes; seq 2 hits the cache
        {{713, 1, 1}, {424, 1, 2}, {400, 24, 3}},  // decodes; seq 3 hits the cache
        {{714, 1, 1}, {425, 1, 2}, {424, 1, 3}},   // decodes (the last step is not written)
    };
    for (const auto& chunks : steps) ASSERT_TRUE(executor.Execute(Plan(chunks)).ok());
    log->reset();  // closes the file
    Result<std::vector<CpuProfilePoint>> points =
        ParseCpuProfilePoints(kvshard::testing::ReadFile(path), path);
    std::remove(path.c_str());
    ASSERT_TRUE(points.ok()) << points.status().ToString();
    ASSERT_EQ(points->size(), 4u);
    const StepKind kinds[] = {StepKind::kPrefill, StepKind::kPrefill, StepKind::kCached,
                              StepKind::kCached};
    const int64_t cached[] = {0, 0, 1, 1};
    for (size_t i = 0; i < 4; ++i) {
        SCOPED_TRACE("step " + std::to_string(i));
        EXPECT_EQ(KindOf((*points)[i]), kinds[i]);
        EXPECT_EQ((*points)[i].cached_chunks, cached[i]);
    }
}

// A synthetic calibration like validate-simulate's: mostly decode steps, whole prompts and their
// next chunks, a few suffixes after a cached prefix; every step is the true linear cost times
// exponential-tailed noise of median 1, and every step with a suffix after a cached prefix runs
// `slow` times that. The fit must predict each kind of step at its true median.

constexpr double kA = 2.5e-3, kB = 1.5e-3, kC = 2.6e-3, kD = 4e-6, kE = 8e-7;

double TrueLinear(const CpuProfilePoint& p) {
    return kA + kB * static_cast<double>(p.prefill_tokens) +
           kC * static_cast<double>(p.decode_seqs) + kD * static_cast<double>(p.kv_tokens) +
           kE * static_cast<double>(p.prefill_pairs);
}

std::vector<CpuProfilePoint> Calibration(double slow, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> unit(0, 1);
    std::uniform_int_distribution<int64_t> context(40, 900), prompt(20, 512), suffix(8, 48),
        cached(200, 450), seqs(1, 4);
    std::exponential_distribution<double> tail(1.0);
    std::vector<CpuProfilePoint> points;
    for (int i = 0; i < 1500; ++i) {
        std::vector<Chunk> chunks;
        std::vector<int64_t> previous;
        const double u = unit(rng);
        const int64_t decodes = u < 0.75 ? seqs(rng) : (unit(rng) < 0.5 ? 0 : seqs(rng));
        for (int64_t d = 0; d < decodes; ++d) chunks.push_back({context(rng), 1});
        if (u >= 0.75) {
            const double which = unit(rng);
            if (which < 0.6) {
                chunks.push_back({0, prompt(rng)});  // a whole prompt
            } else if (which < 0.8) {
                chunks.push_back({512, prompt(rng) / 2, 100});  // a prompt's second chunk
                previous = {100};                               // after its first
            } else {
                chunks.push_back({cached(rng), suffix(rng), 200});  // after a cached prefix
            }
        }
        if (chunks.empty()) continue;
        CpuProfilePoint p = LoggedPoint(Plan(chunks), 0, previous);
        const double noise = 1 + 0.15 * (tail(rng) - std::log(2.0));
        p.seconds = TrueLinear(p) * noise * (p.cached_chunks > 0 ? slow : 1.0);
        points.push_back(p);
    }
    return points;
}

TEST(CachedChunkStepTest, TheKindsCorrectionReachesSlowStepsAfterACachedPrefix) {
    const double slow = 1.24;
    const std::vector<CpuProfilePoint> points = Calibration(slow, 11);
    const auto cached = std::count_if(points.begin(), points.end(),
                                      [](const auto& p) { return KindOf(p) == StepKind::kCached; });
    ASSERT_GT(cached, 40);
    ASSERT_LT(cached, static_cast<long>(points.size()) / 10);  // a minority, as in serving
    Result<CpuProfile> fit = FitCpuProfile(points);
    ASSERT_TRUE(fit.ok()) << fit.status().ToString();
    EXPECT_EQ(fit->kind_points[static_cast<int>(StepKind::kCached)], cached);

    const CpuProfilePoint suffix = LoggedPoint(Plan({{400, 24}}), 0);
    const CpuProfilePoint suffix_and_decode = LoggedPoint(Plan({{400, 24}, {430, 1}}), 0);
    const CpuProfilePoint decode = LoggedPoint(Plan({{430, 1}, {200, 1}}), 0);
    const CpuProfilePoint prompt = LoggedPoint(Plan({{0, 300}}), 0);
    const CpuProfilePoint next_chunk = LoggedPoint(Plan({{512, 200, 100}}), 0, {100});
    EXPECT_NEAR(fit->Seconds(suffix) / (slow * TrueLinear(suffix)), 1.0, 0.05);
    EXPECT_NEAR(fit->Seconds(suffix_and_decode) / (slow * TrueLinear(suffix_and_decode)), 1.0,
                0.05);
    EXPECT_NEAR(fit->Seconds(decode) / TrueLinear(decode), 1.0, 0.04);
    EXPECT_NEAR(fit->Seconds(prompt) / TrueLinear(prompt), 1.0, 0.05);
    EXPECT_NEAR(fit->Seconds(next_chunk) / TrueLinear(next_chunk), 1.0, 0.05);

    // Without the kind (the same steps logged before cached_chunks existed) the linear terms
    // take up part of the slowdown (the pair term) and leave the suffix short of its median.
    std::vector<CpuProfilePoint> unmarked = points;
    for (CpuProfilePoint& p : unmarked) p.cached_chunks = 0;
    Result<CpuProfile> old_fit = FitCpuProfile(unmarked);
    ASSERT_TRUE(old_fit.ok()) << old_fit.status().ToString();
    CpuProfilePoint suffix_unmarked = suffix;
    suffix_unmarked.cached_chunks = 0;
    const double old_error = old_fit->Seconds(suffix_unmarked) / (slow * TrueLinear(suffix)) - 1;
    const double new_error = fit->Seconds(suffix) / (slow * TrueLinear(suffix)) - 1;
    EXPECT_LT(old_error, -0.04);
    EXPECT_LT(std::fabs(new_error), std::fabs(old_error) / 2);
}

// What runs N-P measured: a suffix after a cached prefix costs a constant more than the other
// terms say (6-8 ms whether it is 24 or 50 tokens), which a factor fitted on one suffix length
// cannot carry to another; the term per cached chunk (g) does.
TEST(CachedChunkStepTest, AConstantCostPerCachedChunkIsItsOwnTerm) {
    const double extra_s = 0.008;
    std::vector<CpuProfilePoint> points = Calibration(1.0, 7);
    for (CpuProfilePoint& p : points) p.seconds += extra_s * static_cast<double>(p.cached_chunks);
    Result<CpuProfile> fit = FitCpuProfile(points);
    ASSERT_TRUE(fit.ok()) << fit.status().ToString();
    EXPECT_NEAR(fit->g, extra_s, 0.25 * extra_s);
    for (const int64_t q : {24, 50}) {
        SCOPED_TRACE(std::to_string(q) + "-token suffix");
        const CpuProfilePoint suffix = LoggedPoint(Plan({{400, q}}), 0);
        EXPECT_NEAR(fit->Seconds(suffix) / (TrueLinear(suffix) + extra_s), 1.0, 0.04);
    }
}

// With no slowdown the kind's factor is 1 to within the noise: the kind adds no bias of its own.
TEST(CachedChunkStepTest, NoSlowdownGivesAFactorOfOne) {
    Result<CpuProfile> fit = FitCpuProfile(Calibration(1.0, 5));
    ASSERT_TRUE(fit.ok()) << fit.status().ToString();
    EXPECT_NEAR(fit->kind_scale[static_cast<int>(StepKind::kCached)], 1.0, 0.04);
}

}  // namespace
}  // namespace kvshard::sim
