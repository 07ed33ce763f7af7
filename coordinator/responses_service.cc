// ApiService's Responses route (api_service.h): a parsed ResponsesRequest is a chat request with
// one choice, prepared as the chat route prepares one, answered in the Responses shape.
#include <chrono>

#include "coordinator/api_service.h"

namespace kvshard {

std::variant<ResponsesRequest, ApiError> ApiService::ParseResponses(std::string_view body) const {
    auto parsed = ParseResponsesRequest(body, options_.model);
    if (auto* r = std::get_if<ResponsesRequest>(&parsed)) {
        int64_t bytes = 0;
        for (const ChatMessage& m : r->chat.messages)
            bytes += static_cast<int64_t>(m.content.size());
        if (bytes > max_prompt_bytes_) {
            return PromptTooLarge("the input", bytes, "input");
        }
    }
    return parsed;
}

std::variant<PreparedGeneration, ApiError> ApiService::PrepareResponses(
    const ResponsesRequest& r) const {
    auto prepared = Prepare(r.chat);
    if (auto* error = std::get_if<ApiError>(&prepared)) {
        // The chat route names its prompt "messages"; here it is the input.
        if (error->param == "messages") error->param = "input";
        return *error;
    }
    PreparedGeneration& p = std::get<PreparedGeneration>(prepared);
    constexpr std::string_view kChatPrefix = "chatcmpl-";
    const std::string hex = p.request.request_id.substr(kChatPrefix.size());
    p.request.request_id = "resp_" + hex;
    ResponsesContext c;
    c.id = p.request.request_id;
    c.message_id = "msg_" + hex;
    c.created_at = std::chrono::duration_cast<std::chrono::seconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
    c.model = options_.model.name;
    c.instructions = r.instructions;
    c.max_output_tokens = r.max_output_tokens;
    c.temperature = r.temperature;
    c.top_p = r.top_p;
    c.metadata = r.metadata;
    c.user = r.user;
    c.service_tier = r.service_tier;
    c.parallel_tool_calls = r.parallel_tool_calls;
    c.text_format = r.text_format;
    p.responses = std::move(c);
    return p;
}

}  // namespace kvshard
