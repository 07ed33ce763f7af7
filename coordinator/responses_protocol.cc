#include "coordinator/responses_protocol.h"

#include <nlohmann/json.hpp>

#include "common/utf8.h"
#include "coordinator/json_fields.h"
#include "coordinator/structured_output.h"

namespace kvshard {

using nlohmann::json;
using json_fields::Field;
using json_fields::TypeName;

namespace {

struct Refusal {
    ApiError error;
};

[[noreturn]] void Fail(std::string message, std::string param) {
    throw Refusal{BadRequest(std::move(message), std::move(param))};
}

// The Responses API's own fields: read here, never handed to the chat parser.
constexpr const char* kResponsesFields[] = {
    "input",       "instructions",      "max_output_tokens", "store",
    "metadata",    "service_tier",      "parallel_tool_calls", "tool_choice",
    "text",        "truncation",        "safety_identifier", "prompt_cache_key",
    "stream_options", "user"};

// Fields of the Responses API kvshard does not implement, and chat-route fields that have
// another name here: refused by name, so that no client believes it was obeyed.
void RefuseUnimplemented(const json& body) {
    auto refuse_if_set = [&](const char* name, const std::string& why) {
        const json* v = Field(body, name);
        if (v == nullptr) return;
        const bool empty = (v->is_array() || v->is_object()) && v->empty();
        const bool off = v->is_boolean() && !v->get<bool>();
        if (!empty && !off) Fail("'" + std::string(name) + "' is not supported: " + why, name);
    };
    refuse_if_set("tools", "this route answers with text only (tool calls: /v1/chat/completions)");
    refuse_if_set("previous_response_id",
                  "this server keeps no responses; send the whole conversation as 'input'");
    refuse_if_set("conversation",
                  "this server keeps no conversations; send the whole conversation as 'input'");
    refuse_if_set("background", "responses are answered while the client waits");
    refuse_if_set("include", "no extra output items are produced");
    refuse_if_set("reasoning", "no reasoning models are served by this route");
    refuse_if_set("prompt", "stored prompt templates are not kept by this server");
    refuse_if_set("max_tool_calls", "this route answers with text only");
    refuse_if_set("top_logprobs", "logprobs are given by /v1/chat/completions");
    if (const json* store = Field(body, "store"); store != nullptr) {
        if (!store->is_boolean()) Fail("'store' must be a boolean, got " + TypeName(*store), "store");
        if (store->get<bool>()) {
            Fail("'store' true is not supported: this server keeps no responses (send false)",
                 "store");
        }
    }
    for (const char* chat_only : {"messages", "max_tokens", "max_completion_tokens", "logprobs",
                                  "response_format", "n", "best_of", "echo"}) {
        if (Field(body, chat_only) != nullptr) {
            const std::string name = chat_only;
            std::string hint;
            if (name == "max_tokens" || name == "max_completion_tokens") {
                hint = "; use 'max_output_tokens'";
            } else if (name == "messages") {
                hint = "; send them as 'input'";
            } else if (name == "response_format") {
                hint = "; the Responses API's is 'text.format'";
            }
            Fail("'" + name + "' is not a field of the Responses API" + hint, name);
        }
    }
    if (const json* t = Field(body, "truncation"); t && *t != "disabled") {
        Fail("'truncation' must be \"disabled\": a prompt longer than the context is refused, not cut",
             "truncation");
    }
    if (const json* text = Field(body, "text")) {
        if (!text->is_object()) Fail("'text' must be an object, got " + TypeName(*text), "text");
        for (const auto& [key, value] : text->items()) {
            if (key == "format") {
                continue;  // structured outputs: read with the chat request (ParseResponsesRequest)
            } else if (key == "verbosity") {
                if (!value.is_null() && value != "medium") {
                    Fail("'text.verbosity' is not supported (only \"medium\")", "text.verbosity");
                }
            } else {
                Fail("'text." + key + "' is not supported", "text." + key);
            }
        }
    }
    if (const json* choice = Field(body, "tool_choice");
        choice && *choice != "none" && *choice != "auto") {
        Fail("'tool_choice' must be \"none\" or \"auto\": this route offers no tools",
             "tool_choice");
    }
    if (const json* so = Field(body, "stream_options")) {
        if (!so->is_object()) Fail("'stream_options' must be an object", "stream_options");
        for (const auto& [key, value] : so->items()) {
            if (key == "include_obfuscation" && value.is_boolean() && !value.get<bool>()) continue;
            Fail("'stream_options." + key + "' is not supported (include_obfuscation: false only)",
                 "stream_options." + key);
        }
    }
}

// A message's content: a string, or input_text / output_text parts joined by "\n".
std::string ItemContent(const json& content, const std::string& param) {
    if (content.is_string()) return content.get<std::string>();
    if (!content.is_array()) {
        Fail("'" + param + "' must be a string or an array of text parts, got " +
                 TypeName(content),
             param);
    }
    std::string text;
    for (size_t i = 0; i < content.size(); ++i) {
        const json& part = content[i];
        const std::string at = param + "[" + std::to_string(i) + "]";
        const json* type = part.is_object() ? Field(part, "type") : nullptr;
        if (type == nullptr || !type->is_string()) {
            Fail("'" + at + "' must be an object with a 'type'", at);
        }
        if (*type != "input_text" && *type != "output_text") {
            Fail("only text content parts (input_text, output_text) are supported, got '" +
                     type->get<std::string>() + "'",
                 at + ".type");
        }
        const json* t = Field(part, "text");
        if (t == nullptr || !t->is_string()) Fail("'" + at + ".text' must be a string", at + ".text");
        if (i > 0) text += "\n";
        text += t->get<std::string>();
    }
    return text;
}

// input: a string (one user message) or a list of message items.
json InputMessages(const json& body, const std::optional<std::string>& instructions) {
    json messages = json::array();
    if (instructions) messages.push_back({{"role", "system"}, {"content", *instructions}});
    const json* input = Field(body, "input");
    if (input == nullptr) Fail("'input' is required", "input");
    if (input->is_string()) {
        messages.push_back({{"role", "user"}, {"content", *input}});
        return messages;
    }
    if (!input->is_array()) {
        Fail("'input' must be a string or an array of messages, got " + TypeName(*input), "input");
    }
    if (input->empty()) Fail("'input' must not be empty", "input");
    for (size_t i = 0; i < input->size(); ++i) {
        const json& item = (*input)[i];
        const std::string at = "input[" + std::to_string(i) + "]";
        if (!item.is_object()) Fail("'" + at + "' must be an object, got " + TypeName(item), at);
        if (const json* type = Field(item, "type"); type && *type != "message") {
            Fail("only message items are supported in 'input', got type " + type->dump(),
                 at + ".type");
        }
        const json* role = Field(item, "role");
        if (role == nullptr || !role->is_string()) {
            Fail("'" + at + ".role' must be a string", at + ".role");
        }
        const std::string& r = role->get_ref<const std::string&>();
        if (r != "user" && r != "assistant" && r != "system" && r != "developer") {
            Fail("'" + at + ".role' must be user, assistant, system or developer, got '" + r + "'",
                 at + ".role");
        }
        const json* content = Field(item, "content");
        if (content == nullptr) Fail("'" + at + ".content' is required", at + ".content");
        messages.push_back({{"role", r}, {"content", ItemContent(*content, at + ".content")}});
    }
    return messages;
}

}  // namespace

std::variant<ResponsesRequest, ApiError> ParseResponsesRequest(std::string_view body,
                                                               const ServedModel& model) {
    // Bodies that are not a JSON object get the chat route's answer (the same checks, the same
    // words): not UTF-8, a NUL byte, not JSON, not an object.
    const bool plain = IsValidUtf8(body) && body.find('\0') == std::string_view::npos;
    const json j = plain ? json_fields::ParseJson(body) : json();
    if (!plain || j.is_discarded() || !j.is_object()) {
        return std::get<ApiError>(ParseOpenAiRequest(ApiEndpoint::kChatCompletions, body, model));
    }
    ResponsesRequest out;
    json chat = json::object();
    try {
        RefuseUnimplemented(j);
        if (const json* v = Field(j, "instructions")) {
            if (!v->is_string()) {
                Fail("'instructions' must be a string, got " + TypeName(*v), "instructions");
            }
            out.instructions = v->get<std::string>();
        }
        if (const json* v = Field(j, "max_output_tokens")) {
            const std::optional<int64_t> n = json_fields::Integer(*v);
            if (!n) Fail("'max_output_tokens' must be an integer, got " + TypeName(*v),
                         "max_output_tokens");
            if (*n < 1) {
                Fail("'max_output_tokens' must be > 0, got " + std::to_string(*n),
                     "max_output_tokens");
            }
            out.max_output_tokens = *n;
        }
        if (const json* v = Field(j, "metadata")) {
            if (!v->is_object()) {
                Fail("'metadata' must be an object of strings, got " + TypeName(*v), "metadata");
            }
            for (const auto& [key, value] : v->items()) {
                if (!value.is_string()) {
                    Fail("'metadata." + key + "' must be a string", "metadata." + key);
                }
            }
            out.metadata = v->dump(-1, ' ', false, json::error_handler_t::replace);
        }
        for (const char* name : {"user", "safety_identifier", "prompt_cache_key", "service_tier"}) {
            const json* v = Field(j, name);
            if (v != nullptr && !v->is_string()) {
                Fail("'" + std::string(name) + "' must be a string, got " + TypeName(*v), name);
            }
        }
        if (const json* v = Field(j, "user")) out.user = v->get<std::string>();
        if (const json* v = Field(j, "service_tier")) out.service_tier = v->get<std::string>();
        if (const json* v = Field(j, "parallel_tool_calls")) {
            if (!v->is_boolean()) {
                Fail("'parallel_tool_calls' must be a boolean, got " + TypeName(*v),
                     "parallel_tool_calls");
            }
            out.parallel_tool_calls = v->get<bool>();
        }
        chat["messages"] = InputMessages(j, out.instructions);
    } catch (const Refusal& r) {
        return r.error;
    }
    // Everything else (model, temperature, top_p, stream, vLLM's sampling extensions) means
    // what it means on the chat route, and is checked there.
    for (const auto& [key, value] : j.items()) {
        bool own = false;
        for (const char* f : kResponsesFields) own |= key == f;
        if (!own) chat[key] = value;
    }
    ParsedRequest parsed = ParseOpenAiRequest(ApiEndpoint::kChatCompletions,
                                              chat.dump(-1, ' ', false,
                                                        json::error_handler_t::replace),
                                              model);
    if (auto* error = std::get_if<ApiError>(&parsed)) return *error;
    out.chat = std::move(std::get<OpenAiRequest>(parsed));
    out.chat.max_tokens = out.max_output_tokens;
    out.chat.max_tokens_param = "max_output_tokens";
    // Structured outputs: text.format holds the text to a schema as response_format does on chat.
    if (const json* text = Field(j, "text"); text != nullptr && Field(*text, "format") != nullptr) {
        const json& format = *Field(*text, "format");
        std::string param;
        Result<StructuredOutput> so = ReadTextFormat(format, &param);
        if (!so.ok()) return BadRequest(so.status().message(), param);
        if (so->grammar != nullptr) {
            if (out.chat.grammar != nullptr) {
                return BadRequest("'text.format' and vLLM's guided_* or structured_outputs both "
                                  "constrain the output; give one",
                                  "text.format");
            }
            out.chat.grammar = so->grammar;
        }
        out.text_format = format.dump(-1, ' ', false, json::error_handler_t::replace);
    }
    // The client's own numbers, not their float rounding.
    if (const json* t = Field(j, "temperature")) out.temperature = t->get<double>();
    if (const json* p = Field(j, "top_p")) out.top_p = p->get<double>();
    return out;
}

}  // namespace kvshard
