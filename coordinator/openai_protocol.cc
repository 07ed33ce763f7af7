#include "coordinator/openai_protocol.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "coordinator/json_fields.h"
#include "coordinator/openai_chat_request.h"
#include "coordinator/openai_request_fields.h"
#include "coordinator/openai_sampling_request.h"
#include "coordinator/structured_output.h"

namespace kvshard {

using json_fields::Field;
using json_fields::TypeName;
using nlohmann::json;
using openai_request::Fail;
using openai_request::OptBool;
using openai_request::OptInt;
using openai_request::OptString;
using openai_request::ReadBody;
using openai_request::ReadChat;
using openai_request::ReadCommon;
using openai_request::ReadMessages;

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

// Completions with a list of prompts: prompts, and choices over all of them, at most.
constexpr size_t kMaxPrompts = 256;
constexpr int64_t kMaxPromptChoices = 1024;
constexpr int kMaxCompletionLogprobs = 20;  // vLLM's bound (OpenAI's is 5)
constexpr int64_t kDefaultCompletionMaxTokens = 16;

std::string BaseName(const std::string& path) {
    std::string p = path;
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    const size_t slash = p.rfind('/');
    return slash == std::string::npos ? p : p.substr(slash + 1);
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

// Structured outputs (coordinator/structured_output.h); chat also reads response_format.
void ReadConstraint(const json& body, bool chat, OpenAiRequest& r) {
    std::string param;
    Result<StructuredOutput> so = ReadStructuredOutput(body, chat, &param);
    if (!so.ok()) Fail(so.status().message(), param);
    r.grammar = so->grammar;
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
