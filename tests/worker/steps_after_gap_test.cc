// MeasureStepsAfterGap (worker/steps_after_gap.h): a figure per gap kind with a time per
// position, and the decoding sequence's tokens unchanged by what ran between its rounds (another
// sequence's prefill must not touch its KV), at tp 1 and tp 2 alike.
#include "worker/steps_after_gap.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "model/model_file.h"
#include "tests/test_util.h"
#include "worker/local_model.h"
#include "worker/model_runner.h"
#include "worker/tp_group.h"

namespace kvshard {
namespace {

using testing::SharedModel;

StepsAfterGapConfig SmallConfig() {
    return {.context = 40,
            .steps = 6,
            .gaps = {StepGap::kPrefill, StepGap::kNone, StepGap::kIdle, StepGap::kEvict,
                     StepGap::kWarm},
            .prefill_tokens = 50,
            .idle_ms = 1,
            .evict_bytes = int64_t{1} << 20,
            .repeats = 3};
}

RunnerOptions OptionsFor(const StepsAfterGapConfig& c) {
    return {.max_context = StepsAfterGapTokensPerSequence(c),
            .num_kv_blocks = 2 * ((StepsAfterGapTokensPerSequence(c) + 15) / 16),
            .block_size = 16};
}

TEST(StepGapNames, RoundTripAndRefuse) {
    for (StepGap g : {StepGap::kNone, StepGap::kPrefill, StepGap::kIdle, StepGap::kSpin,
                      StepGap::kWarm, StepGap::kEvict}) {
        Result<StepGap> parsed = ParseStepGap(StepGapName(g));
        ASSERT_TRUE(parsed.ok());
        EXPECT_EQ(*parsed, g);
    }
    Result<StepGap> bad = ParseStepGap("nap");
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("'nap'"), std::string::npos);
}

TEST(StepsAfterGap, SameTokensAfterEveryGapAtTp1And2) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    const StepsAfterGapConfig c = SmallConfig();
    Result<std::unique_ptr<ModelRunner>> runner = MakeModelRunner(**file, {}, OptionsFor(c));
    ASSERT_TRUE(runner.ok()) << runner.status().ToString();
    Result<std::vector<StepPositionFigures>> one = MeasureStepsAfterGap(**runner, c);
    ASSERT_TRUE(one.ok()) << one.status().ToString();
    ASSERT_EQ(one->size(), c.gaps.size());
    for (size_t i = 0; i < one->size(); ++i) {
        const StepPositionFigures& f = (*one)[i];
        EXPECT_EQ(f.gap, c.gaps[i]);
        ASSERT_EQ(f.step_ms.size(), static_cast<size_t>(c.steps));
        ASSERT_EQ(f.minor_faults.size(), static_cast<size_t>(c.steps));
        for (double ms : f.step_ms) EXPECT_GT(ms, 0.0);
        ASSERT_EQ(f.tokens.size(), static_cast<size_t>(c.steps));
        EXPECT_EQ(f.tokens, one->front().tokens) << StepGapName(f.gap);
    }
    // The prefill gap computes 50 tokens; the idle gap sleeps at least its millisecond.
    EXPECT_GT((*one)[0].gap_ms, 0.0);
    EXPECT_GE((*one)[2].gap_ms, 1.0);

    Result<std::unique_ptr<TpGroup>> group =
        TpGroup::Create(**file, {.tp = 2, .runner = OptionsFor(c)});
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    Result<std::vector<StepPositionFigures>> two = MeasureStepsAfterGap(**group, c);
    ASSERT_TRUE(two.ok()) << two.status().ToString();
    ASSERT_EQ(two->size(), c.gaps.size());
    EXPECT_EQ(two->front().tokens, one->front().tokens);
}

TEST(StepsAfterGap, RefusesWhatTheRunnerCannotHold) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    StepsAfterGapConfig c = SmallConfig();
    RunnerOptions small = OptionsFor(c);
    small.num_kv_blocks = 1;
    Result<std::unique_ptr<ModelRunner>> runner = MakeModelRunner(**file, {}, small);
    ASSERT_TRUE(runner.ok()) << runner.status().ToString();
    Result<std::vector<StepPositionFigures>> r = MeasureStepsAfterGap(**runner, c);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("cannot hold"), std::string::npos) << r.status().message();

    c.prefill_tokens = 1000;  // past max_context
    r = MeasureStepsAfterGap(**runner, c);
    EXPECT_NE(r.status().message().find("exceed the context"), std::string::npos)
        << r.status().message();
    c = SmallConfig();
    c.steps = 0;
    EXPECT_EQ(MeasureStepsAfterGap(**runner, c).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvshard
