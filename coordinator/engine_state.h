// The per-request state of an InstanceEngine (internal to coordinator/engine*.cc): owned by one
// engine thread at a time — the one whose requests_ holds it, or a Handoff in transit.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/engine.h"
#include "coordinator/sequence.h"
#include "grammar/token_mask.h"
#include "model/tokenizer.h"

namespace kvshard {

struct InstanceEngine::RequestState {
    GenerationRequest request;
    std::shared_ptr<RequestSink> sink;
    std::vector<std::unique_ptr<Sequence>> choices;
    std::vector<std::unique_ptr<TextStream>> streams;
    // Structured outputs: each choice's grammar state (empty when request.grammar is null). It
    // moves with the request on a handoff and is untouched by preemption (the tokens stay).
    std::vector<std::unique_ptr<grammar::Constraint>> constraints;
    std::vector<bool> finished;
    int num_finished = 0;
    GenerationUsage usage;
    bool aborted = false;
    // Prompt logprobs gathered so far (positions 1 ..), until all are sent in one delta.
    std::vector<PromptTokenLogprob> prompt_logprobs;
    bool prompt_logprobs_sent = false;
    bool pins_made =
        false;  // its cache breakpoints were pinned (or tried) once its prompt was computed

    std::chrono::steady_clock::time_point arrival;
    std::chrono::steady_clock::time_point last_token;  // of choice 0 (inter-token latency)
    // The request's phases (FinishedRequestStats), carried across a handoff: when a step first
    // ran it, its first token and its last token of any choice.
    std::optional<std::chrono::steady_clock::time_point> first_scheduled;
    std::optional<std::chrono::steady_clock::time_point> first_token;
    std::chrono::steady_clock::time_point last_any_token;

    // Prefill side: the decode instance this request moves to after its first token.
    InstanceEngine* handoff_to = nullptr;
    uint64_t transfer_id = 0;
    // Decode side: where it came from, its sequence id there, when its KV and first token were
    // ready there.
    InstanceEngine* handoff_from = nullptr;
    int64_t src_seq_id = 0;
    std::chrono::steady_clock::time_point handoff_ready;
};

struct InstanceEngine::Handoff {
    uint64_t transfer_id = 0;
    InstanceEngine* source = nullptr;
    int64_t src_seq_id = 0;
    std::chrono::steady_clock::time_point ready;
    std::unique_ptr<RequestState> state;
};

}  // namespace kvshard
