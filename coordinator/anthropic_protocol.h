// The request half of Anthropic's Messages API: parsing and validating the bodies of
// POST /v1/messages and POST /v1/messages/count_tokens, and the error body every 4xx/5xx answer
// on those routes carries: {"type": "error", "error": {"type": ..., "message": ...}}.
//
// A request becomes chat messages for the model's template (model/chat_template.h):
//   system (a string or text blocks)            -> a "system" message first
//   text blocks of a message                    -> its content, joined with "\n"
//   tool_use blocks of an assistant message     -> its tool_calls
//   tool_result blocks of a user message        -> "tool" messages (before the user's text)
//   cache_control on a system block, a message
//   content block or a tool                     -> a ChatCacheMark at the end of that block
//   cache_control at the top level              -> a ChatCacheMark at the end of the last message
// Every message's field is checked before anything is tokenized; a mistake is a 400 whose
// message names the field ("messages.1.content.0.cache_control.ttl"), as Anthropic's errors do.
// Unknown fields are ignored; fields kvshard knows and cannot honour (image blocks, thinking,
// server tools, a final assistant message to continue) are refused by name.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/request.h"
#include "common/status.h"
#include "coordinator/openai_protocol.h"
#include "coordinator/tool_calls.h"
#include "model/chat_template.h"

namespace kvshard {

enum class AnthropicEndpoint { kMessages, kCountTokens };

// Anthropic allows at most this many cache_control breakpoints in a request.
constexpr int kMaxCacheBreakpoints = 4;
constexpr int64_t kCacheTtl5mMs = 5 * 60 * 1000;
constexpr int64_t kCacheTtl1hMs = 60 * 60 * 1000;

struct AnthropicRequest {
    AnthropicEndpoint endpoint = AnthropicEndpoint::kMessages;
    std::vector<ChatMessage> messages;  // the system prompt first, when given
    std::vector<ToolDefinition> tools;
    ToolChoice tool_choice;
    bool disable_parallel_tool_use = false;
    int64_t max_tokens = 0;   // required for kMessages
    SamplingParams sampling;  // temperature 1 by default, as Anthropic's
    std::vector<std::string> stop_sequences;
    bool stream = false;
    int num_cache_breakpoints = 0;
    int64_t content_bytes = 0;  // all text that goes into the prompt (the prompt-bytes cap)
};

// The "error" type Anthropic uses for an HTTP status (invalid_request_error,
// authentication_error, not_found_error, request_too_large, rate_limit_error, overloaded_error,
// api_error, ...).
std::string_view AnthropicErrorType(int http_status);
// {"type": "error", "error": {"type": ..., "message": ...}}; the message says which field when
// the error names one.
std::string AnthropicErrorBody(const ApiError& error);

// Parses and validates a body. Any bytes are a valid input: nothing throws.
std::variant<AnthropicRequest, ApiError> ParseAnthropicRequest(AnthropicEndpoint endpoint,
                                                               std::string_view body,
                                                               const ServedModel& model);

}  // namespace kvshard
