#include "worker/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace kvshard {
namespace {

// Logits whose softmax at temperature 1 is `probs`.
std::vector<float> LogitsOf(const std::vector<double>& probs) {
    std::vector<float> logits;
    for (double p : probs) logits.push_back(static_cast<float>(std::log(p)));
    return logits;
}

std::vector<int32_t> SampleMany(const SamplingParams& params, const std::vector<float>& logits,
                                int count) {
    Sampler sampler(params);
    std::vector<int32_t> tokens;
    for (int i = 0; i < count; ++i) {
        tokens.push_back(sampler.Sample(logits.data(), static_cast<int64_t>(logits.size())));
    }
    return tokens;
}

std::vector<double> Frequencies(const std::vector<int32_t>& tokens, size_t vocab) {
    std::vector<double> freq(vocab, 0.0);
    for (int32_t t : tokens) freq.at(t) += 1.0 / tokens.size();
    return freq;
}

// --- Argmax / greedy -----------------------------------------------------------------------------

struct ArgmaxCase {
    std::vector<float> values;
    int32_t expected;
};

class ArgmaxTest : public ::testing::TestWithParam<ArgmaxCase> {};

TEST_P(ArgmaxTest, PicksLargestLowestIndexOnTies) {
    const ArgmaxCase& c = GetParam();
    EXPECT_EQ(Sampler::Argmax(c.values.data(), static_cast<int64_t>(c.values.size())), c.expected);
    // Greedy sampling (temperature 0) is the argmax.
    Sampler greedy(SamplingParams{});
    EXPECT_EQ(greedy.Sample(c.values.data(), static_cast<int64_t>(c.values.size())), c.expected);
}

const float kInf = std::numeric_limits<float>::infinity();
INSTANTIATE_TEST_SUITE_P(Values, ArgmaxTest,
                         ::testing::Values(ArgmaxCase{{0.5f}, 0}, ArgmaxCase{{1.0f, 3.0f, 2.0f}, 1},
                                           ArgmaxCase{{-5.0f, -1.0f, -3.0f}, 1},
                                           ArgmaxCase{{2.0f, 7.0f, 7.0f, 1.0f}, 1},
                                           ArgmaxCase{{4.0f, 4.0f, 4.0f}, 0},
                                           ArgmaxCase{{-kInf, -kInf, 0.0f}, 2},
                                           ArgmaxCase{{1.0f, 2.0f, 3.0f, 9.0f}, 3}));

// --- RNG ----------------------------------------------------------------------------------------

TEST(XorShiftRngTest, FirstOutputsForSeed133742) {
    // From llama2.c's formula, computed independently in Python with 64-bit masking:
    //   s ^= s >> 12; s ^= (s << 25) & M; s ^= s >> 27; u32 = ((s * 0x2545F4914F6CDD1D) & M) >> 32
    // f32 = (u32 >> 8) / 2^24, exact in float.
    XorShiftRng rng(133742);
    const uint32_t expected_u32[] = {3033531262u, 2674377904u, 2312864567u, 2287415643u,
                                     1408443089u};
    for (uint32_t want : expected_u32) EXPECT_EQ(rng.NextU32(), want);

    XorShiftRng rng_f(133742);
    const uint32_t expected_f_numerators[] = {11849731u, 10446788u, 9034627u, 8935217u, 5501730u};
    for (uint32_t numerator : expected_f_numerators) {
        EXPECT_EQ(rng_f.NextF32(), static_cast<float>(numerator) / 16777216.0f);
    }
}

TEST(XorShiftRngTest, ZeroSeedIsNotStuckAtZero) {
    XorShiftRng rng(0);
    EXPECT_NE(rng.NextU32(), 0u);
    EXPECT_NE(rng.NextU32(), 0u);
}

// --- Temperature sampling, run.c's path ---------------------------------------------------------

const std::vector<double> kProbs = {0.1, 0.2, 0.3, 0.4};

TEST(SamplerTest, MultinomialFollowsTheCoinsOfSeed133742) {
    // Coins 0.70630, 0.62268, 0.53851, 0.53258, 0.32793 against the cdf 0.1, 0.3, 0.6, 1.0.
    SamplingParams params;
    params.temperature = 1.0f;
    params.seed = 133742;
    EXPECT_EQ(SampleMany(params, LogitsOf(kProbs), 5), (std::vector<int32_t>{3, 3, 2, 2, 2}));
}

TEST(SamplerTest, TopPFollowsTheCoinsOfSeed133742) {
    // top_p 0.8: sorted 0.4 (3), 0.3 (2), 0.2 (1); the cumulative 0.9 crosses 0.8 at token 1,
    // which is kept. r = coin · 0.9 against the cdf 0.4, 0.7, 0.9.
    SamplingParams params;
    params.temperature = 1.0f;
    params.top_p = 0.8f;
    params.seed = 133742;
    EXPECT_EQ(SampleMany(params, LogitsOf(kProbs), 5), (std::vector<int32_t>{2, 2, 2, 2, 3}));
}

TEST(SamplerTest, MatchesAnIndependentRunCReimplementation) {
    // 32 logits sin(0.7 i) · 3, seed 133742, 30 tokens. Expected sequences from a separate numpy
    // float32 reimplementation of run.c's sample() (softmax, sample_mult, sample_topp).
    std::vector<float> logits(32);
    for (int i = 0; i < 32; ++i) logits[i] = static_cast<float>(std::sin(i * 0.7) * 3.0);
    struct Case {
        float temperature, top_p;
        std::vector<int32_t> expected;
    };
    const Case cases[] = {
        {1.0f, 1.0f, {21, 20, 19, 19, 11, 29, 21, 2,  16, 21, 11, 11, 29, 20, 29,
                      3,  1,  11, 29, 1,  10, 10, 21, 19, 28, 1,  11, 20, 31, 11}},
        {0.8f, 0.9f, {12, 3,  2,  2,  11, 30, 12, 20, 2, 12, 11, 11, 30, 3,  30,
                      20, 29, 11, 28, 29, 11, 11, 12, 2, 21, 29, 11, 12, 10, 11}},
        {1.2f, 0.5f, {2,  2,  11, 11, 20, 12, 2,  29, 11, 2, 11, 20, 3, 2,  3,
                      29, 29, 11, 12, 29, 20, 20, 2,  11, 3, 29, 20, 2, 12, 11}},
    };
    for (const Case& c : cases) {
        SamplingParams params;
        params.temperature = c.temperature;
        params.top_p = c.top_p;
        params.seed = 133742;
        EXPECT_EQ(SampleMany(params, logits, 30), c.expected)
            << "temperature " << c.temperature << " top_p " << c.top_p;
    }
}

TEST(SamplerTest, TopPKeepsOnlyTheNucleus) {
    // top_p 0.5: 0.4 + 0.3 crosses it, so only tokens 3 and 2 remain, in proportion 4:3.
    SamplingParams params;
    params.temperature = 1.0f;
    params.top_p = 0.5f;
    params.seed = 7;
    const auto freq = Frequencies(SampleMany(params, LogitsOf(kProbs), 20000), 4);
    EXPECT_EQ(freq[0], 0.0);
    EXPECT_EQ(freq[1], 0.0);
    EXPECT_NEAR(freq[2], 3.0 / 7.0, 0.02);
    EXPECT_NEAR(freq[3], 4.0 / 7.0, 0.02);
}

TEST(SamplerTest, SameSeedSameSequenceOtherSeedOtherSequence) {
    std::mt19937 gen(1);
    std::normal_distribution<float> dist(0.0f, 2.0f);
    std::vector<float> logits(500);
    for (float& x : logits) x = dist(gen);
    SamplingParams params;
    params.temperature = 0.8f;
    params.top_p = 0.9f;
    params.seed = 42;
    const auto a = SampleMany(params, logits, 200);
    EXPECT_EQ(SampleMany(params, logits, 200), a);
    params.seed = 43;
    EXPECT_NE(SampleMany(params, logits, 200), a);
}

TEST(SamplerTest, LogitsAreNotModified) {
    const std::vector<float> logits = {1.0f, -2.0f, 0.5f, 3.0f};
    std::vector<float> copy = logits;
    SamplingParams params;
    params.temperature = 0.7f;
    params.top_k = 2;
    params.top_p = 0.9f;
    params.min_p = 0.1f;
    Sampler sampler(params);
    sampler.Sample(copy.data(), 4);
    EXPECT_EQ(copy, logits);
}

struct DistributionCase {
    const char* name;
    float temperature;
};

class SamplerDistributionTest : public ::testing::TestWithParam<DistributionCase> {};

TEST_P(SamplerDistributionTest, FrequenciesMatchSoftmaxWithin2Percent) {
    const float temperature = GetParam().temperature;
    SamplingParams params;
    params.temperature = temperature;
    params.seed = 2024;
    const auto logits = LogitsOf(kProbs);
    const auto freq = Frequencies(SampleMany(params, logits, 20000), 4);
    // softmax(log(p) / T) = p^(1/T) / Σ p^(1/T).
    double z = 0.0;
    for (double p : kProbs) z += std::pow(p, 1.0 / temperature);
    for (size_t i = 0; i < kProbs.size(); ++i) {
        EXPECT_NEAR(freq[i], std::pow(kProbs[i], 1.0 / temperature) / z, 0.02) << "token " << i;
    }
}

INSTANTIATE_TEST_SUITE_P(Temperatures, SamplerDistributionTest,
                         ::testing::Values(DistributionCase{"T1", 1.0f},
                                           DistributionCase{"T0_5", 0.5f},
                                           DistributionCase{"T2", 2.0f}),
                         [](const auto& info) { return std::string(info.param.name); });

// --- Filters: top-k, top-p, min-p ---------------------------------------------------------------

TEST(SamplerTest, TopK1AndTinyTopPAndMinP1AreGreedy) {
    std::mt19937 gen(3);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> logits(257);
    for (int trial = 0; trial < 20; ++trial) {
        for (float& x : logits) x = dist(gen);
        const int32_t greedy = Sampler::Argmax(logits.data(), 257);
        SamplingParams top_k;
        top_k.temperature = 1.5f;
        top_k.top_k = 1;
        top_k.seed = 100 + trial;
        SamplingParams top_p = top_k;
        top_p.top_k = 0;
        top_p.top_p = 1e-6f;
        SamplingParams min_p = top_p;
        min_p.top_p = 1.0f;
        min_p.min_p = 1.0f;
        for (const SamplingParams& params : {top_k, top_p, min_p}) {
            for (int32_t token : SampleMany(params, logits, 10)) EXPECT_EQ(token, greedy);
        }
    }
}

TEST(SamplerTest, TinyTopPBelowOneOverVocabIsGreedy) {
    // A flat-ish distribution where every probability is under run.c's cutoff (1 - top_p)/(n - 1).
    const std::vector<float> logits = {0.0f, 0.01f, 0.0f, 0.0f};
    SamplingParams params;
    params.temperature = 1.0f;
    params.top_p = 0.01f;
    for (int32_t token : SampleMany(params, logits, 50)) EXPECT_EQ(token, 1);
}

TEST(SamplerTest, TopKKeepsTheKHighestLogits) {
    // k = 2 keeps token 4 (0.4) and one of the tied 0.25s: the lower index, token 1.
    const std::vector<double> probs = {0.05, 0.25, 0.25, 0.05, 0.4};
    SamplingParams params;
    params.temperature = 1.0f;
    params.top_k = 2;
    params.seed = 11;
    const auto freq = Frequencies(SampleMany(params, LogitsOf(probs), 20000), 5);
    EXPECT_EQ(freq[0] + freq[2] + freq[3], 0.0);
    EXPECT_NEAR(freq[1], 0.25 / 0.65, 0.02);
    EXPECT_NEAR(freq[4], 0.4 / 0.65, 0.02);
}

TEST(SamplerTest, MinPDropsUnlikelyTokensAndRenormalizes) {
    // min_p 0.6: threshold 0.6 · 0.4 = 0.24, so 0.1 and 0.2 go; 0.3 and 0.4 remain as 3:4.
    SamplingParams params;
    params.temperature = 1.0f;
    params.min_p = 0.6f;
    params.seed = 5;
    const auto freq = Frequencies(SampleMany(params, LogitsOf(kProbs), 20000), 4);
    EXPECT_EQ(freq[0], 0.0);
    EXPECT_EQ(freq[1], 0.0);
    EXPECT_NEAR(freq[2], 3.0 / 7.0, 0.02);
    EXPECT_NEAR(freq[3], 4.0 / 7.0, 0.02);
}

TEST(SamplerTest, DisabledFiltersKeepRunCPath) {
    // top_k >= vocab and min_p = 0 change nothing: the same tokens as the plain run.c path.
    SamplingParams plain;
    plain.temperature = 0.9f;
    plain.top_p = 0.95f;
    plain.seed = 9;
    SamplingParams wide_k = plain;
    wide_k.top_k = 4;
    const auto logits = LogitsOf(kProbs);
    EXPECT_EQ(SampleMany(plain, logits, 100), SampleMany(wide_k, logits, 100));
}

TEST(SamplerTest, SingleTokenVocabulary) {
    const float logit = 1.0f;
    SamplingParams params;
    params.temperature = 1.0f;
    params.top_p = 0.5f;
    EXPECT_EQ(SampleMany(params, {logit}, 3), (std::vector<int32_t>{0, 0, 0}));
}

// --- Validation ---------------------------------------------------------------------------------

struct ValidationCase {
    const char* name;
    SamplingParams params;
    const char* field;  // nullptr: valid
};

SamplingParams With(float temperature, int top_k, float top_p, float min_p) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    return p;
}

// --- Logit controls ------------------------------------------------------------------------------

std::vector<float> Controlled(const SamplingParams& p, std::vector<float> logits,
                              const std::vector<int32_t>& history, int64_t prompt_tokens) {
    std::vector<int32_t> scratch;
    EXPECT_TRUE(ValidateLogitControls(p, history, prompt_tokens,
                                      static_cast<int64_t>(logits.size()))
                    .ok());
    ApplyLogitControls(p, history, prompt_tokens, logits.data(),
                       static_cast<int64_t>(logits.size()), &scratch);
    return logits;
}

TEST(LogitControlsTest, RepetitionPenaltyDividesPositiveAndMultipliesNegativeSeenLogits) {
    SamplingParams p;
    p.repetition_penalty = 2.0f;
    // Token 0 in the prompt, 1 in the output (twice), 2 never seen; 3 negative and seen.
    const auto out = Controlled(p, {4.0f, 3.0f, 5.0f, -1.0f}, {0, 3, 1, 1}, 2);
    EXPECT_EQ(out, (std::vector<float>{2.0f, 1.5f, 5.0f, -2.0f}));
}

TEST(LogitControlsTest, FrequencyAndPresencePenaltiesCountOnlyTheOutput) {
    SamplingParams p;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 1.0f;
    // Prompt: 0, 0, 0 (not penalized); output: 1 once, 2 three times.
    const auto out = Controlled(p, {1.0f, 1.0f, 1.0f, 1.0f}, {0, 0, 0, 1, 2, 2, 2}, 3);
    EXPECT_EQ(out, (std::vector<float>{1.0f, 1.0f - 0.5f - 1.0f, 1.0f - 1.5f - 1.0f, 1.0f}));
}

TEST(LogitControlsTest, LogitBiasAddsAndMinTokensBansStopTokensUntilReached) {
    SamplingParams p;
    p.logit_bias = {{1, 10.0f}, {3, -100.0f}};
    p.min_tokens = 2;
    p.min_tokens_banned_ids = {0};
    const float inf = std::numeric_limits<float>::infinity();
    // One output token so far: the ban holds.
    auto out = Controlled(p, {9.0f, 0.0f, 1.0f, 2.0f}, {5 % 4, 2}, 1);
    EXPECT_EQ(out, (std::vector<float>{-inf, 10.0f, 1.0f, -98.0f}));
    EXPECT_EQ(Sampler::Argmax(out.data(), 4), 1);
    // Two output tokens: token 0 may end the choice again.
    out = Controlled(p, {9.0f, 0.0f, 1.0f, 2.0f}, {1, 2, 2}, 1);
    EXPECT_EQ(out[0], 9.0f);
}

TEST(LogitControlsTest, GreedyWithoutControlsIsUnchangedAndControlsChangeTheChoice) {
    SamplingParams p;
    EXPECT_FALSE(HasLogitControls(p));
    p.presence_penalty = 2.0f;
    EXPECT_TRUE(HasLogitControls(p));
    // Token 2 leads by 1; already present in the output, it loses 2 and token 0 wins.
    const auto out = Controlled(p, {2.0f, 0.0f, 3.0f}, {1, 2}, 1);
    EXPECT_EQ(Sampler::Argmax(out.data(), 3), 0);
}

TEST(LogitControlsTest, ValidationNamesTheField) {
    auto message = [](const SamplingParams& p, std::vector<int32_t> history = {1},
                      int64_t prompt = 0) {
        return ValidateLogitControls(p, history, prompt, 4).message();
    };
    SamplingParams p;
    p.repetition_penalty = 0.0f;
    EXPECT_NE(message(p).find("repetition_penalty"), std::string::npos);
    p = {};
    p.presence_penalty = 3.0f;
    EXPECT_NE(message(p).find("presence_penalty"), std::string::npos);
    p = {};
    p.logit_bias = {{4, 1.0f}};
    EXPECT_NE(message(p).find("logit_bias"), std::string::npos);
    p.logit_bias = {{2, 1.0f}, {1, 1.0f}};
    EXPECT_NE(message(p).find("out of order"), std::string::npos);
    p = {};
    p.min_tokens = 3;
    p.min_tokens_banned_ids = {9};
    EXPECT_NE(message(p).find("min_tokens"), std::string::npos);
    p.min_tokens_banned_ids = {};
    EXPECT_NE(message(p, {}).find("history"), std::string::npos);
    EXPECT_NE(message(p, {1, 2}, 3).find("history_prompt_tokens"), std::string::npos);
    EXPECT_NE(message(p, {1, 7}, 1).find("token id 7"), std::string::npos);
    EXPECT_TRUE(ValidateLogitControls(p, std::vector<int32_t>{1, 2}, 1, 4).ok());
}

class ValidateSamplingParamsTest : public ::testing::TestWithParam<ValidationCase> {};

TEST_P(ValidateSamplingParamsTest, NamesTheBadField) {
    const ValidationCase& c = GetParam();
    const Status status = ValidateSamplingParams(c.params);
    if (c.field == nullptr) {
        EXPECT_TRUE(status.ok()) << status.ToString();
        return;
    }
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(c.field), std::string::npos) << status.message();
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();
INSTANTIATE_TEST_SUITE_P(
    Cases, ValidateSamplingParamsTest,
    ::testing::Values(ValidationCase{"Defaults", SamplingParams{}, nullptr},
                      ValidationCase{"AllOn", With(0.7f, 40, 0.9f, 0.05f), nullptr},
                      ValidationCase{"Edges", With(0.0f, 0, 1.0f, 1.0f), nullptr},
                      ValidationCase{"NegativeTemperature", With(-0.1f, 0, 1, 0), "temperature"},
                      ValidationCase{"InfiniteTemperature", With(kInf, 0, 1, 0), "temperature"},
                      ValidationCase{"NaNTemperature", With(kNaN, 0, 1, 0), "temperature"},
                      ValidationCase{"NegativeTopK", With(1, -1, 1, 0), "top_k"},
                      ValidationCase{"ZeroTopP", With(1, 0, 0.0f, 0), "top_p"},
                      ValidationCase{"TopPAboveOne", With(1, 0, 1.5f, 0), "top_p"},
                      ValidationCase{"NaNTopP", With(1, 0, kNaN, 0), "top_p"},
                      ValidationCase{"NegativeMinP", With(1, 0, 1, -0.1f), "min_p"},
                      ValidationCase{"MinPAboveOne", With(1, 0, 1, 1.01f), "min_p"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(TokenMaskTest, MaskedTokensAreNeverSampled) {
    // vocab 70: two words; allowed: 1 and 66 only.
    std::vector<uint64_t> allowed = {uint64_t{1} << 1, uint64_t{1} << 2};
    ASSERT_TRUE(ValidateTokenMask(allowed, 70).ok());
    std::vector<float> logits(70, 0.0f);
    logits[5] = 10.0f;  // the model's favourite is not allowed
    logits[66] = 1.0f;
    ApplyTokenMask(allowed, logits.data(), 70);
    EXPECT_EQ(Sampler::Argmax(logits.data(), 70), 66);
    Sampler random(SamplingParams{.temperature = 1.0f, .seed = 7});
    for (int i = 0; i < 200; ++i) {
        const int32_t id = random.Sample(logits.data(), 70);
        EXPECT_TRUE(id == 1 || id == 66) << id;
    }
    EXPECT_NE(ValidateTokenMask(std::vector<uint64_t>{1}, 70).message().find("allowed_tokens has 1 words"),
              std::string::npos);
    EXPECT_NE(ValidateTokenMask(std::vector<uint64_t>{0, uint64_t{1} << 6}, 70).message().find("beyond"),
              std::string::npos);
    EXPECT_NE(ValidateTokenMask(std::vector<uint64_t>{0, 0}, 70).message().find("allows no token"), std::string::npos);
    EXPECT_TRUE(ValidateTokenMask(std::vector<uint64_t>{}, 70).ok());
}

// The first index of the largest value, as a scan keeping the first strictly larger one finds it.
int32_t ScanArgmax(const std::vector<float>& v) {
    int64_t best = 0;
    for (size_t i = 1; i < v.size(); ++i) {
        if (v[i] > v[static_cast<size_t>(best)]) best = static_cast<int64_t>(i);
    }
    return static_cast<int32_t>(best);
}

TEST(SamplerTest, ArgmaxIsTheScansFirstLargest) {
    const float kNaN = std::numeric_limits<float>::quiet_NaN();
    const float kInf = std::numeric_limits<float>::infinity();
    std::mt19937 gen(3);
    std::uniform_int_distribution<int> small(-3, 3);  // many ties
    for (int64_t n : {1, 2, 15, 16, 17, 31, 33, 100, 49152}) {
        for (int trial = 0; trial < 20; ++trial) {
            std::vector<float> v(static_cast<size_t>(n));
            for (float& x : v) x = static_cast<float>(small(gen));
            const auto at = [&](int k) { return static_cast<size_t>(k % n); };
            if (trial % 4 == 1) v[at(trial * 7)] = kNaN;
            if (trial % 4 == 2) v[0] = kNaN;  // a NaN first wins everything
            if (trial % 5 == 3) {
                v[at(5)] = 3.0f;
                v[at(9)] = kInf;
                v[at(11)] = kInf;
            }
            if (trial % 6 == 4) {
                std::fill(v.begin(), v.end(), -1.0f);
                v[at(4)] = -0.0f;
                v[at(8)] = 0.0f;
            }
            EXPECT_EQ(Sampler::Argmax(v.data(), n), ScanArgmax(v)) << "n " << n << " trial " << trial;
        }
    }
}

}  // namespace
}  // namespace kvshard
