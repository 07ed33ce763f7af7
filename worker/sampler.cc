#include "worker/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/check.h"

namespace kvshard {
namespace {

// llama2.c's softmax: max-subtracted expf, a sequential float sum, then a division per element.
void SoftmaxLikeRunC(float* x, int64_t n) {
    float max_val = x[0];
    for (int64_t i = 1; i < n; ++i) {
        if (x[i] > max_val) max_val = x[i];
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        x[i] = std::exp(x[i] - max_val);
        sum += x[i];
    }
    for (int64_t i = 0; i < n; ++i) x[i] /= sum;
}

// llama2.c's sample_mult: the first index whose cumulative probability exceeds coin.
int32_t SampleMultinomial(const float* probs, int64_t n, float coin) {
    float cdf = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        cdf += probs[i];
        if (coin < cdf) return static_cast<int32_t>(i);
    }
    return static_cast<int32_t>(n - 1);  // rounding
}

}  // namespace

Status ValidateSamplingParams(const SamplingParams& params) {
    if (!std::isfinite(params.temperature) || params.temperature < 0.0f) {
        return InvalidArgument("temperature must be finite and >= 0, got " +
                               std::to_string(params.temperature));
    }
    if (params.top_k < 0) {
        return InvalidArgument("top_k must be >= 0 (0 disables it), got " +
                               std::to_string(params.top_k));
    }
    if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
        return InvalidArgument("top_p must be in (0, 1], got " + std::to_string(params.top_p));
    }
    if (!(params.min_p >= 0.0f && params.min_p <= 1.0f)) {
        return InvalidArgument("min_p must be in [0, 1], got " + std::to_string(params.min_p));
    }
    return Status::Ok();
}

bool HasLogitControls(const SamplingParams& params) {
    return NeedsTokenHistory(params) || !params.logit_bias.empty();
}

Status ValidateLogitControls(const SamplingParams& params, std::span<const int32_t> history,
                             int64_t history_prompt_tokens, int64_t vocab) {
    if (!(std::isfinite(params.repetition_penalty) && params.repetition_penalty > 0.0f)) {
        return InvalidArgument("repetition_penalty must be finite and > 0, got " +
                               std::to_string(params.repetition_penalty));
    }
    for (const auto& [name, value] : {std::pair{"frequency_penalty", params.frequency_penalty},
                                      std::pair{"presence_penalty", params.presence_penalty}}) {
        if (!(std::isfinite(value) && value >= -2.0f && value <= 2.0f)) {
            return InvalidArgument(std::string(name) + " must be in [-2, 2], got " +
                                   std::to_string(value));
        }
    }
    int32_t previous = -1;
    for (const TokenBias& b : params.logit_bias) {
        if (b.token_id < 0 || b.token_id >= vocab || b.token_id <= previous) {
            return InvalidArgument("logit_bias token id " + std::to_string(b.token_id) +
                                   " is outside the vocabulary (0.." + std::to_string(vocab - 1) +
                                   ") or out of order");
        }
        if (std::isnan(b.bias)) return InvalidArgument("logit_bias value is NaN");
        previous = b.token_id;
    }
    if (params.min_tokens < 0) {
        return InvalidArgument("min_tokens must be >= 0, got " + std::to_string(params.min_tokens));
    }
    for (int32_t id : params.min_tokens_banned_ids) {
        if (id < 0 || id >= vocab) {
            return InvalidArgument("min_tokens banned token id " + std::to_string(id) +
                                   " is outside the vocabulary");
        }
    }
    if (NeedsTokenHistory(params)) {
        if (history.empty()) return InvalidArgument("the penalties need the token history");
        if (history_prompt_tokens < 0 ||
            history_prompt_tokens > static_cast<int64_t>(history.size())) {
            return InvalidArgument("history_prompt_tokens " +
                                   std::to_string(history_prompt_tokens) + " is not in 0.." +
                                   std::to_string(history.size()));
        }
        for (int32_t id : history) {
            if (id < 0 || id >= vocab) {
                return InvalidArgument("token id " + std::to_string(id) +
                                       " in the history is outside the vocabulary");
            }
        }
    }
    return Status::Ok();
}

void ApplyLogitControls(const SamplingParams& params, std::span<const int32_t> history,
                        int64_t history_prompt_tokens, float* logits, int64_t vocab,
                        std::vector<int32_t>* scratch) {
    (void)vocab;
    const auto output = history.subspan(static_cast<size_t>(history_prompt_tokens));
    if (params.repetition_penalty != 1.0f) {
        scratch->assign(history.begin(), history.end());
        std::sort(scratch->begin(), scratch->end());
        scratch->erase(std::unique(scratch->begin(), scratch->end()), scratch->end());
        const float p = params.repetition_penalty;
        for (int32_t id : *scratch) logits[id] = logits[id] > 0 ? logits[id] / p : logits[id] * p;
    }
    if (params.frequency_penalty != 0.0f || params.presence_penalty != 0.0f) {
        scratch->assign(output.begin(), output.end());
        std::sort(scratch->begin(), scratch->end());
        for (size_t i = 0; i < scratch->size();) {
            size_t j = i;
            while (j < scratch->size() && (*scratch)[j] == (*scratch)[i]) ++j;
            const auto count = static_cast<float>(j - i);
            logits[(*scratch)[i]] -= count * params.frequency_penalty + params.presence_penalty;
            i = j;
        }
    }
    for (const TokenBias& b : params.logit_bias) logits[b.token_id] += b.bias;
    if (static_cast<int64_t>(output.size()) < params.min_tokens) {
        for (int32_t id : params.min_tokens_banned_ids) {
            logits[id] = -std::numeric_limits<float>::infinity();
        }
    }
}

Status ValidateTokenMask(std::span<const uint64_t> allowed, int64_t vocab) {
    if (allowed.empty()) return Status::Ok();
    const auto words = static_cast<size_t>((vocab + 63) / 64);
    if (allowed.size() != words) {
        return InvalidArgument("allowed_tokens has " + std::to_string(allowed.size()) +
                               " words; a vocabulary of " + std::to_string(vocab) + " needs " +
                               std::to_string(words));
    }
    if (vocab % 64 != 0 && (allowed.back() >> (vocab % 64)) != 0) {
        return InvalidArgument("allowed_tokens allows ids beyond the vocabulary of " +
                               std::to_string(vocab));
    }
    if (std::all_of(allowed.begin(), allowed.end(), [](uint64_t w) { return w == 0; })) {
        return InvalidArgument("allowed_tokens allows no token");
    }
    return Status::Ok();
}

void ApplyTokenMask(std::span<const uint64_t> allowed, float* logits, int64_t vocab) {
    constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
    for (int64_t w = 0; w * 64 < vocab; ++w) {
        const uint64_t bits = allowed[static_cast<size_t>(w)];
        if (bits == ~uint64_t{0}) continue;
        const int64_t end = std::min<int64_t>(64, vocab - w * 64);
        for (int64_t b = 0; b < end; ++b) {
            if (((bits >> b) & 1) == 0) logits[w * 64 + b] = kMinusInf;
        }
    }
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
    const Status status = ValidateSamplingParams(params);
    KV_CHECK(status.ok()) << status.ToString();
}

int32_t Sampler::Argmax(const float* values, int64_t n) {
    KV_CHECK_GT(n, 0);
    // What a scan keeping the first strictly larger value returns (NaNs never win; a NaN at 0
    // wins everything), in two vectorized passes: the maximum, 16 independent running maxima at
    // a time (`v > m ? v : m` is one vmaxps), then the first index equal to it. The scan's one
    // dependent compare per element took ~35 µs over a 49,152-token vocabulary.
    constexpr int64_t kLanes = 16;
    float m = values[0];
    float lane[kLanes];
    for (float& l : lane) l = values[0];
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) {
            const float v = values[i + j];
            lane[j] = v > lane[j] ? v : lane[j];
        }
    }
    for (; i < n; ++i) m = values[i] > m ? values[i] : m;
    for (const float l : lane) m = l > m ? l : m;
    for (i = 0; i < n; ++i) {
        if (values[i] == m) return static_cast<int32_t>(i);
    }
    return 0;  // values[0] is NaN
}

std::vector<TokenLogprob> TopLogprobs(const float* logits, int64_t vocab, float log_sum,
                                      int64_t k) {
    std::vector<TokenLogprob> best;
    if (k <= 0) return best;
    best.reserve(static_cast<size_t>(k) + 1);
    // Ids arrive increasing, so an id equal in value to one kept ranks after it: a new id enters
    // only strictly above the last kept value, and goes after every kept one not below it.
    for (int64_t i = 0; i < vocab; ++i) {
        const float v = logits[i] - log_sum;
        if (static_cast<int64_t>(best.size()) == k && !(v > best.back().logprob)) continue;
        auto at = std::upper_bound(best.begin(), best.end(), v,
                                   [](float x, const TokenLogprob& t) { return x > t.logprob; });
        best.insert(at, TokenLogprob{static_cast<int32_t>(i), v});
        if (static_cast<int64_t>(best.size()) > k) best.pop_back();
    }
    return best;
}

int32_t Sampler::Sample(const float* logits, int64_t vocab) {
    KV_CHECK(vocab > 0 && vocab <= std::numeric_limits<int32_t>::max()) << "vocab=" << vocab;
    if (params_.temperature == 0.0f) return Argmax(logits, vocab);

    probs_.resize(static_cast<size_t>(vocab));
    float* probs = probs_.data();
    for (int64_t i = 0; i < vocab; ++i) probs[i] = logits[i] / params_.temperature;
    if (params_.top_k > 0 && params_.top_k < vocab) ApplyTopK(vocab);
    SoftmaxLikeRunC(probs, vocab);
    if (params_.min_p > 0.0f) ApplyMinP(vocab);

    const float coin = rng_.NextF32();
    if (params_.top_p <= 0.0f || params_.top_p >= 1.0f || vocab == 1) {
        return SampleMultinomial(probs, vocab, coin);
    }
    return SampleTopP(vocab, coin);
}

void Sampler::ApplyTopK(int64_t vocab) {
    float* probs = probs_.data();
    order_.resize(static_cast<size_t>(vocab));
    for (int64_t i = 0; i < vocab; ++i) order_[i] = static_cast<int32_t>(i);
    const auto higher = [probs](int32_t a, int32_t b) {
        return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    };
    std::nth_element(order_.begin(), order_.begin() + params_.top_k, order_.end(), higher);
    for (auto it = order_.begin() + params_.top_k; it != order_.end(); ++it) {
        probs[*it] = -std::numeric_limits<float>::infinity();
    }
}

void Sampler::ApplyMinP(int64_t vocab) {
    float* probs = probs_.data();
    float max_prob = 0.0f;
    for (int64_t i = 0; i < vocab; ++i) max_prob = std::max(max_prob, probs[i]);
    const float threshold = params_.min_p * max_prob;
    float sum = 0.0f;
    for (int64_t i = 0; i < vocab; ++i) {
        if (probs[i] < threshold) probs[i] = 0.0f;
        sum += probs[i];
    }
    for (int64_t i = 0; i < vocab; ++i) probs[i] /= sum;
}

int32_t Sampler::SampleTopP(int64_t vocab, float coin) {
    // llama2.c's sample_topp. Tokens below the cutoff cannot be in the nucleus (the n - 1 others
    // would have to carry more than top_p), so they are dropped before sorting.
    const float* probs = probs_.data();
    const float top_p = params_.top_p;
    const float cutoff = (1.0f - top_p) / static_cast<float>(vocab - 1);
    candidates_.clear();
    for (int64_t i = 0; i < vocab; ++i) {
        if (probs[i] >= cutoff) candidates_.push_back({probs[i], static_cast<int32_t>(i)});
    }
    // run.c uses qsort (unstable); ties are broken here by the lower index, deterministically.
    std::sort(candidates_.begin(), candidates_.end(), [](const ProbIndex& a, const ProbIndex& b) {
        return a.prob > b.prob || (a.prob == b.prob && a.index < b.index);
    });
    const int64_t n0 = static_cast<int64_t>(candidates_.size());
    // With top_p < 1/vocab even the largest probability can be under the cutoff (run.c reads out
    // of bounds then); the nucleus is then the most likely token alone.
    if (n0 == 0) return Argmax(probs, vocab);
    float cumulative_prob = 0.0f;
    int64_t last_idx = n0 - 1;
    for (int64_t i = 0; i < n0; ++i) {
        cumulative_prob += candidates_[i].prob;
        if (cumulative_prob > top_p) {
            last_idx = i;
            break;
        }
    }
    const float r = coin * cumulative_prob;
    float cdf = 0.0f;
    for (int64_t i = 0; i <= last_idx; ++i) {
        cdf += candidates_[i].prob;
        if (r < cdf) return candidates_[i].index;
    }
    return candidates_[last_idx].index;
}

}  // namespace kvshard
