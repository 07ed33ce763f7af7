// Sequence: one stream of tokens the scheduler places in KV blocks and steps — a request's prompt
// and, for each of its n choices, what that choice generated.
// Ownership: the engine owns Sequences (inside its request state); the scheduler holds pointers.
#pragma once

#include <cstdint>
#include <vector>

#include "common/request.h"

namespace kvshard {

enum class SequenceStatus { kWaiting, kRunning, kPendingFork, kFinished };

struct Sequence {
    int64_t seq_id = 0;
    std::vector<int32_t>
        token_ids;  // prompt, then generated tokens (the last one not yet computed)
    int64_t num_prompt_tokens = 0;
    int64_t num_computed = 0;  // leading positions whose KV exists
    int64_t num_generated = 0;
    int64_t num_cached_tokens = 0;  // prompt tokens served from the prefix cache at admission
    SamplingParams sampling;
    int32_t num_top_logprobs = -1;
    // Prompt logprobs (-1: none; k: with the top k): until it has generated, every chunk of the
    // prompt is scored, and admission computes the whole prompt, skipping prefix-cache hits.
    int32_t num_prompt_logprobs = -1;
    SequenceStatus status = SequenceStatus::kWaiting;
    // A request with n > 1 choices: the first choice prefills the prompt up to its last token,
    // then each pending child is forked from it (sharing every block) and all compute that last
    // token and sample on their own.
    std::vector<Sequence*> fork_children;
    int64_t num_preemptions = 0;
    // Disaggregated decode: the KV of positions [0, num_incoming_tokens) arrives from a prefill
    // instance instead of being computed here (0 once received, or for any other sequence).
    int64_t num_incoming_tokens = 0;
    // Tokens matched in this instance's prefix cache at the last admission (their blocks are
    // shared and must not be overwritten by received KV).
    int64_t admitted_cached_tokens = 0;

    int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
    // Tokens this sequence wants computed before it can sample (or fork).
    int64_t target_computed() const {
        return fork_children.empty() ? num_tokens() : num_tokens() - 1;
    }
};

}  // namespace kvshard
