// TopLogprobs (worker/sampler.h) against the full row it replaces in StepRunner::SampleRow: every
// id's logit - log_sum, sorted highest first with ties to the lower id, cut to k.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "worker/prompt_logprobs.h"
#include "worker/sampler.h"

namespace kvshard {
namespace {

std::vector<TokenLogprob> FullSortTopK(const std::vector<float>& logits, float log_sum,
                                       int64_t k) {
    std::vector<float> row(logits.size());
    for (size_t i = 0; i < logits.size(); ++i) row[i] = logits[i] - log_sum;
    std::vector<int32_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    std::vector<TokenLogprob> out;
    for (int64_t i = 0; i < k; ++i) out.push_back({ids[i], row[ids[i]]});
    return out;
}

// Logits drawn from `levels` distinct values, so that many ids tie (a quantized model's rows do).
std::vector<float> TiedLogits(int64_t vocab, int levels, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> level(0, levels - 1);
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (float& x : logits) x = -8.0f + 0.37f * static_cast<float>(level(rng));
    return logits;
}

TEST(TopLogprobsTest, EqualsTheFullSortWithTiesToTheLowerId) {
    for (const int64_t vocab : {1, 7, 64, 49152}) {
        for (const int levels : {1, 3, 40, 100000}) {
            const std::vector<float> logits =
                TiedLogits(vocab, levels, static_cast<uint32_t>(vocab * 31 + levels));
            const float log_sum = LogSumExp(logits.data(), vocab);
            for (const int64_t k : {0, 1, 2, 5, 20}) {
                if (k > vocab) continue;
                const std::vector<TokenLogprob> got =
                    TopLogprobs(logits.data(), vocab, log_sum, k);
                EXPECT_EQ(got, FullSortTopK(logits, log_sum, k))
                    << "vocab " << vocab << " levels " << levels << " k " << k;
            }
        }
    }
}

TEST(TopLogprobsTest, KeepsBitForBitValuesAndSkipsMaskedTokens) {
    std::vector<float> logits = TiedLogits(1000, 100000, 7);
    const float inf = std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < logits.size(); i += 3) logits[i] = -inf;  // a banned third
    logits[500] = 1e6f;  // above every level
    const float log_sum = LogSumExp(logits.data(), 1000);
    const std::vector<TokenLogprob> got = TopLogprobs(logits.data(), 1000, log_sum, 20);
    ASSERT_EQ(got.size(), 20u);
    EXPECT_EQ(got[0].token_id, 500);
    for (const TokenLogprob& t : got) {
        EXPECT_NE(t.token_id % 3, 0) << "a -inf logit ranked among the top 20";
        EXPECT_EQ(t.logprob, logits[static_cast<size_t>(t.token_id)] - log_sum);
    }
    EXPECT_EQ(got, FullSortTopK(logits, log_sum, 20));
}

TEST(TopLogprobsTest, KAsLargeAsTheVocabularyRanksEveryId) {
    const std::vector<float> logits = TiedLogits(50, 4, 3);
    const float log_sum = LogSumExp(logits.data(), 50);
    EXPECT_EQ(TopLogprobs(logits.data(), 50, log_sum, 50), FullSortTopK(logits, log_sum, 50));
}

}  // namespace
}  // namespace kvshard
