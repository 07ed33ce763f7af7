#include "worker/prompt_logprobs.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvshard {

float LogSumExp(const float* logits, int64_t n) {
    float max_val = logits[0];
    for (int64_t i = 1; i < n; ++i) max_val = std::max(max_val, logits[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += std::exp(double(logits[i]) - max_val);
    return static_cast<float>(std::log(sum)) + max_val;
}

PromptTokenLogprob ScorePromptToken(const float* logits, int64_t vocab, int32_t target,
                                    int32_t top_k, std::vector<int32_t>* ids) {
    const float log_sum = LogSumExp(logits, vocab);
    const float mine = logits[target];
    PromptTokenLogprob out;
    out.token_id = target;
    out.logprob = mine - log_sum;
    out.rank = 1;
    for (int64_t i = 0; i < vocab; ++i) out.rank += logits[i] > mine ? 1 : 0;
    const int64_t k = std::min<int64_t>(top_k, vocab);
    if (k == 0) return out;
    ids->resize(static_cast<size_t>(vocab));
    std::iota(ids->begin(), ids->end(), 0);
    auto higher = [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    // O(vocab) to find the k best, then only they are sorted.
    std::nth_element(ids->begin(), ids->begin() + (k - 1), ids->end(), higher);
    std::sort(ids->begin(), ids->begin() + k, higher);
    out.top.reserve(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) {
        const int32_t id = (*ids)[static_cast<size_t>(i)];
        out.top.push_back({id, logits[id] - log_sum});
    }
    return out;
}

}  // namespace kvshard
