// The request half of the OpenAI HTTP API: parsing and validating the JSON bodies of
// POST /v1/completions and POST /v1/chat/completions (and of vLLM's POST /tokenize and
// POST /detokenize), and the error bodies every 4xx/5xx answer carries:
// {"error": {"message", "type", "param", "code"}}.
//
// Validation is complete before anything reaches the engine: a wrong type, an out-of-range value or
// an unsupported option is a 400 naming the parameter; an unknown model is a 404. Unknown fields
// are ignored, as OpenAI-compatible servers do. The response half is openai_response.h.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/request.h"
#include "common/status.h"
#include "coordinator/tool_calls.h"
#include "grammar/grammar.h"
#include "model/chat_template.h"

namespace kvshard {

enum class ApiEndpoint { kCompletions, kChatCompletions };
// vLLM's tokenizer routes: no generation, only the tokenizer (and the chat template).
enum class TokenizerEndpoint { kTokenize, kDetokenize };

// An error answer. Empty `param` and `code` are written as null. The message is kvshard's own
// words about what the client sent or what the server cannot do now: never a library's text, an
// internal address or an engine detail (those go to the log with the request id).
struct ApiError {
    int http_status = 400;
    std::string message;
    std::string type = "invalid_request_error";
    std::string param;
    std::string code;
    int retry_after_s = 0;  // > 0: the answer carries Retry-After (429, 503)
};

// {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
std::string ApiErrorBody(const ApiError& error);
ApiError BadRequest(std::string message, std::string param = "", std::string code = "");

// The model this server answers for.
struct ServedModel {
    std::string name;        // the first served name: what answers carry
    std::string path;        // the model file; its base name is accepted as "model" too
    int64_t vocab_size = 0;  // token-id prompts must be below it
    // More served names (--served-model-name's second and later): listed by /v1/models and
    // accepted as "model"; answers carry `name`.
    std::vector<std::string> aliases = {};
};

// True when a request's "model" names the served model: its name or one of its aliases, or the
// model file's base name.
bool ServesModel(const ServedModel& model, std::string_view name);
// The 404 for a model this server does not serve (param "model", code "model_not_found").
ApiError ModelNotFound(const ServedModel& model, std::string_view name);

// A validated request, before tokenization.
struct OpenAiRequest {
    ApiEndpoint endpoint = ApiEndpoint::kCompletions;
    // Completions: the prompt as text, or as token ids when prompt_is_token_ids.
    std::string prompt;
    std::vector<int32_t> prompt_token_ids;
    bool prompt_is_token_ids = false;
    // Completions with a list of prompts ("prompt": ["a", "b"] or [[1, 2], [3]]): the second and
    // later ones, each its own engine request. Choice i*n + j of the answer is choice j of
    // prompt i (as OpenAI and vLLM number them); usage is summed.
    struct MorePrompt {
        std::string text;
        std::vector<int32_t> token_ids;
        bool is_token_ids = false;
    };
    std::vector<MorePrompt> more_prompts;
    // Completions: each choice's text starts with its prompt's text; with logprobs, the
    // prompt's tokens lead the logprobs too (the first one's logprob null).
    bool echo = false;
    // vLLM's prompt_logprobs (0..20 alternatives): the answer's "prompt_logprobs". Not streamed.
    std::optional<int32_t> prompt_logprobs;
    // What the engine scores the prompt with (GenerationRequest.num_prompt_logprobs): the larger
    // of prompt_logprobs and, with echo, logprobs; -1: none.
    int32_t num_prompt_logprobs = -1;
    // Chat.
    std::vector<ChatMessage> messages;
    bool add_generation_prompt = true;
    // Chat: the tools offered (coordinator/tool_calls.h) and how the model may use them.
    std::vector<ToolDefinition> tools;
    ToolChoice tool_choice;
    bool parallel_tool_calls = true;

    std::optional<int64_t> max_tokens;  // absent: see ResolveMaxTokens
    // The field max_tokens was read from, named in its errors: "max_tokens",
    // "max_completion_tokens" (chat), "max_output_tokens" (the Responses API).
    std::string max_tokens_param = "max_tokens";
    SamplingParams sampling;  // temperature defaults to 1 as in the OpenAI API
    bool has_seed = false;    // false: the server picks a random seed
    std::vector<std::string> stop;
    int n = 1;
    int32_t num_top_logprobs = -1;  // -1: no logprobs; else the top k (0: the chosen token only)
    bool stream = false;
    bool include_usage = false;  // stream_options.include_usage
    bool ignore_eos = false;
    // vLLM's output controls (GenerationRequest has their meaning).
    std::vector<int32_t> stop_token_ids;
    bool include_stop_str_in_output = false;
    bool skip_special_tokens = true;
    // Structured outputs (coordinator/structured_output.h): response_format, guided_*,
    // structured_outputs. Null: none.
    std::shared_ptr<const grammar::Grammar> grammar;
};

using ParsedRequest = std::variant<OpenAiRequest, ApiError>;

// Parses and validates a request body. `body` may be any bytes: invalid UTF-8, a NUL byte,
// malformed JSON and numbers beyond a double are 400s like every other mistake; nothing throws.
ParsedRequest ParseOpenAiRequest(ApiEndpoint endpoint, std::string_view body,
                                 const ServedModel& model);

// POST /tokenize: {"prompt": "text"} or {"messages": [...]}, exactly one of them.
struct TokenizeRequest {
    bool chat = false;  // messages (through the chat template) rather than prompt
    std::string prompt;
    std::vector<ChatMessage> messages;
    bool add_generation_prompt = true;
    // The special tokens the tokenizer adds (its BOS, when it asks for one), as the generation
    // routes add them; false: none beyond what the chat template writes. vLLM's chat default is
    // false; kvshard's is true for both, so that a chat count is the chat route's prompt_tokens.
    bool add_special_tokens = true;
    bool return_token_strs = false;  // also the token pieces ("token_strs")
};

// POST /detokenize: {"tokens": [ids]}, every id inside the vocabulary.
struct DetokenizeRequest {
    std::vector<int32_t> tokens;
};

// Parse and validate the tokenizer routes' bodies as ParseOpenAiRequest does (the same body
// checks, the same "model" rule; unknown fields ignored, vLLM options kvshard cannot honour
// refused with the param named).
std::variant<TokenizeRequest, ApiError> ParseTokenizeRequest(std::string_view body,
                                                             const ServedModel& model);
std::variant<DetokenizeRequest, ApiError> ParseDetokenizeRequest(std::string_view body,
                                                                 const ServedModel& model);

// The number of tokens to generate once the prompt is tokenized: max_tokens when given (400 when
// prompt + max_tokens exceeds the context), else 16 for completions (the OpenAI default) and the
// rest of the context for chat. A prompt that leaves no room is a 400 too.
std::variant<int64_t, ApiError> ResolveMaxTokens(const OpenAiRequest& request,
                                                 int64_t prompt_tokens, int64_t max_context);

}  // namespace kvshard
