// The request half of OpenAI's Responses API (POST /v1/responses): text in, text out. The body is
// read into the chat route's OpenAiRequest (instructions as the system message, then the input
// messages), so the chat template, the sampler and the engine serve it unchanged; what the answer
// echoes back (instructions, max_output_tokens, metadata, ...) is kept beside it. The response half
// is responses_response.h; docs/http_api.md lists what is accepted and what is refused.
//
// Accepted: model, input (a string, or a list of messages {"role": user|assistant|system|
// developer, "content": a string or input_text/output_text parts}, "type": "message" optional),
// instructions, max_output_tokens, temperature, top_p, stream, store false, metadata, user,
// safety_identifier, prompt_cache_key, service_tier, parallel_tool_calls, tool_choice "none" or
// "auto" with no tools, text.format {"type": "text" | "json_object" | "json_schema"} (the latter
// two held by the grammar as chat's response_format is), truncation "disabled", and vLLM's
// sampling and structured-output extensions (top_k, min_p, seed, penalties, stop, guided_*, ...).
// Refused by name with a 400: tools, previous_response_id, conversation, store true (nothing is
// kept), background, include, reasoning, prompt, max_tool_calls, top_logprobs, truncation "auto",
// non-text input items, and stream_options.include_obfuscation true.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "coordinator/openai_protocol.h"

namespace kvshard {

// POST /v1/responses (the one route of this API kvshard serves).
enum class ResponsesEndpoint { kCreate };

struct ResponsesRequest {
    OpenAiRequest chat;  // endpoint kChatCompletions; n 1
    // Echoed in the response object as the client sent them.
    std::optional<std::string> instructions;
    std::optional<int64_t> max_output_tokens;
    double temperature = 1.0;
    double top_p = 1.0;
    std::string metadata = "{}";  // a JSON object of strings, as sent
    std::optional<std::string> user;
    std::string service_tier = "auto";
    bool parallel_tool_calls = true;
    std::string text_format = R"({"type":"text"})";  // text.format, a JSON object as sent
};

// `body` may be any bytes; every mistake is a 400 naming the field (an unknown model a 404).
std::variant<ResponsesRequest, ApiError> ParseResponsesRequest(std::string_view body,
                                                               const ServedModel& model);

}  // namespace kvshard
