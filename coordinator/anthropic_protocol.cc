#include "coordinator/anthropic_protocol.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "common/utf8.h"
#include "coordinator/json_fields.h"

namespace kvshard {

using json_fields::Field;
using json_fields::Number;
using json_fields::TypeName;
using nlohmann::json;

std::string_view AnthropicErrorType(int http_status) {
    switch (http_status) {
        case 400:
        case 405:
        case 422:
            return "invalid_request_error";
        case 401:
            return "authentication_error";
        case 403:
            return "permission_error";
        case 404:
            return "not_found_error";
        case 413:
            return "request_too_large";
        case 429:
            return "rate_limit_error";
        case 503:
        case 529:
            return "overloaded_error";
        case 504:
            return "timeout_error";
        default:
            return http_status >= 500 ? "api_error" : "invalid_request_error";
    }
}

std::string AnthropicErrorBody(const ApiError& error) {
    const json body = {
        {"type", "error"},
        {"error", {{"type", AnthropicErrorType(error.http_status)}, {"message", error.message}}}};
    return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

constexpr int kMaxStopSequences = 16;
constexpr size_t kMaxToolNameBytes = 128;

// Thrown inside this file only, caught by ParseAnthropicRequest.
struct ValidationError {
    ApiError error;
};

// Anthropic's messages start with the field's path: "messages.0.content: ...".
[[noreturn]] void Fail(const std::string& param, const std::string& message) {
    throw ValidationError{BadRequest(param.empty() ? message : param + ": " + message, param)};
}

std::string Path(const std::string& base, const std::string& field) {
    return base.empty() ? field : base + "." + field;
}
std::string Path(const std::string& base, size_t index) {
    return base + "." + std::to_string(index);
}

const std::string& StringField(const json& object, const char* name, const std::string& base) {
    const json* v = Field(object, name);
    if (v == nullptr) Fail(Path(base, name), "Field required");
    if (!v->is_string()) Fail(Path(base, name), "must be a string, got " + TypeName(*v));
    return v->get_ref<const std::string&>();
}

std::optional<double> OptNumber(const json& body, const char* name) {
    const json* v = Field(body, name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) Fail(name, "must be a number, got " + TypeName(*v));
    return v->get<double>();
}

std::optional<int64_t> OptInt(const json& body, const char* name, int64_t min) {
    const json* v = Field(body, name);
    if (v == nullptr) return std::nullopt;
    const std::optional<int64_t> integer = json_fields::Integer(*v);
    if (!integer) Fail(name, "must be an integer, got " + TypeName(*v));
    const int64_t x = *integer;
    if (x < min)
        Fail(name, "must be at least " + std::to_string(min) + ", got " + std::to_string(x));
    return x;
}

std::optional<bool> OptBool(const json& object, const char* name, const std::string& base) {
    const json* v = Field(object, name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean()) Fail(Path(base, name), "must be a boolean, got " + TypeName(*v));
    return v->get<bool>();
}

class Parser {
  public:
    explicit Parser(AnthropicRequest& r) : r_(r) {}

    void Read(const json& body) {
        ReadMaxTokens(body);
        ReadTools(body);
        ReadToolChoice(body);
        ReadSystem(body);
        ReadMessages(body);
        // A top-level cache_control marks the last block of the request (Anthropic's automatic
        // caching): the end of the last message.
        if (const int64_t ttl = CacheControl(body, "")) {
            ChatMessage& last = r_.messages.back();
            last.cache_marks.push_back({last.content.size(), ttl});
        }
        ReadSampling(body);
        ReadStopSequences(body);
        ReadMisc(body);
        r_.num_cache_breakpoints = num_breakpoints_;
    }

  private:
    // cache_control of the block at `base`: the TTL of its breakpoint, or 0 when it has none.
    int64_t CacheControl(const json& block, const std::string& base) {
        const json* cc = Field(block, "cache_control");
        if (cc == nullptr) return 0;
        const std::string param = Path(base, "cache_control");
        if (!cc->is_object()) Fail(param, "must be an object, got " + TypeName(*cc));
        const std::string& type = StringField(*cc, "type", param);
        if (type != "ephemeral") {
            Fail(Path(param, "type"), "must be 'ephemeral', got '" + type + "'");
        }
        int64_t ttl_ms = kCacheTtl5mMs;
        if (const json* ttl = Field(*cc, "ttl")) {
            if (!ttl->is_string() || (*ttl != "5m" && *ttl != "1h")) {
                Fail(Path(param, "ttl"),
                     "must be '5m' or '1h', got " +
                         (ttl->is_string() ? "'" + ttl->get<std::string>() + "'" : TypeName(*ttl)));
            }
            if (*ttl == "1h") ttl_ms = kCacheTtl1hMs;
        }
        if (++num_breakpoints_ > kMaxCacheBreakpoints) {
            Fail(param, "a request may hold at most " + std::to_string(kMaxCacheBreakpoints) +
                            " blocks with cache_control; this is number " +
                            std::to_string(num_breakpoints_));
        }
        return ttl_ms;
    }

    void ReadMaxTokens(const json& body) {
        if (r_.endpoint == AnthropicEndpoint::kCountTokens) {
            OptInt(body, "max_tokens", 1);
            return;
        }
        std::optional<int64_t> max_tokens = OptInt(body, "max_tokens", 1);
        if (!max_tokens) Fail("max_tokens", "Field required");
        r_.max_tokens = *max_tokens;
    }

    // Text blocks (a string, or an array of {"type": "text"} blocks) appended to `content` with
    // "\n" between blocks; their breakpoints go to `marks`. `what` names the place in errors.
    void ReadTextBlocks(const json& value, const std::string& base, std::string& content,
                        std::vector<ChatCacheMark>& marks) {
        if (value.is_string()) {
            content += value.get<std::string>();
            r_.content_bytes += static_cast<int64_t>(value.get_ref<const std::string&>().size());
            return;
        }
        if (!value.is_array()) Fail(base, "must be a string or an array of text blocks");
        for (size_t i = 0; i < value.size(); ++i) {
            const json& block = value[i];
            const std::string param = Path(base, i);
            if (!block.is_object()) Fail(param, "must be an object, got " + TypeName(block));
            const std::string& type = StringField(block, "type", param);
            if (type != "text") {
                Fail(Path(param, "type"),
                     "only text blocks are supported here, got '" + type + "'");
            }
            AppendText(block, param, content, marks);
        }
    }

    void AppendText(const json& block, const std::string& param, std::string& content,
                    std::vector<ChatCacheMark>& marks) {
        const std::string& text = StringField(block, "text", param);
        if (!content.empty()) content += "\n";
        content += text;
        r_.content_bytes += static_cast<int64_t>(text.size());
        if (const int64_t ttl = CacheControl(block, param)) marks.push_back({content.size(), ttl});
    }

    void ReadSystem(const json& body) {
        const json* system = Field(body, "system");
        if (system == nullptr) return;
        ChatMessage m{"system", ""};
        ReadTextBlocks(*system, "system", m.content, m.cache_marks);
        r_.messages.push_back(std::move(m));
    }

    void ReadMessages(const json& body) {
        const json* v = Field(body, "messages");
        if (v == nullptr) Fail("messages", "Field required");
        if (!v->is_array()) Fail("messages", "must be an array, got " + TypeName(*v));
        if (v->empty()) Fail("messages", "must hold at least one message");
        std::set<std::string> previous_tool_uses;  // ids of the previous message's tool_use
        for (size_t i = 0; i < v->size(); ++i) {
            const json& m = (*v)[i];
            const std::string param = Path("messages", i);
            if (!m.is_object()) Fail(param, "must be an object, got " + TypeName(m));
            const std::string& role = StringField(m, "role", param);
            if (role != "user" && role != "assistant") {
                Fail(Path(param, "role"), "must be 'user' or 'assistant', got '" + role + "'");
            }
            const json* content = Field(m, "content");
            if (content == nullptr) Fail(Path(param, "content"), "Field required");
            std::set<std::string> tool_uses;
            if (role == "assistant") {
                ReadAssistant(*content, Path(param, "content"), tool_uses);
            } else {
                ReadUser(*content, Path(param, "content"), previous_tool_uses);
            }
            previous_tool_uses = std::move(tool_uses);
            if (i + 1 == v->size() && role == "assistant" &&
                r_.endpoint == AnthropicEndpoint::kMessages) {
                Fail(Path(param, "role"),
                     "a final assistant message (a prefill for the answer to continue) is not "
                     "supported; end with a user message");
            }
        }
    }

    [[noreturn]] void Unsupported(const std::string& param, const std::string& type) {
        Fail(Path(param, "type"), "content blocks of type '" + type +
                                      "' are not supported (text, tool_use and tool_result are)");
    }

    void ReadAssistant(const json& content, const std::string& base,
                       std::set<std::string>& tool_uses) {
        ChatMessage m{"assistant", ""};
        if (content.is_string()) {
            m.content = content.get<std::string>();
            r_.content_bytes += static_cast<int64_t>(m.content.size());
            r_.messages.push_back(std::move(m));
            return;
        }
        if (!content.is_array()) {
            Fail(base, "must be a string or an array of content blocks, got " + TypeName(content));
        }
        for (size_t j = 0; j < content.size(); ++j) {
            const json& block = content[j];
            const std::string param = Path(base, j);
            if (!block.is_object()) Fail(param, "must be an object, got " + TypeName(block));
            const std::string& type = StringField(block, "type", param);
            if (type == "text") {
                AppendText(block, param, m.content, m.cache_marks);
            } else if (type == "tool_use") {
                ChatToolCall call;
                call.id = StringField(block, "id", param);
                call.name = StringField(block, "name", param);
                const json* input = Field(block, "input");
                if (input == nullptr) Fail(Path(param, "input"), "Field required");
                if (!input->is_object()) {
                    Fail(Path(param, "input"), "must be an object, got " + TypeName(*input));
                }
                call.arguments = input->dump(-1, ' ', false, json::error_handler_t::replace);
                r_.content_bytes += static_cast<int64_t>(call.arguments.size() + call.name.size());
                call.cache_ttl_ms = CacheControl(block, param);
                if (!tool_uses.insert(call.id).second) {
                    Fail(Path(param, "id"), "the tool_use id '" + call.id + "' is used twice");
                }
                m.tool_calls.push_back(std::move(call));
            } else if (type == "tool_result") {
                Fail(Path(param, "type"), "tool_result blocks belong in user messages");
            } else {
                Unsupported(param, type);
            }
        }
        r_.messages.push_back(std::move(m));
    }

    void ReadUser(const json& content, const std::string& base,
                  const std::set<std::string>& previous_tool_uses) {
        ChatMessage text{"user", ""};
        if (content.is_string()) {
            text.content = content.get<std::string>();
            r_.content_bytes += static_cast<int64_t>(text.content.size());
            r_.messages.push_back(std::move(text));
            return;
        }
        if (!content.is_array()) {
            Fail(base, "must be a string or an array of content blocks, got " + TypeName(content));
        }
        bool any_text = false;
        for (size_t j = 0; j < content.size(); ++j) {
            const json& block = content[j];
            const std::string param = Path(base, j);
            if (!block.is_object()) Fail(param, "must be an object, got " + TypeName(block));
            const std::string& type = StringField(block, "type", param);
            if (type == "text") {
                AppendText(block, param, text.content, text.cache_marks);
                any_text = true;
            } else if (type == "tool_result") {
                ChatMessage result{"tool", ""};
                result.tool_call_id = StringField(block, "tool_use_id", param);
                if (previous_tool_uses.count(result.tool_call_id) == 0) {
                    Fail(Path(param, "tool_use_id"),
                         "the tool_result for '" + result.tool_call_id +
                             "' has no tool_use block with that id in the previous (assistant) "
                             "message; each tool_result answers a tool_use of the message "
                             "before it");
                }
                if (const json* c = Field(block, "content")) {
                    ReadTextBlocks(*c, Path(param, "content"), result.content, result.cache_marks);
                }
                // A failed tool's result says so to the model (Anthropic's is_error).
                if (OptBool(block, "is_error", param).value_or(false)) {
                    constexpr std::string_view kError = "Error: ";
                    result.content.insert(0, kError);
                    for (ChatCacheMark& mark : result.cache_marks)
                        mark.content_end += kError.size();
                }
                if (const int64_t ttl = CacheControl(block, param)) {
                    result.cache_marks.push_back({result.content.size(), ttl});
                }
                r_.messages.push_back(std::move(result));
            } else if (type == "tool_use") {
                Fail(Path(param, "type"), "tool_use blocks belong in assistant messages");
            } else {
                Unsupported(param, type);
            }
        }
        if (any_text || content.empty()) r_.messages.push_back(std::move(text));
    }

    void ReadTools(const json& body) {
        const json* tools = Field(body, "tools");
        if (tools == nullptr) return;
        if (!tools->is_array()) Fail("tools", "must be an array, got " + TypeName(*tools));
        std::set<std::string> names;
        for (size_t i = 0; i < tools->size(); ++i) {
            const json& t = (*tools)[i];
            const std::string param = Path("tools", i);
            if (!t.is_object()) Fail(param, "must be an object, got " + TypeName(t));
            if (const json* type = Field(t, "type"); type && *type != "custom") {
                Fail(Path(param, "type"),
                     "server tools are not supported (only client tools, type 'custom'), got " +
                         (type->is_string() ? "'" + type->get<std::string>() + "'"
                                            : TypeName(*type)));
            }
            ToolDefinition tool;
            tool.name = StringField(t, "name", param);
            bool name_ok = !tool.name.empty() && tool.name.size() <= kMaxToolNameBytes;
            for (const char c : tool.name) {
                name_ok &= (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                           (c >= '0' && c <= '9') || c == '_' || c == '-';
            }
            if (!name_ok) {
                Fail(Path(param, "name"),
                     "must be 1 to 128 letters, digits, '_' or '-', got '" + tool.name + "'");
            }
            if (!names.insert(tool.name).second) {
                Fail(Path(param, "name"), "the tool name '" + tool.name + "' is used twice");
            }
            if (const json* d = Field(t, "description")) {
                if (!d->is_string()) {
                    Fail(Path(param, "description"), "must be a string, got " + TypeName(*d));
                }
                tool.description = d->get<std::string>();
            }
            const json* schema = Field(t, "input_schema");
            if (schema == nullptr) Fail(Path(param, "input_schema"), "Field required");
            if (!schema->is_object()) {
                Fail(Path(param, "input_schema"), "must be an object, got " + TypeName(*schema));
            }
            tool.parameters = schema->dump(-1, ' ', false, json::error_handler_t::replace);
            tool.cache_ttl_ms = CacheControl(t, param);
            r_.content_bytes += static_cast<int64_t>(tool.name.size() + tool.description.size() +
                                                     tool.parameters.size());
            r_.tools.push_back(std::move(tool));
        }
    }

    void ReadToolChoice(const json& body) {
        const json* choice = Field(body, "tool_choice");
        if (choice == nullptr) return;
        if (!choice->is_object()) {
            Fail("tool_choice", "must be an object, got " + TypeName(*choice));
        }
        const std::string& type = StringField(*choice, "type", "tool_choice");
        if (type == "auto") {
            r_.tool_choice.mode = ToolChoiceMode::kAuto;
        } else if (type == "any") {
            r_.tool_choice.mode = ToolChoiceMode::kRequired;
        } else if (type == "none") {
            r_.tool_choice.mode = ToolChoiceMode::kNone;
        } else if (type == "tool") {
            r_.tool_choice.mode = ToolChoiceMode::kNamed;
            r_.tool_choice.name = StringField(*choice, "name", "tool_choice");
            bool known = false;
            for (const ToolDefinition& t : r_.tools) known |= t.name == r_.tool_choice.name;
            if (!known) {
                Fail("tool_choice.name",
                     "names no tool of this request: '" + r_.tool_choice.name + "'");
            }
        } else {
            Fail("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none', got '" + type + "'");
        }
        if ((r_.tool_choice.mode == ToolChoiceMode::kRequired ||
             r_.tool_choice.mode == ToolChoiceMode::kNamed) &&
            r_.tools.empty()) {
            Fail("tool_choice", "'" + type + "' needs tools");
        }
        r_.disable_parallel_tool_use =
            OptBool(*choice, "disable_parallel_tool_use", "tool_choice").value_or(false);
    }

    void ReadSampling(const json& body) {
        r_.sampling.temperature = 1.0f;
        if (auto t = OptNumber(body, "temperature")) {
            if (*t < 0 || *t > 1) Fail("temperature", "must be in [0, 1], got " + Number(*t));
            r_.sampling.temperature = static_cast<float>(*t);
        }
        if (auto p = OptNumber(body, "top_p")) {
            if (!(*p > 0 && *p <= 1)) Fail("top_p", "must be in (0, 1], got " + Number(*p));
            r_.sampling.top_p = static_cast<float>(*p);
        }
        if (auto k = OptInt(body, "top_k", 0)) {
            r_.sampling.top_k = static_cast<int>(std::min<int64_t>(*k, INT32_MAX));
        }
    }

    void ReadStopSequences(const json& body) {
        const json* v = Field(body, "stop_sequences");
        if (v == nullptr) return;
        if (!v->is_array()) Fail("stop_sequences", "must be an array of strings");
        if (v->size() > kMaxStopSequences) {
            Fail("stop_sequences", "holds at most " + std::to_string(kMaxStopSequences) +
                                       " strings, got " + std::to_string(v->size()));
        }
        for (size_t i = 0; i < v->size(); ++i) {
            const json& s = (*v)[i];
            const std::string param = Path("stop_sequences", i);
            if (!s.is_string()) Fail(param, "must be a string, got " + TypeName(s));
            if (s.get_ref<const std::string&>().empty()) Fail(param, "must not be empty");
            r_.stop_sequences.push_back(s.get<std::string>());
        }
    }

    void ReadMisc(const json& body) {
        r_.stream = OptBool(body, "stream", "").value_or(false);
        if (r_.stream && r_.endpoint == AnthropicEndpoint::kCountTokens) {
            Fail("stream", "count_tokens does not stream");
        }
        if (const json* metadata = Field(body, "metadata")) {
            if (!metadata->is_object()) {
                Fail("metadata", "must be an object, got " + TypeName(*metadata));
            }
            for (auto it = metadata->begin(); it != metadata->end(); ++it) {
                if (it.key() != "user_id") {
                    Fail("metadata." + it.key(), "is not a known metadata field (only user_id)");
                }
                if (!it->is_null() && !it->is_string()) {
                    Fail("metadata.user_id", "must be a string, got " + TypeName(*it));
                }
            }
        }
        if (const json* thinking = Field(body, "thinking")) {
            if (!thinking->is_object() || thinking->value("type", json()) != "disabled") {
                Fail("thinking",
                     "extended thinking is not supported (only {\"type\": \"disabled\"})");
            }
        }
        if (const json* tier = Field(body, "service_tier");
            tier && *tier != "auto" && *tier != "standard_only") {
            Fail("service_tier", "must be 'auto' or 'standard_only'");
        }
        for (const char* name :
             {"mcp_servers", "container", "context_management", "output_config"}) {
            if (const json* v = Field(body, name);
                v && !((v->is_array() || v->is_object()) && v->empty())) {
                Fail(name, "is not supported");
            }
        }
    }

    AnthropicRequest& r_;
    int num_breakpoints_ = 0;
};

}  // namespace

std::variant<AnthropicRequest, ApiError> ParseAnthropicRequest(AnthropicEndpoint endpoint,
                                                               std::string_view body,
                                                               const ServedModel& model) {
    if (!IsValidUtf8(body)) return BadRequest("the request body is not valid UTF-8");
    if (const size_t nul = body.find('\0'); nul != std::string_view::npos) {
        return BadRequest("the request body holds a NUL byte (at byte " + std::to_string(nul) +
                          "); JSON text cannot contain one");
    }
    AnthropicRequest r;
    r.endpoint = endpoint;
    try {
        bool too_deep = false;
        const json j = json_fields::ParseJson(body, &too_deep);
        if (too_deep)
            return BadRequest("the request body nests arrays and objects deeper than " +
                              std::to_string(json_fields::kMaxJsonDepth) + " levels");
        if (j.is_discarded()) return BadRequest("the request body is not valid JSON");
        if (!j.is_object()) {
            return BadRequest("the request body must be a JSON object, got " + TypeName(j));
        }
        if (const json* m = Field(j, "model")) {
            if (!m->is_string()) return BadRequest("model: must be a string", "model");
            if (!ServesModel(model, m->get_ref<const std::string&>())) {
                ApiError e = ModelNotFound(model, m->get_ref<const std::string&>());
                e.message = "model: " + e.message;
                return e;
            }
        }
        Parser(r).Read(j);
    } catch (const ValidationError& e) {
        return e.error;
    } catch (const json::exception&) {
        return BadRequest("the request body could not be read");
    }
    return r;
}

}  // namespace kvshard
