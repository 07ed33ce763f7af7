// The chat half of the OpenAI request parser: "messages" (roles, text parts, an assistant's
// tool_calls, a tool's tool_call_id, cache_control breakpoints) and the chat-only fields
// (max_completion_tokens, logprobs/top_logprobs, add_generation_prompt, tools, tool_choice).
// Internal to coordinator/; a failed check throws openai_request::ValidationError
// (openai_request_fields.h).
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "coordinator/openai_protocol.h"

namespace kvshard::openai_request {

// body["messages"]: required, a non-empty array of messages, appended to `messages`.
void ReadMessages(const nlohmann::json& body, std::vector<ChatMessage>& messages);
// Everything only POST /v1/chat/completions reads, into `r`.
void ReadChat(const nlohmann::json& body, OpenAiRequest& r);

}  // namespace kvshard::openai_request
