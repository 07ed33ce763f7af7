// The fields POST /v1/completions and POST /v1/chat/completions share: sampling (temperature,
// top_p, top_k, min_p, seed, penalties, min_tokens), logit_bias, stop, vLLM's output controls,
// n, stream and stream_options, echo, prompt_logprobs, and the options kvshard refuses by name.
// Internal to coordinator/; a failed check throws openai_request::ValidationError
// (openai_request_fields.h).
#pragma once

#include <nlohmann/json.hpp>

#include "coordinator/openai_protocol.h"

namespace kvshard::openai_request {

// REQUIRES: the endpoint's own fields already read into `r` (max_tokens, the logprobs count).
void ReadCommon(const nlohmann::json& body, const ServedModel& model, OpenAiRequest& r);

}  // namespace kvshard::openai_request
