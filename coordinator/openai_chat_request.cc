#include "coordinator/openai_chat_request.h"

#include <algorithm>
#include <limits>
#include <set>

#include "coordinator/anthropic_protocol.h"
#include "coordinator/json_fields.h"
#include "coordinator/openai_request_fields.h"

namespace kvshard::openai_request {

using json_fields::Field;
using json_fields::TypeName;
using nlohmann::json;

namespace {

constexpr int kMaxChatTopLogprobs = 20;

std::string MessageContent(const json& content, const std::string& param) {
    if (content.is_string()) return content.get<std::string>();
    if (content.is_null()) Fail("'" + param + "' must not be null", param);
    if (!content.is_array()) {
        Fail("'" + param + "' must be a string or an array of text parts, got " + TypeName(content),
             param);
    }
    std::string text;
    for (size_t i = 0; i < content.size(); ++i) {
        const json& part = content[i];
        const std::string part_param = param + "[" + std::to_string(i) + "]";
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
            Fail("'" + part_param + "' must be an object with a 'type'", part_param);
        }
        if (part["type"] != "text") {
            Fail("only text content parts are supported, got type '" +
                     part["type"].get<std::string>() + "'",
                 part_param);
        }
        if (!part.contains("text") || !part["text"].is_string()) {
            Fail("'" + part_param + ".text' must be a string", part_param + ".text");
        }
        if (i > 0) text += "\n";
        text += part["text"].get<std::string>();
    }
    return text;
}

// An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
// "arguments": "<a JSON object>"}}].
void ReadToolCalls(const json& m, const std::string& param, ChatMessage& out) {
    const json* calls = Field(m, "tool_calls");
    if (calls == nullptr) return;
    const std::string p = param + ".tool_calls";
    if (!calls->is_array()) Fail("'" + p + "' must be an array, got " + TypeName(*calls), p);
    for (size_t j = 0; j < calls->size(); ++j) {
        const json& c = (*calls)[j];
        const std::string cp = p + "[" + std::to_string(j) + "]";
        if (!c.is_object()) Fail("'" + cp + "' must be an object, got " + TypeName(c), cp);
        if (const json* type = Field(c, "type"); type && *type != "function") {
            Fail("'" + cp + ".type' must be \"function\"", cp + ".type");
        }
        const json* id = OptString(c, "id");
        if (id == nullptr) Fail("'" + cp + ".id' is required", cp + ".id");
        const json* fn = Field(c, "function");
        if (fn == nullptr || !fn->is_object()) {
            Fail("'" + cp + ".function' must be an object", cp + ".function");
        }
        const json* name = OptString(*fn, "name");
        if (name == nullptr) Fail("'" + cp + ".function.name' is required", cp + ".function.name");
        ChatToolCall call;
        call.id = id->get<std::string>();
        call.name = name->get<std::string>();
        if (const json* args = OptString(*fn, "arguments")) {
            bool too_deep = false;
            const json parsed = json_fields::ParseJson(args->get<std::string>(), &too_deep);
            if (too_deep) {
                Fail("'" + cp + ".function.arguments' nests deeper than " +
                         std::to_string(json_fields::kMaxJsonDepth) + " levels",
                     cp + ".function.arguments");
            }
            if (parsed.is_discarded() || !parsed.is_object()) {
                Fail("'" + cp + ".function.arguments' must be a JSON object (as a string)",
                     cp + ".function.arguments");
            }
            call.arguments = parsed.dump(-1, ' ', false, json::error_handler_t::replace);
        }
        out.tool_calls.push_back(std::move(call));
    }
}

// cache_control on a chat message or on one of its text parts (the prompt-caching extension
// OpenRouter and LiteLLM send, with Anthropic's meaning; docs/prompt-caching.md): a breakpoint
// after that text. {"type": "ephemeral"} with an optional "ttl" of "5m" (the default) or "1h";
// at most kMaxCacheBreakpoints in a request. The TTL, or 0 when `holder` has none.
int64_t CacheControlTtl(const json& holder, const std::string& param, int* count) {
    const json* cc = Field(holder, "cache_control");
    if (cc == nullptr) return 0;
    const std::string at = param + ".cache_control";
    if (!cc->is_object()) Fail("'" + at + "' must be an object, got " + TypeName(*cc), at);
    const json* type = Field(*cc, "type");
    if (type == nullptr || *type != "ephemeral") {
        Fail("'" + at + ".type' must be \"ephemeral\"", at + ".type");
    }
    int64_t ttl_ms = kCacheTtl5mMs;
    if (const json* ttl = Field(*cc, "ttl")) {
        if (!ttl->is_string() || (*ttl != "5m" && *ttl != "1h")) {
            Fail("'" + at + ".ttl' must be \"5m\" or \"1h\"", at + ".ttl");
        }
        if (*ttl == "1h") ttl_ms = kCacheTtl1hMs;
    }
    if (++*count > kMaxCacheBreakpoints) {
        Fail("a request may mark at most " + std::to_string(kMaxCacheBreakpoints) +
                 " cache_control breakpoints; '" + at + "' is number " + std::to_string(*count),
             at);
    }
    return ttl_ms;
}

// The cache marks of message `m` (already parsed into `message`): after each text part that
// carries cache_control (parts are joined by "\n", as MessageContent joins them), and at the end
// for one on the message itself.
void ReadCacheMarks(const json& m, const std::string& param, ChatMessage& message, int* count) {
    auto content = m.find("content");
    if (content != m.end() && content->is_array()) {
        size_t end = 0;
        for (size_t i = 0; i < content->size(); ++i) {
            const json& part = (*content)[i];
            if (!part.is_object()) continue;
            if (const json* text = Field(part, "text"); text != nullptr && text->is_string()) {
                end += (i > 0 ? 1 : 0) + text->get_ref<const std::string&>().size();
            }
            const std::string part_param = param + ".content[" + std::to_string(i) + "]";
            if (const int64_t ttl = CacheControlTtl(part, part_param, count)) {
                message.cache_marks.push_back({std::min(end, message.content.size()), ttl});
            }
        }
    }
    if (const int64_t ttl = CacheControlTtl(m, param, count)) {
        message.cache_marks.push_back({message.content.size(), ttl});
    }
}

// tools: [{"type": "function", "function": {"name", "description", "parameters"}}];
// tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name"}};
// parallel_tool_calls. Calls are asked for in the prompt and parsed from the output
// (tool_calls.h): "strict" schemas, which need constrained decoding, are refused.
void ReadTools(const json& body, OpenAiRequest& r) {
    if (const json* tools = Field(body, "tools")) {
        if (!tools->is_array()) Fail("'tools' must be an array, got " + TypeName(*tools), "tools");
        for (size_t i = 0; i < tools->size(); ++i) {
            const json& t = (*tools)[i];
            const std::string param = "tools[" + std::to_string(i) + "]";
            if (!t.is_object())
                Fail("'" + param + "' must be an object, got " + TypeName(t), param);
            if (const json* type = Field(t, "type"); type && *type != "function") {
                Fail("only function tools are supported ('" + param + ".type')", param + ".type");
            }
            const json* fn = Field(t, "function");
            if (fn == nullptr || !fn->is_object()) {
                Fail("'" + param + ".function' must be an object", param + ".function");
            }
            ToolDefinition tool;
            const json* name = OptString(*fn, "name");
            if (name == nullptr) {
                Fail("'" + param + ".function.name' is required", param + ".function.name");
            }
            tool.name = name->get<std::string>();
            bool ok = !tool.name.empty() && tool.name.size() <= 64;
            for (const char c : tool.name) {
                ok &= (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '_' || c == '-';
            }
            if (!ok) {
                Fail("'" + param + ".function.name' must be 1 to 64 letters, digits, '_' or '-'",
                     param + ".function.name");
            }
            for (const ToolDefinition& other : r.tools) {
                if (other.name == tool.name) {
                    Fail("the tool name '" + tool.name + "' is used twice",
                         param + ".function.name");
                }
            }
            if (const json* d = OptString(*fn, "description"))
                tool.description = d->get<std::string>();
            if (const json* p = Field(*fn, "parameters")) {
                if (!p->is_object()) {
                    Fail("'" + param + ".function.parameters' must be a JSON Schema object",
                         param + ".function.parameters");
                }
                tool.parameters = p->dump(-1, ' ', false, json::error_handler_t::replace);
            }
            tool.strict = OptBool(*fn, "strict").value_or(false);
            r.tools.push_back(std::move(tool));
        }
    }
    if (const json* choice = Field(body, "tool_choice")) {
        if (choice->is_string()) {
            const std::string& c = choice->get_ref<const std::string&>();
            if (c == "none") {
                r.tool_choice.mode = ToolChoiceMode::kNone;
            } else if (c == "auto") {
                r.tool_choice.mode = ToolChoiceMode::kAuto;
            } else if (c == "required") {
                r.tool_choice.mode = ToolChoiceMode::kRequired;
            } else {
                Fail("'tool_choice' must be \"none\", \"auto\", \"required\" or a function, got '" +
                         c + "'",
                     "tool_choice");
            }
        } else if (choice->is_object()) {
            const json* fn = Field(*choice, "function");
            const json* name = fn != nullptr && fn->is_object() ? OptString(*fn, "name") : nullptr;
            if (name == nullptr) {
                Fail("'tool_choice.function.name' is required", "tool_choice.function.name");
            }
            r.tool_choice = {ToolChoiceMode::kNamed, name->get<std::string>()};
            bool known = false;
            for (const ToolDefinition& t : r.tools) known |= t.name == r.tool_choice.name;
            if (!known) {
                Fail("'tool_choice' names no tool of this request: '" + r.tool_choice.name + "'",
                     "tool_choice");
            }
        } else {
            Fail("'tool_choice' must be a string or an object, got " + TypeName(*choice),
                 "tool_choice");
        }
        if (r.tools.empty() && (r.tool_choice.mode == ToolChoiceMode::kRequired ||
                                r.tool_choice.mode == ToolChoiceMode::kNamed)) {
            Fail("'tool_choice' asks for a tool call, and there are no 'tools'", "tool_choice");
        }
    }
    r.parallel_tool_calls = OptBool(body, "parallel_tool_calls").value_or(true);
}

}  // namespace

void ReadMessages(const json& body, std::vector<ChatMessage>& messages) {
    int num_cache_marks = 0;
    const json* v = Field(body, "messages");
    if (v == nullptr) Fail("'messages' is required", "messages");
    if (!v->is_array()) Fail("'messages' must be an array, got " + TypeName(*v), "messages");
    if (v->empty()) Fail("'messages' must not be empty", "messages");
    std::set<std::string> tool_call_ids;  // of the assistant messages so far
    for (size_t i = 0; i < v->size(); ++i) {
        const json& m = (*v)[i];
        const std::string param = "messages[" + std::to_string(i) + "]";
        if (!m.is_object()) Fail("'" + param + "' must be an object, got " + TypeName(m), param);
        auto role = m.find("role");
        if (role == m.end() || !role->is_string()) {
            Fail("'" + param + ".role' must be a string", param + ".role");
        }
        const std::string& name = role->get_ref<const std::string&>();
        if (name != "system" && name != "developer" && name != "user" && name != "assistant" &&
            name != "tool") {
            Fail("'" + param + ".role' must be system, developer, user, assistant or tool, got '" +
                     name + "'",
                 param + ".role");
        }
        ChatMessage message;
        // OpenAI's "developer" messages are the system instructions of newer models; the chat
        // templates know them as "system".
        message.role = name == "developer" ? "system" : name;
        if (name == "assistant") ReadToolCalls(m, param, message);
        auto content = m.find("content");
        if (content == m.end()) {
            if (message.tool_calls.empty()) {
                Fail("'" + param + ".content' is required", param + ".content");
            }
        } else if (!(content->is_null() && !message.tool_calls.empty())) {
            message.content = MessageContent(*content, param + ".content");
        }
        for (const ChatToolCall& call : message.tool_calls) tool_call_ids.insert(call.id);
        if (name == "tool") {
            const json* id = OptString(m, "tool_call_id");
            if (id == nullptr) {
                Fail("'" + param + ".tool_call_id' is required", param + ".tool_call_id");
            }
            message.tool_call_id = id->get<std::string>();
            if (tool_call_ids.count(message.tool_call_id) == 0) {
                Fail("'" + param + ".tool_call_id' ('" + message.tool_call_id +
                         "') answers no tool call of an earlier assistant message",
                     param + ".tool_call_id");
            }
        }
        messages.push_back(std::move(message));
        ReadCacheMarks(m, param, messages.back(), &num_cache_marks);
    }
}

void ReadChat(const json& body, OpenAiRequest& r) {
    ReadMessages(body, r.messages);
    r.max_tokens = OptInt(body, "max_completion_tokens", 1, std::numeric_limits<int64_t>::max(),
                          "must be > 0");
    if (auto legacy =
            OptInt(body, "max_tokens", 1, std::numeric_limits<int64_t>::max(), "must be > 0");
        legacy && !r.max_tokens) {
        r.max_tokens = legacy;
    } else if (r.max_tokens) {
        r.max_tokens_param = "max_completion_tokens";
    }
    const bool logprobs = OptBool(body, "logprobs").value_or(false);
    auto top = OptInt(body, "top_logprobs", 0, kMaxChatTopLogprobs, "must be in 0..20");
    if (top && !logprobs) Fail("'top_logprobs' needs 'logprobs' set to true", "top_logprobs");
    if (logprobs) r.num_top_logprobs = static_cast<int32_t>(top.value_or(0));
    r.add_generation_prompt = OptBool(body, "add_generation_prompt").value_or(true);
    ReadTools(body, r);
}

}  // namespace kvshard::openai_request
