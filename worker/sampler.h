// Token sampling on rank 0: greedy, temperature, top-k, top-p (nucleus) and min-p.
//
// The random numbers and the temperature / top-p procedure reproduce llama2.c's run.c exactly
// (its xorshift RNG, softmax, multinomial and top-p sampling), so that a seed gives the tokens
// llama2.c documents. Top-k and min-p are kvshard's additions; with top_k = 0 and min_p = 0 the
// path is run.c's, operation for operation.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "comm/step_plan.h"
#include "common/status.h"

namespace kvshard {

// temperature finite and >= 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1]. The message of an
// InvalidArgument names the field and its value.
Status ValidateSamplingParams(const SamplingParams& params);

// The logit controls of `params` (comm/step_plan.h SamplingParams) against a vocabulary of
// `vocab` tokens and a token history (ScheduledSequence::history): the penalties finite and in
// range, logit_bias and the banned ids inside the vocabulary, the bias ids increasing, the
// history present when NeedsTokenHistory(params). The message names the field.
Status ValidateLogitControls(const SamplingParams& params, std::span<const int32_t> history,
                             int64_t history_prompt_tokens, int64_t vocab);

// True when `params` change the logits at all (penalties, logit_bias or min_tokens).
bool HasLogitControls(const SamplingParams& params);

// Applies the logit controls to one row of `vocab` logits, in vLLM's order: the repetition
// penalty for every token in `history` (a positive logit divided by it, a negative one
// multiplied), then for the output part (history after the first history_prompt_tokens) the
// frequency penalty times the token's count and the presence penalty once, then logit_bias
// added, then, while the output is shorter than min_tokens, min_tokens_banned_ids set to -inf.
// `scratch` is reused between calls. REQUIRES: ValidateLogitControls(...).ok().
void ApplyLogitControls(const SamplingParams& params, std::span<const int32_t> history,
                        int64_t history_prompt_tokens, float* logits, int64_t vocab,
                        std::vector<int32_t>* scratch);

// Structured outputs' token mask (ScheduledSequence::allowed_tokens) against a vocabulary of
// `vocab` tokens: empty (no constraint), or (vocab + 63) / 64 words with at least one token of
// the vocabulary allowed and no bit set past it. The message names the field.
Status ValidateTokenMask(std::span<const uint64_t> allowed, int64_t vocab);

// Sets the logit of every token not in `allowed` to -inf. REQUIRES: ValidateTokenMask(...).ok()
// and allowed not empty.
void ApplyTokenMask(std::span<const uint64_t> allowed, float* logits, int64_t vocab);

// The k highest of logits[i] - log_sum (a row's log-probabilities when log_sum is its
// LogSumExp), highest first, ties to the lower id: the first k of every id sorted so, each value
// computed as `logits[i] - log_sum` in float, in one pass without a vocabulary-sized array.
// REQUIRES: 0 <= k <= vocab, no NaN among the logits.
std::vector<TokenLogprob> TopLogprobs(const float* logits, int64_t vocab, float log_sum,
                                      int64_t k);

// llama2.c's xorshift* generator. State 0 is a fixed point of xorshift (every draw would be 0),
// so a seed of 0 starts from kZeroSeedState instead; llama2.c never seeds with 0.
class XorShiftRng {
  public:
    static constexpr uint64_t kZeroSeedState = 0x9E3779B97F4A7C15ULL;

    explicit XorShiftRng(uint64_t seed) : state_(seed == 0 ? kZeroSeedState : seed) {}
    uint32_t NextU32() {
        state_ ^= state_ >> 12;
        state_ ^= state_ << 25;
        state_ ^= state_ >> 27;
        return static_cast<uint32_t>((state_ * 0x2545F4914F6CDD1DULL) >> 32);
    }
    // Uniform in [0, 1) with 24 random bits.
    float NextF32() { return static_cast<float>(NextU32() >> 8) / 16777216.0f; }
    // Never 0, so XorShiftRng(state()) continues this stream exactly.
    uint64_t state() const { return state_; }

  private:
    uint64_t state_;
};

// Samples one token per call from a row of logits. Sampling with temperature > 0 draws exactly one
// random number per call; greedy draws none.
// Thread-safety: none (each sequence owns its Sampler).
class Sampler {
  public:
    // REQUIRES: ValidateSamplingParams(params).ok().
    explicit Sampler(const SamplingParams& params);

    // Returns a token id in [0, vocab). logits are not modified. REQUIRES: vocab > 0.
    int32_t Sample(const float* logits, int64_t vocab);

    // Index of the largest value; ties go to the lowest index.
    static int32_t Argmax(const float* values, int64_t n);

    const SamplingParams& params() const { return params_; }
    uint64_t rng_state() const { return rng_.state(); }

  private:
    struct ProbIndex {
        float prob;
        int32_t index;
    };

    // Sets every logit outside the top_k highest to -inf (ties: lower index kept).
    void ApplyTopK(int64_t vocab);
    // Zeroes probabilities below min_p * max and renormalizes.
    void ApplyMinP(int64_t vocab);
    int32_t SampleTopP(int64_t vocab, float coin);

    SamplingParams params_;
    XorShiftRng rng_;
    std::vector<float> probs_;           // scratch: the scaled logits, then probabilities
    std::vector<ProbIndex> candidates_;  // scratch for top-p
    std::vector<int32_t> order_;         // scratch for top-k
};

}  // namespace kvshard
