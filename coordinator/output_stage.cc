#include "coordinator/output_stage.h"

#include <algorithm>

namespace kvshard {

TokenOutcome OutputStage::OnToken(const GenerationRequest& request, int index,
                                  const SampledToken& token, TextStream& stream,
                                  int64_t num_generated, int64_t num_tokens) const {
    TokenOutcome out;
    out.delta.index = index;
    if (request.max_tokens == 0) {
        // Only the prompt was asked for: the token sampled after it is dropped.
        out.finish = FinishReason::kLength;
        return out;
    }
    const bool is_stop_token =
        !request.ignore_eos && std::find(stop_token_ids_.begin(), stop_token_ids_.end(),
                                         token.token_id) != stop_token_ids_.end();
    if (is_stop_token) {
        out.finish = FinishReason::kStop;
        return out;
    }
    // The request's own stop tokens end the choice after joining it (their text is output
    // unless they are control tokens, which render as nothing).
    const bool is_request_stop_token =
        std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), token.token_id) !=
        request.stop_token_ids.end();
    out.append = true;
    out.delta.text = stream.Push(token.token_id);
    out.delta.token_ids.push_back(token.token_id);
    if (request.num_top_logprobs >= 0) {
        // The wire's token (sequence id, sampler state) becomes the request's vocabulary here.
        out.delta.logprobs.push_back({token.token_id, token.logprob, token.top_logprobs});
    }
    if (stream.stopped()) {
        out.finish = FinishReason::kStop;
    } else if (is_request_stop_token) {
        out.delta.text += stream.Finish();
        out.finish = FinishReason::kStop;
    } else if (num_generated + 1 >= request.max_tokens || num_tokens + 1 >= max_context_) {
        out.delta.text += stream.Finish();
        out.finish = FinishReason::kLength;
    }
    return out;
}

}  // namespace kvshard
