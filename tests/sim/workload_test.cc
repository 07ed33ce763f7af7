// Workload generators: arrival statistics over many samples, the dataset rules of loadgen, shared
// prefixes in token ids, and trace-file parsing with its errors.
#include "sim/workload.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tests/test_util.h"

namespace kvshard::sim {
namespace {

struct Moments {
    double mean = 0;
    double variance = 0;
};

Moments GapMoments(const std::vector<double>& arrivals) {
    std::vector<double> gaps;
    double previous = 0;
    for (double a : arrivals) {
        gaps.push_back(a - previous);
        previous = a;
    }
    Moments m;
    for (double g : gaps) m.mean += g;
    m.mean /= static_cast<double>(gaps.size());
    for (double g : gaps) m.variance += (g - m.mean) * (g - m.mean);
    m.variance /= static_cast<double>(gaps.size() - 1);
    return m;
}

// Options by assignment: GCC 12 warns on designated initializers that leave out `arrivals`.
DatasetWorkload Dataset(DatasetKind kind, int64_t num_requests, int64_t input_len,
                        int64_t output_len) {
    DatasetWorkload w;
    w.kind = kind;
    w.num_requests = num_requests;
    w.input_len = input_len;
    w.output_len = output_len;
    return w;
}

TEST(WorkloadTest, PoissonMeanInterArrivalWithinFivePercent) {
    // Standard error of the mean over 20k exponential gaps: 1/sqrt(20000) = 0.7% of the mean.
    for (uint64_t seed : {0, 1, 42}) {
        Result<std::vector<double>> a =
            MakeArrivals({.kind = ArrivalSpec::Kind::kPoisson, .rate = 4.0}, 20000, seed);
        ASSERT_TRUE(a.ok());
        ASSERT_TRUE(std::is_sorted(a->begin(), a->end()));
        const Moments m = GapMoments(*a);
        EXPECT_NEAR(m.mean, 0.25, 0.05 * 0.25) << seed;
        EXPECT_NEAR(m.variance, 0.0625, 0.1 * 0.0625) << seed;  // exponential: variance = mean^2
    }
}

TEST(WorkloadTest, BurstyGammaKeepsTheMeanAndScalesTheVariance) {
    // Gamma gaps with shape k, mean 1/rate: variance = mean^2 / k.
    for (double burstiness : {0.5, 1.0, 4.0}) {
        Result<std::vector<double>> a = MakeArrivals(
            {.kind = ArrivalSpec::Kind::kBursty, .rate = 10.0, .burstiness = burstiness}, 20000, 7);
        ASSERT_TRUE(a.ok());
        const Moments m = GapMoments(*a);
        EXPECT_NEAR(m.mean, 0.1, 0.05 * 0.1) << burstiness;
        EXPECT_NEAR(m.variance, 0.01 / burstiness, 0.15 * 0.01 / burstiness) << burstiness;
    }
    EXPECT_FALSE(
        MakeArrivals({.kind = ArrivalSpec::Kind::kBursty, .rate = 1, .burstiness = 0}, 3, 0).ok());
    EXPECT_FALSE(MakeArrivals({.kind = ArrivalSpec::Kind::kPoisson, .rate = 0}, 3, 0).ok());
    Result<std::vector<double>> inf = MakeArrivals({.kind = ArrivalSpec::Kind::kInfinite}, 5, 0);
    EXPECT_EQ(*inf, std::vector<double>(5, 0.0));
    EXPECT_EQ(*ParseArrivalKind("inf"), ArrivalSpec::Kind::kInfinite);
    EXPECT_FALSE(ParseArrivalKind("uniform").ok());
}

TEST(WorkloadTest, SeededAndDeterministic) {
    DatasetWorkload w = Dataset(DatasetKind::kChat, 200, 256, 128);
    w.seed = 3;
    EXPECT_EQ(*MakeWorkload(w), *MakeWorkload(w));
    DatasetWorkload other = w;
    other.seed = 4;
    EXPECT_NE(*MakeWorkload(w), *MakeWorkload(other));
}

TEST(WorkloadTest, LengthDistributions) {
    std::mt19937_64 rng(1);
    EXPECT_EQ(LengthDist::Fixed(7).Sample(rng), 7);
    const LengthDist u = LengthDist::Uniform(10, 20);
    int64_t lo = 100, hi = 0;
    for (int i = 0; i < 2000; ++i) {
        const int64_t v = u.Sample(rng);
        lo = std::min(lo, v);
        hi = std::max(hi, v);
    }
    EXPECT_EQ(lo, 10);
    EXPECT_EQ(hi, 20);
    // A log-normal given by its mean: the sample mean is within 5% (sigma 0.5, 20k samples).
    const LengthDist mean = LengthDist::LogNormalMean(500, 0.5, 1, 1 << 30);
    ASSERT_TRUE(mean.Validate("x").ok());
    double sum = 0;
    for (int i = 0; i < 20000; ++i) sum += static_cast<double>(mean.Sample(rng));
    EXPECT_NEAR(sum / 20000, 500, 25);
    // Clipping.
    const LengthDist clipped = LengthDist::LogNormalMedian(100, 2.0, 50, 150);
    for (int i = 0; i < 1000; ++i) {
        const int64_t v = clipped.Sample(rng);
        EXPECT_GE(v, 50);
        EXPECT_LE(v, 150);
    }
    EXPECT_FALSE(LengthDist::Uniform(5, 4).Validate("prompt").ok());
    EXPECT_FALSE(LengthDist::Fixed(0).Validate("prompt").ok());
    LengthDist both = LengthDist::LogNormalMedian(100, 0.5, 1, 1000);
    both.mean = 100;
    EXPECT_FALSE(both.Validate("prompt").ok());
    LengthWorkload lw;
    lw.num_requests = 10;
    lw.prompt = LengthDist::Uniform(3, 9);
    lw.output = LengthDist::Fixed(5);
    Result<std::vector<SimRequest>> w = MakeWorkload(lw);
    ASSERT_TRUE(w.ok());
    for (const SimRequest& r : *w) {
        EXPECT_GE(r.prompt_len, 3);
        EXPECT_LE(r.prompt_len, 9);
        EXPECT_EQ(r.output_len, 5);
    }
}

// loadgen/dataset.h's rules, in tokens.
TEST(WorkloadTest, DatasetsFollowLoadgenRules) {
    Result<std::vector<SimRequest>> fixed =
        MakeWorkload(Dataset(DatasetKind::kRandom, 50, 300, 40));
    ASSERT_TRUE(fixed.ok());
    for (const SimRequest& r : *fixed) {
        EXPECT_EQ(r.prompt_len, 300);
        EXPECT_EQ(r.output_len, 40);
        EXPECT_EQ(r.prefix_group, -1);
    }
    DatasetWorkload ranged_options = Dataset(DatasetKind::kRandom, 500, 100, 10);
    ranged_options.range_ratio = 0.5;
    Result<std::vector<SimRequest>> ranged = MakeWorkload(ranged_options);
    for (const SimRequest& r : *ranged) {
        EXPECT_GE(r.prompt_len, 50);
        EXPECT_LE(r.prompt_len, 150);
        EXPECT_GE(r.output_len, 5);
        EXPECT_LE(r.output_len, 15);
    }
    DatasetWorkload shared_options = Dataset(DatasetKind::kSharedPrefix, 10, 0, 8);
    shared_options.num_groups = 3;
    shared_options.prefix_len = 512;
    shared_options.suffix_len = 32;
    Result<std::vector<SimRequest>> shared = MakeWorkload(shared_options);
    ASSERT_TRUE(shared.ok());
    for (size_t i = 0; i < shared->size(); ++i) {
        EXPECT_EQ((*shared)[i].prefix_group, static_cast<int64_t>(i % 3));
        EXPECT_EQ((*shared)[i].prefix_len, 512);
        EXPECT_EQ((*shared)[i].prompt_len, 544);
    }
    Result<std::vector<SimRequest>> chat =
        MakeWorkload(Dataset(DatasetKind::kChat, 4000, 200, 100));
    ASSERT_TRUE(chat.ok());
    std::vector<int64_t> prompts;
    for (const SimRequest& r : *chat) {
        EXPECT_GE(r.prompt_len, 4);
        EXPECT_LE(r.prompt_len, 1600);
        EXPECT_GE(r.output_len, 1);
        EXPECT_LE(r.output_len, 800);
        prompts.push_back(r.prompt_len);
    }
    std::nth_element(prompts.begin(), prompts.begin() + 2000, prompts.end());
    EXPECT_NEAR(static_cast<double>(prompts[2000]), 200, 20);  // the median
    DatasetWorkload bad_ratio = Dataset(DatasetKind::kRandom, 10, 10, 10);
    bad_ratio.range_ratio = 1.0;
    EXPECT_FALSE(MakeWorkload(bad_ratio).ok());
    DatasetWorkload no_groups = Dataset(DatasetKind::kSharedPrefix, 10, 10, 10);
    no_groups.num_groups = 0;
    EXPECT_FALSE(MakeWorkload(no_groups).ok());
    EXPECT_FALSE(MakeWorkload(Dataset(DatasetKind::kChat, 10, 0, 10)).ok());
    EXPECT_EQ(*ParseDatasetKind("shared-prefix"), DatasetKind::kSharedPrefix);
    EXPECT_FALSE(ParseDatasetKind("sharegpt").ok());
}

TEST(WorkloadTest, PromptTokensShareExactlyTheGroupPrefix) {
    const SimRequest a{.prompt_len = 600, .output_len = 1, .prefix_group = 2, .prefix_len = 512};
    const SimRequest b = a;
    const SimRequest other_group{
        .prompt_len = 600, .output_len = 1, .prefix_group = 3, .prefix_len = 512};
    const int64_t vocab = 128256;
    const std::vector<int32_t> ta = PromptTokens(a, vocab, 11);
    const std::vector<int32_t> tb = PromptTokens(b, vocab, 12);
    const std::vector<int32_t> tc = PromptTokens(other_group, vocab, 11);
    ASSERT_EQ(ta.size(), 600u);
    EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 512, tb.begin()));
    int differing = 0;
    for (size_t i = 512; i < 600; ++i) differing += ta[i] != tb[i];
    EXPECT_GE(differing, 85);  // independent draws from 128k ids
    EXPECT_NE(ta[512], tb[512]);
    int same_prefix = 0;
    for (size_t i = 0; i < 512; ++i) same_prefix += ta[i] == tc[i];
    EXPECT_LE(same_prefix, 3);
    for (int32_t id : ta) {
        EXPECT_GE(id, 0);
        EXPECT_LT(id, vocab);
    }
    EXPECT_EQ(PromptTokens(a, vocab, 11), ta);  // deterministic
    const SimRequest alone{.prompt_len = 64, .output_len = 1};
    EXPECT_NE(PromptTokens(alone, vocab, 1), PromptTokens(alone, vocab, 2));
}

TEST(WorkloadTest, ParsesTracesWithAliases) {
    const std::string text =
        "{\"arrival_s\": 1.5, \"prompt_len\": 100, \"output_len\": 10}\n"
        "\n"
        "{\"timestamp\": 0.5, \"input_length\": 200, \"output_length\": 20, \"prefix_group\": 1, "
        "\"prefix_len\": 64}\n";
    Result<std::vector<SimRequest>> t = ParseTrace(text, "t.jsonl");
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_EQ(t->size(), 2u);
    EXPECT_EQ((*t)[0], (SimRequest{.arrival_s = 0.5,
                                   .prompt_len = 200,
                                   .output_len = 20,
                                   .prefix_group = 1,
                                   .prefix_len = 64}));
    EXPECT_EQ((*t)[1], (SimRequest{.arrival_s = 1.5, .prompt_len = 100, .output_len = 10}));
}

TEST(WorkloadTest, TraceErrorsNameFileLineAndField) {
    const struct {
        const char* text;
        const char* message;
    } cases[] = {
        {"{\"prompt_len\": 1, \"output_len\": 1}",
         "t.jsonl:1: field 'arrival_s': missing (or 'timestamp')"},
        {"{\"arrival_s\": 0, \"prompt_len\": 1, \"output_len\": 1}\n{\"arrival_s\": 1, "
         "\"output_len\": 1}",
         "t.jsonl:2: field 'prompt_len': missing"},
        {"{\"arrival_s\": 0, \"prompt_len\": \"long\", \"output_len\": 1}",
         "t.jsonl:1: field 'prompt_len': expected an integer, got \"long\""},
        {"{\"arrival_s\": 0, \"prompt_len\": 10, \"output_len\": 0}",
         "t.jsonl:1: field 'output_len': must be >= 1, got 0"},
        {"{\"arrival_s\": -1, \"prompt_len\": 10, \"output_len\": 1}",
         "t.jsonl:1: field 'arrival_s': expected seconds >= 0, got -1"},
        {"{\"arrival_s\": 0, \"prompt_len\": 10, \"output_len\": 1, \"prefix_group\": 0, "
         "\"prefix_len\": 11}",
         "t.jsonl:1: field 'prefix_len': 11 exceeds prompt_len 10"},
        {"\n\n{\"arrival_s\": 0,", "t.jsonl:3: not valid JSON"},
        {"[1, 2]", "t.jsonl:1: expected a JSON object"},
    };
    for (const auto& c : cases) {
        Result<std::vector<SimRequest>> t = ParseTrace(c.text, "t.jsonl");
        ASSERT_FALSE(t.ok()) << c.text;
        EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
        EXPECT_EQ(t.status().message(), c.message) << c.text;
    }
    testing::TempDir dir;
    testing::WriteFile(dir.File("t.jsonl"),
                       "{\"arrival_s\": 0, \"prompt_len\": 3, \"output_len\": 2}\n");
    Result<std::vector<SimRequest>> ok = ReadTrace(dir.File("t.jsonl"));
    ASSERT_TRUE(ok.ok()) << ok.status().ToString();
    EXPECT_EQ(ok->size(), 1u);
    EXPECT_EQ(ReadTrace(dir.File("none.jsonl")).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvshard::sim
