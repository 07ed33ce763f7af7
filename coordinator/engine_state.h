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

    // The request's timeline on the engine's clock, from which the engine alone measures its
    // latencies (EngineObserver), carried across a handoff: its one arrival time, when a step
    // first ran it, its first token (of any choice), each choice's last token, and its last
    // token of any choice.
    Clock::time_point arrival;
    std::optional<Clock::time_point> first_scheduled;
    std::optional<Clock::time_point> first_token;
    std::vector<std::optional<Clock::time_point>> last_token;  // per choice
    Clock::time_point last_any_token;
    std::optional<FinishReason> last_finish;  // how the last choice to end ended

    // Prefill side: the decode instance this request moves to after its first token.
    InstanceEngine* handoff_to = nullptr;
    uint64_t transfer_id = 0;
    // Decode side: where it came from, its sequence id there, when its KV and first token were
    // ready there.
    InstanceEngine* handoff_from = nullptr;
    int64_t src_seq_id = 0;
    Clock::time_point handoff_ready;
};

struct InstanceEngine::Handoff {
    uint64_t transfer_id = 0;
    InstanceEngine* source = nullptr;
    int64_t src_seq_id = 0;
    Clock::time_point ready;
    std::unique_ptr<RequestState> state;
};

}  // namespace kvshard
