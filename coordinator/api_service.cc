#include "coordinator/api_service.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "common/logging.h"

namespace kvshard {

using nlohmann::json;

namespace {

uint64_t SplitMix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Compares without an early exit, so response timing does not tell how much of a key matched.
bool SameKey(std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    unsigned char diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
    return diff == 0;
}

// Every token's text is at most this many bytes: its decoded bytes, or the piece of a special
// token that prompt text may name. At least 4 (one UTF-8 character a SentencePiece model without
// byte fallback maps to <unk>).
int64_t LongestTokenBytes(const Tokenizer& tokenizer) {
    int64_t longest = 4;
    for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
        const std::string bytes = tokenizer.TokenBytes(id);
        const size_t n = bytes.empty() ? tokenizer.data().tokens[id].size() : bytes.size();
        longest = std::max<int64_t>(longest, static_cast<int64_t>(n));
    }
    return longest;
}

// A list of prompts is held to the cap prompt by prompt (each is its own sequence): the longest.
int64_t PromptBytes(const OpenAiRequest& r) {
    if (r.endpoint == ApiEndpoint::kCompletions) {
        size_t longest = r.prompt.size();
        for (const OpenAiRequest::MorePrompt& p : r.more_prompts) {
            longest = std::max(longest, p.text.size());
        }
        return static_cast<int64_t>(longest);
    }
    int64_t bytes = 0;
    for (const ChatMessage& m : r.messages) bytes += static_cast<int64_t>(m.content.size());
    return bytes;
}

int64_t UnixSeconds() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

}  // namespace

ApiService::ApiService(Engine& engine, const Tokenizer& tokenizer,
                       std::shared_ptr<ServerMetrics> metrics, ApiServiceOptions options)
    : engine_(engine),
      tokenizer_(tokenizer),
      metrics_(std::move(metrics)),
      options_(std::move(options)),
      max_prompt_bytes_(options_.http.max_prompt_bytes > 0
                            ? options_.http.max_prompt_bytes
                            : engine_.max_context() * LongestTokenBytes(tokenizer_)),
      created_(UnixSeconds()),
      boot_nonce_((static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}()) {}

ApiError ApiService::PromptTooLarge(std::string_view what, int64_t bytes, std::string param) const {
    return BadRequest(std::string(what) + " is " + std::to_string(bytes) +
                          " bytes; this server accepts at most " +
                          std::to_string(max_prompt_bytes_) + " bytes",
                      std::move(param), "prompt_too_large");
}

bool ApiService::AuthorizedKey(std::string_view key) const {
    if (options_.http.api_keys.empty()) return true;
    bool ok = false;
    for (const std::string& k : options_.http.api_keys) ok |= SameKey(key, k);
    return ok;
}

bool ApiService::Authorized(std::string_view authorization) const {
    if (options_.http.api_keys.empty()) return true;
    // credentials = auth-scheme 1*SP token68; the scheme is case-insensitive.
    constexpr std::string_view kBearer = "bearer";
    if (authorization.size() <= kBearer.size()) return false;
    for (size_t i = 0; i < kBearer.size(); ++i) {
        const char c = authorization[i];
        if ((c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c) != kBearer[i]) {
            return false;
        }
    }
    std::string_view key = authorization.substr(kBearer.size());
    if (key.front() != ' ') return false;
    while (!key.empty() && key.front() == ' ') key.remove_prefix(1);
    bool ok = false;
    for (const std::string& k : options_.http.api_keys) ok |= SameKey(key, k);
    return ok;
}

std::string ApiService::NewIdHex() const {
    const uint64_t n = counter_.fetch_add(1, std::memory_order_relaxed);
    char hex[40];
    std::snprintf(hex, sizeof(hex), "%016llx%08llx",
                  static_cast<unsigned long long>(SplitMix64(boot_nonce_ ^ n)),
                  static_cast<unsigned long long>(n & 0xFFFFFFFFull));
    return hex;
}

std::string ApiService::NewRequestId(ApiEndpoint endpoint) const {
    return std::string(endpoint == ApiEndpoint::kChatCompletions ? "chatcmpl-" : "cmpl-") +
           NewIdHex();
}

uint64_t ApiService::RandomSeed() const {
    return SplitMix64(boot_nonce_ + 0x5EEDull * counter_.fetch_add(1, std::memory_order_relaxed));
}

TokenBytesFn ApiService::token_bytes() const {
    const Tokenizer* tok = &tokenizer_;
    return [tok](int32_t id) -> std::string {
        if (id < 0 || id >= tok->vocab_size()) return "";
        std::string bytes = tok->TokenBytes(id);
        if (bytes.empty() && tok->IsControl(id)) return tok->data().tokens[id];
        return bytes;
    };
}

std::vector<int32_t> ApiService::EncodeText(const std::string& text,
                                            bool add_special_tokens) const {
    EncodeOptions encode;
    encode.parse_special = true;
    encode.add_bos = add_special_tokens && tokenizer_.data().add_bos;
    return tokenizer_.Encode(text, encode);
}

std::variant<EncodedChat, ApiError> ApiService::EncodeChat(const std::vector<ChatMessage>& messages,
                                                           bool add_generation_prompt,
                                                           bool add_special_tokens,
                                                           const ChatTools* tools) const {
    const TokenizerData& data = tokenizer_.data();
    EncodeOptions encode;
    encode.parse_special = true;
    encode.add_bos = add_special_tokens && data.add_bos;
    if (!options_.chat_template) {
        return BadRequest(
            "this model has no chat template: use /v1/completions, or restart the server with "
            "--chat-template chatml|llama2|llama3",
            "messages", "chat_template_missing");
    }
    Result<RenderedChat> rendered =
        options_.chat_template->RenderChat(messages, add_generation_prompt, tools);
    if (!rendered.ok()) return BadRequest(rendered.status().message(), "messages");
    std::vector<TextPiece>& pieces = rendered->pieces;
    // Templates that write the BOS text themselves (Llama 2 and 3) must not get a second one.
    const ChatTemplateTokens special = ChatTemplateTokensOf(data);
    if (!special.bos.empty() && !pieces.empty() && !pieces.front().literal &&
        pieces.front().text.rfind(special.bos, 0) == 0) {
        encode.add_bos = false;
    }
    if (options_.http.content_special_tokens == HttpConfig::ContentSpecialTokens::kControl) {
        for (TextPiece& p : pieces) p.literal = false;
    }
    EncodedChat out;
    out.ids = tokenizer_.EncodePieces(pieces, encode);
    if (rendered->cache_marks.size() > static_cast<size_t>(kMaxCacheBreakpoints)) {
        return BadRequest("a request may hold at most " + std::to_string(kMaxCacheBreakpoints) +
                              " cache_control breakpoints, this one has " +
                              std::to_string(rendered->cache_marks.size()),
                          "cache_control");
    }
    // A breakpoint covers the tokens that the text before its mark shares with the whole
    // prompt: the prefix's own tokenization, cut where it stops agreeing (a word the mark splits
    // may tokenize differently once the rest follows).
    for (const RenderedCacheMark& mark : rendered->cache_marks) {
        std::vector<TextPiece> prefix;
        size_t left = mark.text_end;
        for (const TextPiece& p : pieces) {
            if (left == 0) break;
            prefix.push_back({p.text.substr(0, left), p.literal});
            left -= prefix.back().text.size();
        }
        const std::vector<int32_t> ids = tokenizer_.EncodePieces(prefix, encode);
        const auto diverge = std::mismatch(ids.begin(), ids.end(), out.ids.begin(), out.ids.end());
        const int64_t shared = diverge.first - ids.begin();
        if (shared == 0) continue;
        out.breakpoints.push_back({shared, mark.ttl_ms});
    }
    std::sort(out.breakpoints.begin(), out.breakpoints.end(),
              [](const CacheBreakpoint& a, const CacheBreakpoint& b) {
                  return a.prefix_tokens < b.prefix_tokens ||
                         (a.prefix_tokens == b.prefix_tokens && a.ttl_ms > b.ttl_ms);
              });
    // Two marks on the same prefix are one breakpoint, with the longer TTL.
    out.breakpoints.erase(std::unique(out.breakpoints.begin(), out.breakpoints.end(),
                                      [](const CacheBreakpoint& a, const CacheBreakpoint& b) {
                                          return a.prefix_tokens == b.prefix_tokens;
                                      }),
                          out.breakpoints.end());
    return out;
}

std::variant<std::vector<int32_t>, ApiError> ApiService::Tokenize(
    const OpenAiRequest& request) const {
    if (request.endpoint == ApiEndpoint::kCompletions) {
        if (request.prompt_is_token_ids) return request.prompt_token_ids;
        return EncodeText(request.prompt, /*add_special_tokens=*/true);
    }
    auto encoded = EncodeChat(request.messages, request.add_generation_prompt,
                              /*add_special_tokens=*/true);
    if (auto* error = std::get_if<ApiError>(&encoded)) return *error;
    return std::move(std::get<EncodedChat>(encoded).ids);
}

std::variant<OpenAiRequest, ApiError> ApiService::Parse(ApiEndpoint endpoint,
                                                        std::string_view body) const {
    ParsedRequest parsed = ParseOpenAiRequest(endpoint, body, options_.model);
    if (auto* r = std::get_if<OpenAiRequest>(&parsed)) {
        // A prompt longer than this can never fit (or the operator allows no more): refuse it
        // before it costs a tokenization.
        const int64_t bytes = PromptBytes(*r);
        if (bytes > max_prompt_bytes_) {
            const bool chat = endpoint == ApiEndpoint::kChatCompletions;
            return PromptTooLarge(chat ? "the messages' content" : "the prompt", bytes,
                                  chat ? "messages" : "prompt");
        }
    }
    return parsed;
}

std::variant<PreparedGeneration, ApiError> ApiService::Prepare(ApiEndpoint endpoint,
                                                               std::string_view body) const {
    auto parsed = Parse(endpoint, body);
    if (auto* error = std::get_if<ApiError>(&parsed)) return *error;
    return Prepare(std::get<OpenAiRequest>(parsed));
}

std::variant<std::pair<ChatTools, std::optional<ToolCallParserOptions>>, ApiError>
ApiService::ToolsFor(const std::vector<ToolDefinition>& tools, const ToolChoice& choice,
                     bool single_call, const std::string& id_prefix) const {
    std::pair<ChatTools, std::optional<ToolCallParserOptions>> out;
    if (tools.empty() || choice.mode == ToolChoiceMode::kNone || !options_.chat_template) {
        return out;
    }
    Result<ToolCallSyntax> syntax = ToolCallSyntaxFor(*options_.chat_template);
    if (!syntax.ok()) return BadRequest("tools: " + syntax.status().message(), "tools");
    out.first = RenderTools(*syntax, tools, choice);
    ToolCallParserOptions parse;
    parse.syntax = *syntax;
    // A named choice makes only that tool's calls into calls (the check behind the prompt).
    for (const ToolDefinition& t : tools) {
        if (choice.mode != ToolChoiceMode::kNamed || t.name == choice.name) {
            parse.allowed_names.push_back(t.name);
        }
    }
    parse.id_prefix = id_prefix;
    if (*syntax == ToolCallSyntax::kMistral) {
        // Mistral's templates refuse a call id that is not 9 letters and digits, so the ids
        // kvshard issues fit: the request's random hex digits (after "call_"), then the index.
        const size_t hex = id_prefix.find('_');
        parse.id_prefix.clear();
        for (char c : id_prefix.substr(hex == std::string::npos ? 0 : hex + 1)) {
            if (std::isalnum(static_cast<unsigned char>(c))) parse.id_prefix += c;
        }
        parse.id_length = 9;
    }
    if (single_call) parse.max_calls = 1;
    out.second = std::move(parse);
    return out;
}

std::variant<PreparedGeneration, ApiError> ApiService::Prepare(const OpenAiRequest& r) const {
    const ApiEndpoint endpoint = r.endpoint;
    const std::string id_hex = NewIdHex();
    std::vector<int32_t> prompt;
    std::vector<CacheBreakpoint> breakpoints;
    std::optional<ToolCallParserOptions> tool_parsing;
    if (endpoint == ApiEndpoint::kChatCompletions) {
        auto tools =
            ToolsFor(r.tools, r.tool_choice, !r.parallel_tool_calls, "call_" + id_hex + "_");
        if (auto* error = std::get_if<ApiError>(&tools)) return *error;
        auto& [chat_tools, parse_options] =
            std::get<std::pair<ChatTools, std::optional<ToolCallParserOptions>>>(tools);
        auto encoded = EncodeChat(r.messages, r.add_generation_prompt,
                                  /*add_special_tokens=*/true, &chat_tools);
        if (auto* error = std::get_if<ApiError>(&encoded)) return *error;
        prompt = std::move(std::get<EncodedChat>(encoded).ids);
        breakpoints = std::move(std::get<EncodedChat>(encoded).breakpoints);
        tool_parsing = std::move(parse_options);
    } else {
        auto tokens = Tokenize(r);
        if (auto* error = std::get_if<ApiError>(&tokens)) return *error;
        prompt = std::move(std::get<std::vector<int32_t>>(tokens));
    }
    if (prompt.empty()) {
        return BadRequest("the prompt is empty",
                          endpoint == ApiEndpoint::kCompletions ? "prompt" : "messages");
    }
    auto max_tokens =
        ResolveMaxTokens(r, static_cast<int64_t>(prompt.size()), engine_.max_context());
    if (auto* error = std::get_if<ApiError>(&max_tokens)) return *error;

    PreparedGeneration p;
    p.stream = r.stream;
    GenerationRequest& g = p.request;
    g.request_id =
        std::string(endpoint == ApiEndpoint::kChatCompletions ? "chatcmpl-" : "cmpl-") + id_hex;
    g.cache_breakpoints = std::move(breakpoints);
    g.prompt_token_ids = std::move(prompt);
    g.sampling = r.sampling;
    if (!r.has_seed) g.sampling.seed = RandomSeed();
    g.max_tokens = std::get<int64_t>(max_tokens);
    g.stop = r.stop;
    g.ignore_eos = r.ignore_eos;
    g.stop_token_ids = r.stop_token_ids;
    g.include_stop_str_in_output = r.include_stop_str_in_output;
    g.skip_special_tokens = r.skip_special_tokens;
    g.n = r.n;
    g.num_top_logprobs = r.num_top_logprobs;
    g.num_prompt_logprobs = r.num_prompt_logprobs;
    g.grammar = r.grammar;
    if (tool_parsing && (r.tool_choice.mode == ToolChoiceMode::kRequired ||
                         r.tool_choice.mode == ToolChoiceMode::kNamed)) {
        // A call is required: the answer is held to calls whose arguments fit the schemas.
        if (g.grammar != nullptr) {
            return BadRequest(
                "'response_format' (or guided_*) and a required tool call both "
                "constrain the output; give one",
                "tool_choice");
        }
        auto calls = ToolCallGrammar(tool_parsing->syntax, r.tools, r.tool_choice,
                                     tool_parsing->max_calls == 1);
        if (!calls.ok()) return BadRequest(calls.status().message(), "tools");
        g.grammar = *calls;
    } else if (tool_parsing) {
        for (size_t i = 0; i < r.tools.size(); ++i) {
            if (!r.tools[i].strict) continue;
            const std::string param = "tools[" + std::to_string(i) + "].function.strict";
            return BadRequest("'" + param +
                                  "' needs tool_choice \"required\" or a named "
                                  "function: with \"auto\" the model may answer in text, and "
                                  "kvshard holds only required calls to the schema",
                              param);
        }
    }

    // The other prompts of a list: the same request with its own prompt, id and token budget.
    for (size_t i = 0; i < r.more_prompts.size(); ++i) {
        const OpenAiRequest::MorePrompt& more = r.more_prompts[i];
        GenerationRequest other = g;
        other.request_id = g.request_id + "-" + std::to_string(i + 1);
        other.prompt_token_ids =
            more.is_token_ids ? more.token_ids : EncodeText(more.text, /*add_special_tokens=*/true);
        if (other.prompt_token_ids.empty()) return BadRequest("the prompt is empty", "prompt");
        auto budget = ResolveMaxTokens(r, static_cast<int64_t>(other.prompt_token_ids.size()),
                                       engine_.max_context());
        if (auto* error = std::get_if<ApiError>(&budget)) {
            error->message = "prompt[" + std::to_string(i + 1) + "]: " + error->message;
            return *error;
        }
        other.max_tokens = std::get<int64_t>(budget);
        if (!r.has_seed) other.sampling.seed = RandomSeed();
        p.more_requests.push_back(std::move(other));
    }

    ResponseContext& c = p.context;
    c.endpoint = endpoint;
    c.id = g.request_id;
    c.created = UnixSeconds();
    c.model = options_.model.name;
    c.n = r.n * static_cast<int>(1 + r.more_prompts.size());
    c.logprobs = r.num_top_logprobs >= 0;
    c.include_usage = r.include_usage;
    c.choices_per_prompt = r.n;
    c.prompt_logprobs = r.prompt_logprobs.has_value();
    c.echo_logprobs = r.echo && c.logprobs;
    if (r.num_prompt_logprobs >= 0) {
        c.prompt_token_ids.push_back(g.prompt_token_ids);
        for (const GenerationRequest& more : p.more_requests)
            c.prompt_token_ids.push_back(more.prompt_token_ids);
    }
    c.tools = std::move(tool_parsing);
    if (r.echo) {
        // The prompt as the client sent it; token ids as /detokenize writes them.
        std::vector<std::string> prompts = {
            r.prompt_is_token_ids ? DetokenizeText(r.prompt_token_ids) : r.prompt};
        for (const OpenAiRequest::MorePrompt& more : r.more_prompts) {
            prompts.push_back(more.is_token_ids ? DetokenizeText(more.token_ids) : more.text);
        }
        for (const std::string& text : prompts) c.echo.insert(c.echo.end(), r.n, text);
    }
    return p;
}

std::unique_ptr<ResponseWriter> ApiService::MakeResponseWriter(const PreparedGeneration& p) const {
    if (p.anthropic) return std::make_unique<AnthropicResponseWriter>(*p.anthropic);
    if (p.responses) return std::make_unique<ResponsesResponseWriter>(*p.responses);
    return std::make_unique<OpenAiResponseWriter>(p.context, token_bytes());
}

ApiError ApiService::ErrorFromStatus(const Status& status, std::string_view request_id) {
    ApiError e;
    const std::string id = request_id.empty() ? "" : " (request " + std::string(request_id) + ")";
    switch (status.code()) {
        case StatusCode::kInvalidArgument:
        case StatusCode::kOutOfRange:
            // The engine's checks of the request itself (prompt length, ids): about what the
            // client sent, in kvshard's words already.
            e.http_status = 400;
            e.message = status.message();
            break;
        case StatusCode::kNotFound:
            e.http_status = 404;
            e.message = "not found" + id;
            break;
        case StatusCode::kResourceExhausted:
            e.http_status = 429;
            e.type = "server_overloaded";
            e.code = "queue_full";
            e.message = "the server's request queue is full; retry later";
            e.retry_after_s = 1;
            break;
        case StatusCode::kUnavailable:
            e.http_status = 503;
            e.type = "server_unavailable";
            e.message = "the model is not available right now; retry later" + id;
            e.retry_after_s = 1;
            break;
        case StatusCode::kDeadlineExceeded:
            e.http_status = 504;
            e.type = "timeout";
            e.message = "the server did not finish the request in time" + id;
            break;
        case StatusCode::kUnimplemented:
            e.http_status = 501;
            e.type = "not_implemented";
            e.message = "the server cannot do what this request asks" + id;
            break;
        case StatusCode::kOk:
        case StatusCode::kAborted:
        case StatusCode::kDataLoss:
        case StatusCode::kInternal:
            e.http_status = 500;
            e.type = "server_error";
            e.message = "the server failed while generating" + id;
            break;
    }
    if (e.http_status >= 500) {
        spdlog::warn("http: {} failed: {}", request_id.empty() ? "request" : request_id,
                     status.ToString());
    }
    return e;
}

}  // namespace kvshard
