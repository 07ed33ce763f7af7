// ApiService's Anthropic Messages route (api_service.h): a parsed AnthropicRequest through the
// chat template (tools included) and the tokenizer into a GenerationRequest with its
// cache breakpoints, and the answer's AnthropicResponseContext.
#include <nlohmann/json.hpp>

#include "coordinator/api_service.h"

namespace kvshard {

std::variant<AnthropicRequest, ApiError> ApiService::ParseAnthropic(AnthropicEndpoint endpoint,
                                                                    std::string_view body) const {
    auto parsed = ParseAnthropicRequest(endpoint, body, options_.model);
    if (auto* r = std::get_if<AnthropicRequest>(&parsed);
        r && r->content_bytes > max_prompt_bytes_) {
        return PromptTooLarge("messages: the prompt's text (messages, system and tools)",
                              r->content_bytes, "messages");
    }
    return parsed;
}

std::variant<PreparedGeneration, ApiError> ApiService::PrepareAnthropic(
    const AnthropicRequest& r) const {
    const std::string id_hex = NewIdHex();
    auto tools =
        ToolsFor(r.tools, r.tool_choice, r.disable_parallel_tool_use, "toolu_" + id_hex + "_");
    if (auto* error = std::get_if<ApiError>(&tools)) return *error;
    auto& [chat_tools, parse_options] =
        std::get<std::pair<ChatTools, std::optional<ToolCallParserOptions>>>(tools);
    auto encoded = EncodeChat(r.messages, /*add_generation_prompt=*/true,
                              /*add_special_tokens=*/true, &chat_tools);
    if (auto* error = std::get_if<ApiError>(&encoded)) {
        error->message = "messages: " + error->message;
        return *error;
    }
    EncodedChat& chat = std::get<EncodedChat>(encoded);
    const int64_t prompt_tokens = static_cast<int64_t>(chat.ids.size());
    const int64_t max_context = engine_.max_context();
    if (prompt_tokens >= max_context) {
        return BadRequest("messages: the prompt has " + std::to_string(prompt_tokens) +
                              " tokens; this model's context holds " + std::to_string(max_context) +
                              " tokens including at least one generated token",
                          "messages", "context_length_exceeded");
    }

    PreparedGeneration p;
    p.stream = r.stream;
    GenerationRequest& g = p.request;
    g.request_id = "msg_" + id_hex;
    g.prompt_token_ids = std::move(chat.ids);
    g.sampling = r.sampling;
    g.sampling.seed = RandomSeed();
    // max_tokens is an upper bound: beyond the room the context leaves, the answer ends at the
    // context's end with stop_reason max_tokens (docs/http_api.md).
    g.max_tokens = std::min(r.max_tokens, max_context - prompt_tokens);
    g.stop = r.stop_sequences;
    g.n = 1;
    g.cache_breakpoints = std::move(chat.breakpoints);

    AnthropicResponseContext c;
    c.id = g.request_id;
    c.model = options_.model.name;
    c.prompt_tokens = prompt_tokens;
    c.stop_sequences = r.stop_sequences;
    c.tools = std::move(parse_options);
    const Tokenizer* tokenizer = &tokenizer_;
    c.decode = [tokenizer](const std::vector<int32_t>& ids) { return tokenizer->Decode(ids); };
    p.anthropic = std::move(c);
    return p;
}

std::variant<std::string, ApiError> ApiService::CountTokensAnswer(std::string_view body) const {
    auto parsed = ParseAnthropic(AnthropicEndpoint::kCountTokens, body);
    if (auto* error = std::get_if<ApiError>(&parsed)) return *error;
    const AnthropicRequest& r = std::get<AnthropicRequest>(parsed);
    auto tools = ToolsFor(r.tools, r.tool_choice, false, "toolu_");
    if (auto* error = std::get_if<ApiError>(&tools)) return *error;
    const ChatTools& chat_tools =
        std::get<std::pair<ChatTools, std::optional<ToolCallParserOptions>>>(tools).first;
    auto encoded = EncodeChat(r.messages, /*add_generation_prompt=*/true,
                              /*add_special_tokens=*/true, &chat_tools);
    if (auto* error = std::get_if<ApiError>(&encoded)) {
        error->message = "messages: " + error->message;
        return *error;
    }
    return nlohmann::json{{"input_tokens", std::get<EncodedChat>(encoded).ids.size()}}.dump();
}

}  // namespace kvshard
