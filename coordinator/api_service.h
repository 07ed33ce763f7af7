// ApiService: what the HTTP endpoints do, without the sockets. It turns a request body into a
// GenerationRequest for the engine in two stages: Parse (validate the JSON, check the prompt's
// bytes; cheap, may run on an I/O thread) and Prepare (apply the chat template, tokenize, check
// the context; costs CPU in proportion to the prompt, so the HTTP server runs it on a pool of its
// own). The same two stages serve Anthropic's POST /v1/messages (ParseAnthropic,
// PrepareAnthropic; POST /v1/messages/count_tokens is CountTokensAnswer). It also answers the small
// GET endpoints and vLLM's tokenizer routes (POST /tokenize, POST /detokenize), which cost CPU like
// Prepare and run where it runs. HttpSession (http_session.h) does the I/O.
//
// Thread-safety: every method may be called from any HTTP thread at once; the service holds no
// mutable state besides the metrics (thread-safe) and an atomic request counter.
// Ownership: the engine, tokenizer and metrics outlive the service.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "config/server_config.h"
#include "coordinator/anthropic_protocol.h"
#include "coordinator/anthropic_response.h"
#include "coordinator/engine_api.h"
#include "coordinator/metrics.h"
#include "coordinator/openai_protocol.h"
#include "coordinator/openai_response.h"
#include "coordinator/response_writer.h"
#include "coordinator/responses_protocol.h"
#include "coordinator/responses_response.h"
#include "model/chat_template.h"
#include "model/tokenizer.h"

namespace kvshard {

struct ApiServiceOptions {
    ServedModel model;                          // name, path, vocabulary size
    std::optional<ChatTemplate> chat_template;  // nullopt: chat requests get 400
    // The server: section as the file gives it (config/server_config.h); the API reads api_keys
    // (empty: no authentication), max_prompt_bytes (prompt text, or all message content, longer
    // than this is a 400 before tokenizing; 0: the longest prompt that could fit the context,
    // max_context() times the longest token's bytes) and content_special_tokens (kText encodes
    // special-token text inside chat message content as plain text; kControl lets it become
    // the control token; the template's own markers are control tokens either way).
    HttpConfig http;
    // GET /v1/models/{id}/tokenizer and /tokenizer_config: the served model's Hugging Face
    // tokenizer.json and tokenizer_config.json (model/hf_export.h HfTokenizerFilesOf), for
    // benchmark clients that load a tokenizer. Empty: those routes answer 404 saying why.
    std::string tokenizer_json;
    std::string tokenizer_config_json;
};

// The files of GET /v1/models/{id}/tokenizer (tokenizer.json) and /tokenizer_config
// (tokenizer_config.json).
enum class TokenizerFile { kTokenizerJson, kTokenizerConfig };

// A request ready for Engine::Submit, and what its answer needs.
struct PreparedGeneration {
    GenerationRequest request;
    // Completions with a list of prompts: the second and later prompts' requests (ids
    // "<request id>-1", "-2", ...); their choices follow request's in the answer, request.n each.
    std::vector<GenerationRequest> more_requests;
    ResponseContext context;                            // the OpenAI routes
    std::optional<AnthropicResponseContext> anthropic;  // set for POST /v1/messages
    std::optional<ResponsesContext> responses;          // set for POST /v1/responses
    bool stream = false;
};

// A chat prompt's ids and its prompt-caching breakpoints (at most kMaxCacheBreakpoints, in
// increasing prefix_tokens order, each the number of leading prompt tokens that the text up to
// its mark shares with the whole prompt).
struct EncodedChat {
    std::vector<int32_t> ids;
    std::vector<CacheBreakpoint> breakpoints;
};

class ApiService {
  public:
    ApiService(Engine& engine, const Tokenizer& tokenizer, std::shared_ptr<ServerMetrics> metrics,
               ApiServiceOptions options);

    // True when no keys are configured or `authorization` is "Bearer <one of the keys>" (the
    // scheme in any case, as RFC 7235 says).
    bool Authorized(std::string_view authorization) const;
    // True when no keys are configured or `key` is one of them (Anthropic's x-api-key header).
    bool AuthorizedKey(std::string_view key) const;

    // Stage 1: the validated request, or the 4xx a client gets; prompts over max_prompt_bytes()
    // are refused here, before anything is tokenized.
    std::variant<OpenAiRequest, ApiError> Parse(ApiEndpoint endpoint, std::string_view body) const;
    // Stage 2: the chat template, tokenization and the context check.
    std::variant<PreparedGeneration, ApiError> Prepare(const OpenAiRequest& request) const;
    // Both stages.
    std::variant<PreparedGeneration, ApiError> Prepare(ApiEndpoint endpoint,
                                                       std::string_view body) const;
    // POST /v1/messages and /v1/messages/count_tokens, as Parse and Prepare (the prompt-bytes cap
    // applies to all text that goes into the prompt: messages, system and tools).
    std::variant<AnthropicRequest, ApiError> ParseAnthropic(AnthropicEndpoint endpoint,
                                                            std::string_view body) const;
    std::variant<PreparedGeneration, ApiError> PrepareAnthropic(
        const AnthropicRequest& request) const;
    // POST /v1/messages/count_tokens: {"input_tokens": N}, N the tokens /v1/messages would
    // submit for the same body. Tokenizes: run off the I/O threads.
    std::variant<std::string, ApiError> CountTokensAnswer(std::string_view body) const;
    // POST /v1/responses (responses_service.cc), as Parse and Prepare: the input as chat
    // messages through the chat template, one choice.
    std::variant<ResponsesRequest, ApiError> ParseResponses(std::string_view body) const;
    std::variant<PreparedGeneration, ApiError> PrepareResponses(
        const ResponsesRequest& request) const;
    // The writer of a prepared generation's answer, streamed or whole, in its API's format.
    std::unique_ptr<ResponseWriter> MakeResponseWriter(const PreparedGeneration& prepared) const;

    // The prompt-bytes cap in force (options.max_prompt_bytes, or the automatic one).
    int64_t max_prompt_bytes() const { return max_prompt_bytes_; }

    // True when `name` is one a request's "model" may send (openai_protocol.h ServesModel).
    bool ServesModelName(std::string_view name) const { return ServesModel(options_.model, name); }
    std::string ModelsBody() const;  // GET /v1/models: every served name
    // GET /v1/models/{id}: the model object (one entry of ModelsBody's list) when `id` names the
    // served model as a request's "model" may, else the 404 naming `id`.
    std::variant<std::string, ApiError> ModelBody(std::string_view id) const;
    // GET /v1/models/{id}/tokenizer and /tokenizer_config: the file's text when `id` names the
    // served model as ModelBody's does, else the 404 naming `id`.
    std::variant<std::string, ApiError> TokenizerFileBody(std::string_view id,
                                                          TokenizerFile file) const;
    // POST /tokenize ({"count", "max_model_len", "tokens"[, "token_strs"]}) and POST /detokenize
    // ({"prompt"}): the answer body, or the 4xx. Tokenizes: run off the I/O threads, as Prepare.
    std::variant<std::string, ApiError> TokenizerAnswer(TokenizerEndpoint endpoint,
                                                        std::string_view body) const;
    // GET /health: 200 {"status":"ok"}, or 503 {"status":"unavailable","error":"..."} when the
    // engine cannot serve (Engine::Health).
    std::pair<int, std::string> Health() const;
    std::string MetricsBody() const;  // GET /metrics

    // The error a client sees for a failed Submit or a request that ended in failure, in
    // kvshard's words: engine messages can hold worker addresses and step numbers, so only the
    // request-validation codes (InvalidArgument, OutOfRange) pass their message through. The
    // full status goes to the log with `request_id`. 429 and 503 carry a Retry-After.
    static ApiError ErrorFromStatus(const Status& status, std::string_view request_id = "");

    Engine& engine() const { return engine_; }
    const std::shared_ptr<ServerMetrics>& metrics() const { return metrics_; }
    // Token bytes for logprobs: the token's text, or its piece for control tokens ("<|im_end|>").
    TokenBytesFn token_bytes() const;

  private:
    std::variant<std::vector<int32_t>, ApiError> Tokenize(const OpenAiRequest& request) const;
    // The prompt's ids as the generation routes make them (add_special_tokens: the BOS when the
    // tokenizer asks for one; chat never adds a BOS that the template writes itself).
    std::vector<int32_t> EncodeText(const std::string& text, bool add_special_tokens) const;
    // `tools` may be null. The breakpoints come from the messages' (and the tools') cache marks.
    std::variant<EncodedChat, ApiError> EncodeChat(const std::vector<ChatMessage>& messages,
                                                   bool add_generation_prompt,
                                                   bool add_special_tokens,
                                                   const ChatTools* tools = nullptr) const;
    // The tools prompt of a request (empty without tools or with tool_choice none), and the
    // parser options for its answer (nullopt: no tool calls are parsed); ids are `id_prefix` +
    // the call's index; `single_call`: calls after the first stay text.
    std::variant<std::pair<ChatTools, std::optional<ToolCallParserOptions>>, ApiError> ToolsFor(
        const std::vector<ToolDefinition>& tools, const ToolChoice& choice, bool single_call,
        const std::string& id_prefix) const;
    std::variant<std::string, ApiError> TokenizeAnswer(const TokenizeRequest& request) const;
    std::string DetokenizeAnswer(const DetokenizeRequest& request) const;
    // `tokens` as text: control tokens as their pieces, the rest decoded (DetokenizeAnswer).
    std::string DetokenizeText(const std::vector<int32_t>& tokens) const;
    // The 400 (code prompt_too_large, naming `param`) for a prompt of `bytes` over the cap:
    // "<what> is N bytes; this server accepts at most M bytes".
    ApiError PromptTooLarge(std::string_view what, int64_t bytes, std::string param) const;
    std::string NewRequestId(ApiEndpoint endpoint) const;
    std::string NewIdHex() const;  // 24 hex digits, unique for this server
    uint64_t RandomSeed() const;

    Engine& engine_;
    const Tokenizer& tokenizer_;
    std::shared_ptr<ServerMetrics> metrics_;
    ApiServiceOptions options_;
    int64_t max_prompt_bytes_ = 0;
    int64_t created_ = 0;  // server start, Unix seconds (for /v1/models)
    uint64_t boot_nonce_ = 0;
    mutable std::atomic<uint64_t> counter_{0};
};

}  // namespace kvshard
