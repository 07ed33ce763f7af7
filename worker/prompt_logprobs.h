// Prompt logprobs: how a prompt token is scored from the logits of the position before it — its
// log-probability under the raw model, its rank and the top alternatives (vLLM's prompt_logprobs,
// and the OpenAI completions API's echo with logprobs). The same arithmetic as the logprobs of a
// sampled token (StepRunner::SampleRow), so that a token reads the same logprob whether it was
// generated or sent back as part of a prompt.
// Thread-safety: free functions; the scratch belongs to the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "common/request.h"

namespace kvshard {

// log(sum(exp(logits))) over `n` logits (REQUIRES: n > 0), computed in double from the maximum.
float LogSumExp(const float* logits, int64_t n);

// Scores `target` under one row of `vocab` logits: logprob = logit - LogSumExp, rank = 1 + the
// number of tokens with a strictly higher logit, and the `top_k` highest tokens (ties by lower
// id). REQUIRES: 0 <= target < vocab, 0 <= top_k. `ids` is scratch, reused across calls.
PromptTokenLogprob ScorePromptToken(const float* logits, int64_t vocab, int32_t target,
                                    int32_t top_k, std::vector<int32_t>* ids);

}  // namespace kvshard
