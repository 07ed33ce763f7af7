// The request vocabulary: how a sequence is sampled (SamplingParams and its logit controls), why a
// sequence stopped (FinishReason), a token's log-probability (generated or prompt). Plain value
// types with no project dependencies, shared by every layer that speaks of requests: the HTTP front
// end and the engine (coordinator/), the wire plan that carries them to the workers
// (comm/step_plan.h), and the sampler that reads them (worker/sampler.h). None of them owns it.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace kvshard {

// Why a sequence stopped: a stop token or string, the token limit (or the context), or an abort.
enum class FinishReason { kStop, kLength, kAbort };

// "stop", "length", "abort" (the OpenAI API's words for the first two).
inline std::string_view FinishReasonName(FinishReason reason) {
    switch (reason) {
        case FinishReason::kStop:
            return "stop";
        case FinishReason::kLength:
            return "length";
        case FinishReason::kAbort:
            return "abort";
    }
    return "abort";
}

// An additive change to one token's logit (OpenAI's logit_bias; -inf bans the token).
struct TokenBias {
    int32_t token_id = 0;
    float bias = 0.0f;
    friend bool operator==(const TokenBias&, const TokenBias&) = default;
};

struct SamplingParams {
    float temperature = 0.0f;  // 0: greedy (argmax); otherwise logits are divided by it
    int top_k = 0;             // keep the k highest logits; 0: off
    float top_p = 1.0f;        // nucleus sampling over the smallest set with mass > top_p; 1: off
    float min_p = 0.0f;        // drop tokens with prob < min_p * max prob; 0: off
    uint64_t seed = 0;         // the RNG's initial state (0 is replaced, see XorShiftRng)

    // Logit controls, applied to the raw logits before temperature and the filters above, in
    // vLLM's order (worker/sampler.h ApplyLogitControls): repetition penalty over the prompt and
    // the output so far, frequency and presence penalties over the output, logit_bias, then the
    // min_tokens ban. Logprobs stay those of the raw logits, as vLLM reports them by default.
    float repetition_penalty = 1.0f;  // > 0; a seen token's logit is divided (> 0) or multiplied
    float frequency_penalty = 0.0f;   // in [-2, 2]; times the token's count in the output
    float presence_penalty = 0.0f;    // in [-2, 2]; once for a token present in the output
    std::vector<TokenBias> logit_bias = {};  // by increasing token id, each id once
    // While fewer than min_tokens tokens have been generated, min_tokens_banned_ids (the stop
    // tokens: EOS and the request's stop_token_ids) cannot be sampled.
    int64_t min_tokens = 0;
    std::vector<int32_t> min_tokens_banned_ids = {};
    friend bool operator==(const SamplingParams&, const SamplingParams&) = default;
};

// True when sampling a sequence needs its token history (the prompt and output so far).
inline bool NeedsTokenHistory(const SamplingParams& p) {
    return p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f ||
           p.presence_penalty != 0.0f || p.min_tokens > 0;
}

// One token and its log-probability under the raw model (the sampled token's, or one of the top k).
struct TokenLogprob {
    int32_t token_id = 0;
    float logprob = 0.0f;
    friend bool operator==(const TokenLogprob&, const TokenLogprob&) = default;
};

// One generated token as the client sees it with logprobs: its logprob under the raw model and
// the top alternatives (GenerationDelta.logprobs). The engine's output stage makes it from what
// the workers sampled; the HTTP writers read only this.
struct GeneratedTokenLogprob {
    int32_t token_id = 0;
    float logprob = 0.0f;
    std::vector<TokenLogprob> top;  // highest first; empty unless top logprobs were asked for
    friend bool operator==(const GeneratedTokenLogprob&, const GeneratedTokenLogprob&) = default;
};

// The most alternatives a request may ask for per token, generated or prompt (vLLM's limit).
inline constexpr int32_t kMaxLogprobs = 20;

// One prompt token scored under the raw model's distribution at the position before it (prompt
// logprobs, and echo with logprobs): its logprob, its rank in that distribution (1: the most
// likely; ties share the better rank) and the top alternatives.
struct PromptTokenLogprob {
    int32_t token_id = 0;
    float logprob = 0.0f;
    int64_t rank = 1;
    std::vector<TokenLogprob> top;  // highest first, ties by lower id
    friend bool operator==(const PromptTokenLogprob&, const PromptTokenLogprob&) = default;
};

}  // namespace kvshard
