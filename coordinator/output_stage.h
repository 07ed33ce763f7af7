// OutputStage: the engine's output step for one sampled token — what it means for its choice.
// A stop token ends the choice (unless the request ignores EOS) and adds no text; any other token
// joins the sequence and becomes text through the choice's TextStream (UTF-8 safe, stop strings
// held back until they cannot match); a matched stop string, max_tokens or the context ends the
// choice; with max_tokens 0 (only the prompt was asked for) the first token ends the choice unseen.
// Pure: it never touches the scheduler, the sink or the clock; the engine applies the
// outcome (InstanceEngine::HandleResult).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "comm/step_plan.h"  // SampledToken: what the workers sampled
#include "coordinator/engine_api.h"
#include "model/tokenizer.h"

namespace kvshard {

struct TokenOutcome {
    GenerationDelta delta;               // text, token id and logprobs for the client
    bool append = false;                 // the token joins the sequence (it is not a stop token)
    std::optional<FinishReason> finish;  // the choice ends with this token
};

class OutputStage {
  public:
    OutputStage(std::vector<int32_t> stop_token_ids, int64_t max_context)
        : stop_token_ids_(std::move(stop_token_ids)), max_context_(max_context) {}

    // `num_generated` and `num_tokens`: the choice's counts before this token.
    TokenOutcome OnToken(const GenerationRequest& request, int index, const SampledToken& token,
                         TextStream& stream, int64_t num_generated, int64_t num_tokens) const;

  private:
    std::vector<int32_t> stop_token_ids_;
    int64_t max_context_;
};

}  // namespace kvshard
