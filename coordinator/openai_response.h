// The response half of the OpenAI HTTP API: the JSON of a finished (non-streamed) completion and
// the server-sent events of a streamed one, built from the engine's GenerationDeltas.
//
//   completions  {"object": "text_completion", "choices": [{"index", "text", "logprobs",
//                "finish_reason"}], "usage": {...}}
//   chat         {"object": "chat.completion", "choices": [{"index", "message": {"role":
//                "assistant", "content"[, "tool_calls"]}, "logprobs", "finish_reason"}],
//                "usage": {...}}; with tools, calls the model made are message.tool_calls
//                ([{"id", "type": "function", "function": {"name", "arguments"}}], content
//                null when there is no text) and finish_reason "tool_calls"; streamed as
//                delta.tool_calls, one whole call per chunk (tool_calls.h).
//   usage        {"prompt_tokens", "completion_tokens", "total_tokens",
//                "prompt_tokens_details": {"cached_tokens"}}
//   stream       "data: <chunk>\n\n" per delta ("text_completion" / "chat.completion.chunk"; chat
//                opens every choice with a {"role": "assistant"} delta, sent with the first
//                generated text as vLLM does), then with include_usage
//                one chunk with empty choices and the usage, then "data: [DONE]\n\n".
// Logprobs follow the API's two shapes: completions {"tokens", "token_logprobs", "top_logprobs":
// [{token: logprob}], "text_offset"}; chat {"content": [{"token", "logprob", "bytes",
// "top_logprobs": [{"token", "logprob", "bytes"}]}]}. Completions with echo and logprobs: the
// prompt's tokens first (the first token's logprob and top_logprobs null), then the generated.
// vLLM's prompt_logprobs: [null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...], one
// entry per prompt token holding the token and its top alternatives; a field of each choice on
// completions, of the response on chat.
//
// Thread-safety: none; each request's formatter is used by one session at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/engine_api.h"
#include "coordinator/openai_protocol.h"
#include "coordinator/response_writer.h"
#include "coordinator/tool_calls.h"

namespace kvshard {

// The raw bytes a token stands for in logprobs output (may be an incomplete UTF-8 sequence).
using TokenBytesFn = std::function<std::string(int32_t)>;

struct ResponseContext {
    ApiEndpoint endpoint = ApiEndpoint::kCompletions;
    std::string id;       // "cmpl-..." or "chatcmpl-..."
    int64_t created = 0;  // Unix seconds
    std::string model;    // the served model name
    int n = 1;
    bool logprobs = false;       // num_top_logprobs >= 0
    bool include_usage = false;  // streams only
    // Chat with tools: each choice's output is parsed for calls.
    std::optional<ToolCallParserOptions> tools;
    // Completions with echo: the text each choice starts with (its prompt's), one per choice.
    std::vector<std::string> echo;
    // Choice i answers prompt i / choices_per_prompt (n); the engine's prompt logprobs of that
    // prompt come on the delta of its first choice.
    int choices_per_prompt = 1;
    // The answer carries vLLM's "prompt_logprobs" (per choice on completions, once on chat).
    bool prompt_logprobs = false;
    // Completions with echo and logprobs: the prompt's tokens lead each choice's logprobs.
    bool echo_logprobs = false;
    // With either: each prompt's token ids, in prompt order.
    std::vector<std::vector<int32_t>> prompt_token_ids;
};

// Collects the deltas of a non-streamed request into the final JSON body.
class CompletionAccumulator {
  public:
    CompletionAccumulator(ResponseContext context, TokenBytesFn token_bytes);
    void Add(const GenerationDelta& delta);
    std::string Body(const GenerationUsage& usage) const;

  private:
    struct Choice {
        std::string text;
        std::vector<GeneratedTokenLogprob> logprobs;
        std::vector<PromptTokenLogprob> prompt_logprobs;  // on a prompt's first choice
        std::string finish_reason;                        // "" until finished
        std::optional<ToolCallParser> parser;             // with tools
        std::vector<ToolCallOutput::Call> calls;
    };
    ResponseContext context_;
    TokenBytesFn token_bytes_;
    std::vector<Choice> choices_;
};

// Turns deltas into server-sent events.
class StreamFormatter {
  public:
    StreamFormatter(ResponseContext context, TokenBytesFn token_bytes);
    // The events sent before any delta: none (chat's role chunks come with the first text).
    std::string Start();
    // The event for one delta; "" when it carries nothing a client would see.
    std::string Delta(const GenerationDelta& delta);
    // The usage chunk (with include_usage) and "data: [DONE]".
    std::string Finish(const GenerationUsage& usage);
    // An error in the middle of a stream: {"error": {...}} as an event, then "data: [DONE]".
    std::string Error(const ApiError& error);

  private:
    std::string Chunk(const nlohmann::json& choices, const nlohmann::json* usage) const;
    std::string ToolDelta(const GenerationDelta& delta);
    // Chat: the {"role": "assistant"} chunk of every choice, once, before the first output.
    std::string RoleChunks();

    ResponseContext context_;
    TokenBytesFn token_bytes_;
    std::vector<int64_t> text_offsets_;    // completions logprobs: bytes of text sent per choice
    std::vector<ToolCallParser> parsers_;  // chat with tools: one per choice
    std::vector<int> num_calls_;           // per choice
    std::vector<bool> echoed_;             // completions with echo: the prompt was sent
    // Echo with logprobs: each prompt's scored tokens, as they came (before any of its tokens).
    std::vector<std::vector<PromptTokenLogprob>> prompt_scores_;
    bool role_sent_ = false;
};

// The OpenAI routes' ResponseWriter: a StreamFormatter or a CompletionAccumulator.
class OpenAiResponseWriter : public ResponseWriter {
  public:
    OpenAiResponseWriter(ResponseContext context, TokenBytesFn token_bytes)
        : formatter_(context, token_bytes), accumulator_(context, token_bytes) {}

    std::string StreamStart() override { return formatter_.Start(); }
    std::string StreamDelta(const GenerationDelta& delta) override {
        return formatter_.Delta(delta);
    }
    std::string StreamFinish(const GenerationUsage& usage) override {
        return formatter_.Finish(usage);
    }
    std::string StreamError(const ApiError& error) override { return formatter_.Error(error); }
    void Add(const GenerationDelta& delta) override { accumulator_.Add(delta); }
    std::string Body(const GenerationUsage& usage) override { return accumulator_.Body(usage); }

  private:
    StreamFormatter formatter_;
    CompletionAccumulator accumulator_;
};

// The usage object.
nlohmann::json UsageJson(const GenerationUsage& usage);

// "data: <json>\n\n"
std::string SseEvent(const std::string& data);

}  // namespace kvshard
