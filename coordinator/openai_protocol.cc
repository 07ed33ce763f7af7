#include "coordinator/openai_protocol.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "common/utf8.h"
#include "coordinator/anthropic_protocol.h"
#include "coordinator/json_fields.h"
#include "coordinator/structured_output.h"

namespace kvshard {

using json_fields::Field;
using json_fields::Number;
using json_fields::TypeName;
using nlohmann::json;

std::string ApiErrorBody(const ApiError& error) {
    json e;
    e["message"] = error.message;
    e["type"] = error.type;
    e["param"] = error.param.empty() ? json(nullptr) : json(error.param);
    e["code"] = error.code.empty() ? json(nullptr) : json(error.code);
    return json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

ApiError BadRequest(std::string message, std::string param, std::string code) {
    ApiError e;
    e.http_status = 400;
    e.message = std::move(message);
    e.param = std::move(param);
    e.code = std::move(code);
    return e;
}

namespace {

constexpr int kMaxStopStrings = 4;
constexpr int kMaxChoices = 16;
// Completions with a list of prompts: prompts, and choices over all of them, at most.
constexpr size_t kMaxPrompts = 256;
constexpr int64_t kMaxPromptChoices = 1024;
constexpr int kMaxCompletionLogprobs = 20;  // vLLM's bound (OpenAI's is 5)
constexpr size_t kMaxLogitBias = 1024;
constexpr size_t kMaxStopTokenIds = 64;
constexpr int kMaxChatTopLogprobs = 20;
constexpr int64_t kDefaultCompletionMaxTokens = 16;

// Thrown inside this file only, caught by ParseOpenAiRequest: keeps each field's check one line.
struct ValidationError {
    ApiError error;
};

[[noreturn]] void Fail(std::string message, std::string param) {
    throw ValidationError{BadRequest(std::move(message), std::move(param))};
}

// Finds where a body that is not JSON goes wrong, without the parser's own words: the byte
// offset, and whether the trouble is a number too large for a double (nlohmann error 406).
class JsonErrorLocator : public nlohmann::json_sax<json> {
  public:
    bool null() override { return true; }
    bool boolean(bool) override { return true; }
    bool number_integer(number_integer_t) override { return true; }
    bool number_unsigned(number_unsigned_t) override { return true; }
    bool number_float(number_float_t, const string_t&) override { return true; }
    bool string(string_t&) override { return true; }
    bool binary(binary_t&) override { return true; }
    bool start_object(std::size_t) override { return true; }
    bool key(string_t&) override { return true; }
    bool end_object() override { return true; }
    bool start_array(std::size_t) override { return true; }
    bool end_array() override { return true; }
    bool parse_error(std::size_t position, const std::string&,
                     const nlohmann::detail::exception& e) override {
        position_ = position;
        number_too_large_ = e.id == 406;
        return false;
    }

    std::size_t position() const { return position_; }
    bool number_too_large() const { return number_too_large_; }

  private:
    std::size_t position_ = 0;
    bool number_too_large_ = false;
};

ApiError NotJson(std::string_view body) {
    JsonErrorLocator locator;
    try {
        json::sax_parse(body, &locator);
    } catch (const json::exception&) {
        // The locator never throws; a parser that does still gets the plain answer below.
    }
    const std::string at = " (at byte " + std::to_string(locator.position()) + ")";
    if (locator.number_too_large()) {
        return BadRequest("the request body holds a number too large for a double" + at, "",
                          "invalid_json");
    }
    return BadRequest("the request body is not valid JSON" + at, "", "invalid_json");
}

std::optional<int64_t> OptInt(const json& body, const char* name, int64_t min, int64_t max,
                              std::string_view rule) {
    const json* v = Field(body, name);
    if (v == nullptr) return std::nullopt;
    const std::optional<int64_t> integer = json_fields::Integer(*v);
    if (!integer) Fail(std::string("'") + name + "' must be an integer, got " + TypeName(*v), name);
    const int64_t x = *integer;
    if (x < min || x > max) {
        Fail(std::string("'") + name + "' " + std::string(rule) + ", got " + std::to_string(x),
             name);
    }
    return x;
}

std::optional<double> OptNumber(const json& body, const char* name) {
    const json* v = Field(body, name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number())
        Fail(std::string("'") + name + "' must be a number, got " + TypeName(*v), name);
    return v->get<double>();
}

std::optional<bool> OptBool(const json& body, const char* name) {
    const json* v = Field(body, name);
    if (v == nullptr) return std::nullopt;
    if (!v->is_boolean())
        Fail(std::string("'") + name + "' must be a boolean, got " + TypeName(*v), name);
    return v->get<bool>();
}

const json* OptString(const json& body, const char* name) {
    const json* v = Field(body, name);
    if (v != nullptr && !v->is_string()) {
        Fail(std::string("'") + name + "' must be a string, got " + TypeName(*v), name);
    }
    return v;
}

std::string BaseName(const std::string& path) {
    std::string p = path;
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    const size_t slash = p.rfind('/');
    return slash == std::string::npos ? p : p.substr(slash + 1);
}

void ReadModel(const json& body, const ServedModel& model) {
    const json* v = OptString(body, "model");
    if (v == nullptr) return;  // absent: the one model served
    const std::string& name = v->get_ref<const std::string&>();
    if (!ServesModel(model, name)) throw ValidationError{ModelNotFound(model, name)};
}

// One prompt of a completion: a non-empty string or a non-empty array of token ids.
void ReadOnePrompt(const json& p, const ServedModel& model, const std::string& where,
                   std::string& text, std::vector<int32_t>& ids, bool& is_token_ids) {
    if (p.is_string()) {
        text = p.get<std::string>();
        // Whatever the model's add_bos, an empty prompt asks for nothing (docs/http_api.md).
        if (text.empty()) Fail("'" + where + "' must not be empty", "prompt");
        return;
    }
    if (!p.is_array()) {
        Fail("'" + where + "' must be a string or an array of token ids, got " + TypeName(p),
             "prompt");
    }
    if (p.empty()) Fail("'" + where + "' must not be empty", "prompt");
    for (const json& t : p) {
        if (!t.is_number_integer()) {
            Fail("'" + where +
                     "' must be a string or an array of token ids, not an array holding " +
                     TypeName(t),
                 "prompt");
        }
        const int64_t id = t.get<int64_t>();
        if (id < 0 || id >= model.vocab_size) {
            Fail("token id " + std::to_string(id) + " in '" + where +
                     "' is outside the vocabulary (0.." + std::to_string(model.vocab_size - 1) +
                     ")",
                 "prompt");
        }
        ids.push_back(static_cast<int32_t>(id));
    }
    is_token_ids = true;
}

// prompt: "text", [1, 2, 3], or a list of prompts: ["a", "b"] or [[1, 2], [3]] (at most
// kMaxPrompts; their choices together at most kMaxPromptChoices).
void ReadPrompt(const json& body, const ServedModel& model, OpenAiRequest& r) {
    const json* v = Field(body, "prompt");
    if (v == nullptr) Fail("'prompt' is required", "prompt");
    const bool list = v->is_array() && !v->empty() && ((*v)[0].is_string() || (*v)[0].is_array());
    if (!list) {
        ReadOnePrompt(*v, model, "prompt", r.prompt, r.prompt_token_ids, r.prompt_is_token_ids);
        return;
    }
    if (v->size() > kMaxPrompts) {
        Fail("'prompt' holds at most " + std::to_string(kMaxPrompts) + " prompts, got " +
                 std::to_string(v->size()),
             "prompt");
    }
    const bool strings = (*v)[0].is_string();
    for (size_t i = 0; i < v->size(); ++i) {
        const json& p = (*v)[i];
        const std::string param = "prompt[" + std::to_string(i) + "]";
        if (p.is_string() != strings || !(p.is_string() || p.is_array())) {
            Fail("'prompt' must be a list of strings or a list of token-id arrays, not a mix ('" +
                     param + "' is " + TypeName(p) + ")",
                 "prompt");
        }
        if (i == 0) {
            ReadOnePrompt(p, model, param, r.prompt, r.prompt_token_ids, r.prompt_is_token_ids);
            continue;
        }
        OpenAiRequest::MorePrompt more;
        ReadOnePrompt(p, model, param, more.text, more.token_ids, more.is_token_ids);
        r.more_prompts.push_back(std::move(more));
    }
}

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

void ReadStop(const json& body, OpenAiRequest& r) {
    const json* v = Field(body, "stop");
    if (v == nullptr) return;
    if (v->is_string()) {
        r.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
        if (v->size() > kMaxStopStrings) {
            Fail("'stop' holds at most " + std::to_string(kMaxStopStrings) + " strings, got " +
                     std::to_string(v->size()),
                 "stop");
        }
        for (const json& s : *v) {
            if (!s.is_string()) Fail("'stop' must be a string or an array of strings", "stop");
            r.stop.push_back(s.get<std::string>());
        }
    } else {
        Fail("'stop' must be a string or an array of strings, got " + TypeName(*v), "stop");
    }
    for (const std::string& s : r.stop) {
        if (s.empty()) Fail("'stop' strings must not be empty", "stop");
    }
}

void ReadSampling(const json& body, OpenAiRequest& r) {
    r.sampling.temperature = 1.0f;
    if (auto t = OptNumber(body, "temperature")) {
        if (*t < 0 || *t > 2)
            Fail("'temperature' must be in [0, 2], got " + Number(*t), "temperature");
        r.sampling.temperature = static_cast<float>(*t);
    }
    if (auto p = OptNumber(body, "top_p")) {
        if (!(*p > 0 && *p <= 1)) Fail("'top_p' must be in (0, 1], got " + Number(*p), "top_p");
        r.sampling.top_p = static_cast<float>(*p);
    }
    if (auto k = OptInt(body, "top_k", -1, std::numeric_limits<int32_t>::max(),
                        "must be -1 or 0 (off) or a positive count")) {
        r.sampling.top_k = *k <= 0 ? 0 : static_cast<int>(*k);
    }
    if (auto m = OptNumber(body, "min_p")) {
        if (*m < 0 || *m > 1) Fail("'min_p' must be in [0, 1], got " + Number(*m), "min_p");
        r.sampling.min_p = static_cast<float>(*m);
    }
    if (auto s = OptInt(body, "seed", std::numeric_limits<int64_t>::min(),
                        std::numeric_limits<int64_t>::max(), "")) {
        r.sampling.seed = static_cast<uint64_t>(*s);
        r.has_seed = true;
    }
    if (auto x = OptNumber(body, "presence_penalty")) {
        if (*x < -2 || *x > 2)
            Fail("'presence_penalty' must be in [-2, 2], got " + Number(*x), "presence_penalty");
        r.sampling.presence_penalty = static_cast<float>(*x);
    }
    if (auto x = OptNumber(body, "frequency_penalty")) {
        if (*x < -2 || *x > 2)
            Fail("'frequency_penalty' must be in [-2, 2], got " + Number(*x), "frequency_penalty");
        r.sampling.frequency_penalty = static_cast<float>(*x);
    }
    if (auto x = OptNumber(body, "repetition_penalty")) {
        if (!(*x > 0 && *x <= 10)) {
            Fail("'repetition_penalty' must be in (0, 10] (1: off), got " + Number(*x),
                 "repetition_penalty");
        }
        r.sampling.repetition_penalty = static_cast<float>(*x);
    }
    if (auto m =
            OptInt(body, "min_tokens", 0, std::numeric_limits<int64_t>::max(), "must be >= 0")) {
        r.sampling.min_tokens = *m;
    }
}

// logit_bias: {"<token id>": bias in [-100, 100], ...}, as OpenAI defines it.
void ReadLogitBias(const json& body, const ServedModel& model, OpenAiRequest& r) {
    const json* b = Field(body, "logit_bias");
    if (b == nullptr) return;
    if (!b->is_object()) {
        Fail("'logit_bias' must be an object of token ids to biases, got " + TypeName(*b),
             "logit_bias");
    }
    if (b->size() > kMaxLogitBias) {
        Fail("'logit_bias' holds at most " + std::to_string(kMaxLogitBias) + " tokens, got " +
                 std::to_string(b->size()),
             "logit_bias");
    }
    for (const auto& [key, value] : b->items()) {
        int64_t id = -1;
        const bool digits = !key.empty() && key.size() <= 10 &&
                            key.find_first_not_of("0123456789") == std::string::npos;
        if (digits) id = std::stoll(key);
        if (!digits || id >= model.vocab_size) {
            Fail("'logit_bias' key '" + key + "' is not a token id of the vocabulary (0.." +
                     std::to_string(model.vocab_size - 1) + ")",
                 "logit_bias");
        }
        if (!value.is_number() || value.get<double>() < -100 || value.get<double>() > 100) {
            Fail("'logit_bias' value for token " + key + " must be a number in [-100, 100]",
                 "logit_bias");
        }
        r.sampling.logit_bias.push_back({static_cast<int32_t>(id), value.get<float>()});
    }
    std::sort(r.sampling.logit_bias.begin(), r.sampling.logit_bias.end(),
              [](const TokenBias& a, const TokenBias& b) { return a.token_id < b.token_id; });
    for (size_t i = 1; i < r.sampling.logit_bias.size(); ++i) {
        if (r.sampling.logit_bias[i].token_id == r.sampling.logit_bias[i - 1].token_id) {
            Fail("'logit_bias' names token " + std::to_string(r.sampling.logit_bias[i].token_id) +
                     " twice",
                 "logit_bias");
        }
    }
}

// vLLM's output controls: stop_token_ids, include_stop_str_in_output, skip_special_tokens.
void ReadOutputControls(const json& body, const ServedModel& model, OpenAiRequest& r) {
    if (const json* ids = Field(body, "stop_token_ids")) {
        if (!ids->is_array()) {
            Fail("'stop_token_ids' must be an array of token ids, got " + TypeName(*ids),
                 "stop_token_ids");
        }
        if (ids->size() > kMaxStopTokenIds) {
            Fail("'stop_token_ids' holds at most " + std::to_string(kMaxStopTokenIds) +
                     " ids, got " + std::to_string(ids->size()),
                 "stop_token_ids");
        }
        for (const json& t : *ids) {
            if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
                t.get<int64_t>() >= model.vocab_size) {
                Fail("'stop_token_ids' must hold token ids of the vocabulary (0.." +
                         std::to_string(model.vocab_size - 1) + ")",
                     "stop_token_ids");
            }
            r.stop_token_ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
        }
    }
    r.include_stop_str_in_output = OptBool(body, "include_stop_str_in_output").value_or(false);
    r.skip_special_tokens = OptBool(body, "skip_special_tokens").value_or(true);
}

// Options of vLLM's and OpenAI's APIs that kvshard does not implement: refused by name rather
// than ignored, so that no client believes it was obeyed. A value that asks for the default
// behaviour is accepted.
void RefuseUnimplemented(const json& body) {
    if (Field(body, "truncate_prompt_tokens") != nullptr) {
        Fail("'truncate_prompt_tokens' is not supported by this server", "truncate_prompt_tokens");
    }
    for (const char* name :
         {"use_beam_search", "return_tokens_as_token_ids", "continue_final_message"}) {
        if (OptBool(body, name).value_or(false)) {
            Fail(std::string("'") + name + "' is not supported by this server (only false)", name);
        }
    }
    if (auto t = OptNumber(body, "typical_p"); t && *t != 1) {
        Fail("'typical_p' is not supported by this server (only 1)", "typical_p");
    }
    if (auto p = OptInt(body, "priority", std::numeric_limits<int64_t>::min(),
                        std::numeric_limits<int64_t>::max(), "");
        p && *p != 0) {
        Fail(
            "'priority' is not supported: this server schedules first come, first served "
            "(only 0)",
            "priority");
    }
}

// vLLM's prompt_logprobs (the answer's "prompt_logprobs"), and completions' echo with logprobs
// (the prompt's tokens lead the "logprobs" object): both have the engine score the prompt.
// REQUIRES: num_top_logprobs, echo and stream read.
void ReadPromptLogprobs(const json& body, OpenAiRequest& r) {
    if (auto k = OptInt(body, "prompt_logprobs", 0, kMaxLogprobs, "must be in 0..20")) {
        if (r.stream) {
            Fail("'prompt_logprobs' is not supported with 'stream' (echo with logprobs is)",
                 "prompt_logprobs");
        }
        r.prompt_logprobs = static_cast<int32_t>(*k);
    }
    r.num_prompt_logprobs = r.prompt_logprobs.value_or(-1);
    if (r.echo && r.num_top_logprobs >= 0)
        r.num_prompt_logprobs = std::max(r.num_prompt_logprobs, r.num_top_logprobs);
    if (r.max_tokens == 0 && !r.echo && !r.prompt_logprobs) {
        Fail("'max_tokens' 0 asks for no output; it needs 'echo' or 'prompt_logprobs'",
             "max_tokens");
    }
}

void ReadCommon(const json& body, const ServedModel& model, OpenAiRequest& r) {
    RefuseUnimplemented(body);
    ReadSampling(body, r);
    ReadLogitBias(body, model, r);
    ReadOutputControls(body, model, r);
    ReadStop(body, r);
    if (auto n = OptInt(body, "n", 1, kMaxChoices, "must be in 1..16")) r.n = static_cast<int>(*n);
    r.stream = OptBool(body, "stream").value_or(false);
    if (const json* so = Field(body, "stream_options")) {
        if (!so->is_object()) Fail("'stream_options' must be an object", "stream_options");
        if (!r.stream)
            Fail("'stream_options' is only allowed when 'stream' is true", "stream_options");
        if (const json* usage = Field(*so, "include_usage")) {
            if (!usage->is_boolean()) {
                Fail("'stream_options.include_usage' must be a boolean, got " + TypeName(*usage),
                     "stream_options.include_usage");
            }
            r.include_usage = usage->get<bool>();
        }
    }
    r.ignore_eos = OptBool(body, "ignore_eos").value_or(false);
    if (OptBool(body, "echo").value_or(false)) {
        if (r.endpoint != ApiEndpoint::kCompletions) {
            Fail("'echo' is not supported on chat completions", "echo");
        }
        r.echo = true;
    }
    ReadPromptLogprobs(body, r);
    if (auto best_of = OptInt(body, "best_of", 1, kMaxChoices, "must be in 1..16");
        best_of && *best_of != r.n) {
        Fail("'best_of' is not supported (only equal to n)", "best_of");
    }
    OptString(body, "user");
}

void ReadCompletion(const json& body, const ServedModel& model, OpenAiRequest& r) {
    ReadPrompt(body, model, r);
    // 0 only with echo or prompt_logprobs (ReadPromptLogprobs): the prompt is all the answer.
    r.max_tokens =
        OptInt(body, "max_tokens", 0, std::numeric_limits<int64_t>::max(), "must be >= 0");
    if (auto lp = OptInt(body, "logprobs", 0, kMaxCompletionLogprobs, "must be in 0..20")) {
        r.num_top_logprobs = static_cast<int32_t>(*lp);
    }
    if (const json* s = OptString(body, "suffix"); s && !s->get_ref<const std::string&>().empty()) {
        Fail("'suffix' is not supported", "suffix");
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

// Structured outputs (coordinator/structured_output.h); chat also reads response_format.
void ReadConstraint(const json& body, bool chat, OpenAiRequest& r) {
    std::string param;
    Result<StructuredOutput> so = ReadStructuredOutput(body, chat, &param);
    if (!so.ok()) Fail(so.status().message(), param);
    r.grammar = so->grammar;
}

// The body checks every route shares, then `read` on the JSON object; the error a client gets
// when any of it fails.
template <typename ReadFn>
std::optional<ApiError> ReadBody(std::string_view body, const ServedModel& model, ReadFn&& read) {
    if (!IsValidUtf8(body))
        return BadRequest("the request body is not valid UTF-8", "", "invalid_utf8");
    // nlohmann reads a NUL as the end of the input, so "{...}\0junk" would pass; JSON has no
    // place for a raw NUL (inside strings it must be written \u0000).
    if (const size_t nul = body.find('\0'); nul != std::string_view::npos) {
        return BadRequest("the request body holds a NUL byte (at byte " + std::to_string(nul) +
                              "); JSON text cannot contain one",
                          "", "invalid_json");
    }
    // Every nlohmann exception is caught: a value the checks missed must be a 400 in kvshard's
    // words, never an exception that ends the process or the library's text.
    try {
        bool too_deep = false;
        json j = json_fields::ParseJson(body, &too_deep);
        if (too_deep)
            return BadRequest("the request body nests arrays and objects deeper than " +
                                  std::to_string(json_fields::kMaxJsonDepth) + " levels",
                              "", "invalid_json");
        if (j.is_discarded()) return NotJson(body);
        if (!j.is_object())
            return BadRequest("the request body must be a JSON object, got " + TypeName(j));
        ReadModel(j, model);
        read(j);
    } catch (const ValidationError& e) {
        return e.error;
    } catch (const json::exception&) {
        return BadRequest("the request body could not be read", "", "invalid_json");
    }
    return std::nullopt;
}

// POST /tokenize with messages: the chat template options kvshard cannot honour are refused,
// never ignored (the count would not be the one the client asked about).
void RefuseTokenizeChatOptions(const json& body) {
    if (OptBool(body, "continue_final_message").value_or(false)) {
        Fail("'continue_final_message' is not supported", "continue_final_message");
    }
    if (Field(body, "chat_template") != nullptr) {
        Fail("'chat_template' is not supported: the server applies the model's own template",
             "chat_template");
    }
    if (const json* kw = Field(body, "chat_template_kwargs");
        kw && !(kw->is_object() && kw->empty())) {
        Fail("'chat_template_kwargs' is not supported", "chat_template_kwargs");
    }
    if (const json* tools = Field(body, "tools"); tools && !(tools->is_array() && tools->empty())) {
        Fail("'tools' are not supported", "tools");
    }
}

}  // namespace

bool ServesModel(const ServedModel& model, std::string_view name) {
    return name == model.name ||
           std::find(model.aliases.begin(), model.aliases.end(), name) != model.aliases.end() ||
           (!model.path.empty() && name == BaseName(model.path));
}

ApiError ModelNotFound(const ServedModel& model, std::string_view name) {
    ApiError e;
    e.http_status = 404;
    e.message = "The model '" + std::string(name) + "' does not exist; this server serves '" +
                model.name + "'";
    for (size_t i = 0; i < model.aliases.size(); ++i) {
        e.message += (i == 0 ? " (also named '" : ", '") + model.aliases[i] + "'";
    }
    if (!model.aliases.empty()) e.message += ")";
    e.param = "model";
    e.code = "model_not_found";
    return e;
}

ParsedRequest ParseOpenAiRequest(ApiEndpoint endpoint, std::string_view body,
                                 const ServedModel& model) {
    OpenAiRequest r;
    r.endpoint = endpoint;
    std::optional<ApiError> error = ReadBody(body, model, [&](const json& j) {
        switch (endpoint) {
            case ApiEndpoint::kCompletions:
                ReadCompletion(j, model, r);
                break;
            case ApiEndpoint::kChatCompletions:
                ReadChat(j, r);
                break;
        }
        ReadCommon(j, model, r);
        const int64_t num_choices = static_cast<int64_t>(r.n) * (1 + r.more_prompts.size());
        if (num_choices > kMaxPromptChoices) {
            Fail("'n' (" + std::to_string(r.n) + ") times the " +
                     std::to_string(1 + r.more_prompts.size()) + " prompts asks for " +
                     std::to_string(num_choices) + " choices; a request may ask for at most " +
                     std::to_string(kMaxPromptChoices),
                 "n");
        }
        ReadConstraint(j, endpoint == ApiEndpoint::kChatCompletions, r);
        if (r.max_tokens && r.sampling.min_tokens > *r.max_tokens) {
            Fail("'min_tokens' (" + std::to_string(r.sampling.min_tokens) +
                     ") must not exceed the maximum tokens (" + std::to_string(*r.max_tokens) + ")",
                 "min_tokens");
        }
    });
    if (error) return *std::move(error);
    return r;
}

std::variant<TokenizeRequest, ApiError> ParseTokenizeRequest(std::string_view body,
                                                             const ServedModel& model) {
    TokenizeRequest r;
    std::optional<ApiError> error = ReadBody(body, model, [&](const json& j) {
        const json* prompt = Field(j, "prompt");
        const bool chat = Field(j, "messages") != nullptr;
        if (prompt != nullptr && chat) {
            Fail("give either 'prompt' or 'messages', not both", "prompt");
        }
        if (prompt == nullptr && !chat) Fail("'prompt' or 'messages' is required", "prompt");
        r.chat = chat;
        if (chat) {
            ReadMessages(j, r.messages);
            r.add_generation_prompt = OptBool(j, "add_generation_prompt").value_or(true);
            RefuseTokenizeChatOptions(j);
        } else {
            // vLLM takes one string here; an empty one is a valid question (its answer: BOS or
            // nothing).
            r.prompt = OptString(j, "prompt")->get<std::string>();
            if (Field(j, "add_generation_prompt") != nullptr) {
                Fail("'add_generation_prompt' needs 'messages'", "add_generation_prompt");
            }
        }
        r.add_special_tokens = OptBool(j, "add_special_tokens").value_or(true);
        r.return_token_strs = OptBool(j, "return_token_strs").value_or(false);
    });
    if (error) return *std::move(error);
    return r;
}

std::variant<DetokenizeRequest, ApiError> ParseDetokenizeRequest(std::string_view body,
                                                                 const ServedModel& model) {
    DetokenizeRequest r;
    std::optional<ApiError> error = ReadBody(body, model, [&](const json& j) {
        const json* tokens = Field(j, "tokens");
        if (tokens == nullptr) Fail("'tokens' is required", "tokens");
        if (!tokens->is_array()) {
            Fail("'tokens' must be an array of token ids, got " + TypeName(*tokens), "tokens");
        }
        for (size_t i = 0; i < tokens->size(); ++i) {
            const json& t = (*tokens)[i];
            const std::string param = "tokens[" + std::to_string(i) + "]";
            if (!t.is_number_integer()) {
                Fail("'" + param + "' must be a token id, got " + TypeName(t), param);
            }
            const bool negative =
                t.is_number_integer() && !t.is_number_unsigned() && t.get<int64_t>() < 0;
            if (negative || t.get<uint64_t>() >= static_cast<uint64_t>(model.vocab_size)) {
                const std::string id =
                    negative ? std::to_string(t.get<int64_t>()) : std::to_string(t.get<uint64_t>());
                Fail("token id " + id + " in 'tokens' is outside the vocabulary (0.." +
                         std::to_string(model.vocab_size - 1) + ")",
                     param);
            }
            r.tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
        }
    });
    if (error) return *std::move(error);
    return r;
}

std::variant<int64_t, ApiError> ResolveMaxTokens(const OpenAiRequest& request,
                                                 int64_t prompt_tokens, int64_t max_context) {
    const char* prompt_param =
        request.endpoint == ApiEndpoint::kCompletions ? "prompt" : "messages";
    if (prompt_tokens >= max_context) {
        return BadRequest("the prompt has " + std::to_string(prompt_tokens) +
                              " tokens; this model's context holds " + std::to_string(max_context) +
                              " tokens including at least one generated token",
                          prompt_param, "context_length_exceeded");
    }
    const int64_t room = max_context - prompt_tokens;
    if (!request.max_tokens) {
        return request.endpoint == ApiEndpoint::kCompletions
                   ? std::min(kDefaultCompletionMaxTokens, room)
                   : room;
    }
    if (*request.max_tokens > room) {
        return BadRequest("prompt (" + std::to_string(prompt_tokens) + " tokens) + " +
                              request.max_tokens_param + " (" +
                              std::to_string(*request.max_tokens) + ") exceeds the context of " +
                              std::to_string(max_context) + " tokens",
                          request.max_tokens_param, "context_length_exceeded");
    }
    return *request.max_tokens;
}

}  // namespace kvshard
