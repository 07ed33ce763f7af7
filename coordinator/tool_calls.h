// Tool calling, shared by the OpenAI chat route and the Anthropic Messages route: the tools a
// request offers rendered into the prompt in the convention the model family was trained on,
// and the model's output parsed back into tool calls, whole or as it streams.
//
//   kHermes      ChatML models (SmolLM2, Qwen 2.5, Hermes): the tools as JSON lines inside
//                <tools></tools> in the system prompt; the model calls with
//                <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
//   kLlama3Json  Llama 3.x: the tools as JSON in the first user message; the model answers
//                with a bare {"name": ..., "parameters": {...}} object (one or more, separated
//                by ";" or newlines), optionally after <|python_tag|>.
//   kMistral     Mistral v0.3 / Nemo: the template itself renders the tools ([AVAILABLE_TOOLS]);
//                the model calls with [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...].
//                [TOOL_CALLS] is a control token of Mistral's vocabularies, whose text the
//                output drops unless skip_special_tokens is false, so an answer that opens with
//                the bare JSON array is read as calls too. Mistral's templates take only tool
//                call ids of 9 letters and digits: the parser's id_length cuts ids to fit.
//
// With tool_choice "required"/"any" or a named tool the answer is held by constrained decoding
// (ToolCallGrammar, grammar/) to calls of the allowed tools in the family's syntax, with
// arguments valid for each tool's parameters schema. Otherwise ("auto") calls are parsed from
// free output: a call whose JSON does not parse, or that names a tool the request may not call,
// stays text (docs/http_api.md).
//
// Thread-safety: ToolCallParser is used by one session at a time; the rest are pure functions.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "grammar/grammar.h"
#include "model/chat_template.h"

namespace kvshard {

struct ToolDefinition {
    std::string name;
    std::string description;
    std::string parameters = R"({"type":"object","properties":{}})";  // JSON Schema, as JSON text
    int64_t cache_ttl_ms = 0;  // > 0: a prompt-caching breakpoint after this tool
    bool strict = false;       // OpenAI "strict": calls must follow the schema exactly
};

enum class ToolChoiceMode {
    kAuto,      // the model decides
    kNone,      // no tools: none are rendered and no call is parsed
    kRequired,  // OpenAI "required", Anthropic "any": some call is asked for
    kNamed,     // a call of `name` is asked for
};

struct ToolChoice {
    ToolChoiceMode mode = ToolChoiceMode::kAuto;
    std::string name = {};  // kNamed
};

enum class ToolCallSyntax { kHermes, kLlama3Json, kMistral };

// The convention of a chat template style; InvalidArgument for styles without one (Llama 2).
Result<ToolCallSyntax> ToolCallSyntaxFor(ChatTemplateStyle style);
// The convention of a chat template: kMistral for an interpreted template that writes Mistral's
// [TOOL_CALLS] (ChatTemplate::writes_mistral_tool_calls), else that of its ToolCallStyle().
Result<ToolCallSyntax> ToolCallSyntaxFor(const ChatTemplate& chat_template);

// The tools prompt for ChatTemplate::RenderChat: empty when there are no tools or the choice is
// kNone. Each tool with cache_ttl_ms gets a cache mark after its definition. kMistral has no
// prompt text (only `definitions`: its templates render the tools themselves).
ChatTools RenderTools(ToolCallSyntax syntax, const std::vector<ToolDefinition>& tools,
                      const ToolChoice& choice);

// The grammar of an answer made only of calls (one when single_call, else one or more, a newline
// apart; kMistral: one JSON array of them, without the [TOOL_CALLS] control token) of the tools
// `choice` allows, each call's arguments valid for its tool's parameters
// (grammar/compilers.h's JSON Schema subset): for tool_choice kRequired and kNamed. Errors name
// the schema keyword by its path, "tools[i].function.parameters....".
Result<std::shared_ptr<const grammar::Grammar>> ToolCallGrammar(
    ToolCallSyntax syntax, const std::vector<ToolDefinition>& tools, const ToolChoice& choice,
    bool single_call);

// What the parser recognised in the output: text to show, or a whole call.
struct ToolCallOutput {
    std::string text;  // when !call
    struct Call {
        std::string id;  // id_prefix + its index in the answer (cut to id_length)
        std::string name;
        std::string arguments;  // a JSON object, compact
    };
    std::optional<Call> call;
};

struct ToolCallParserOptions {
    ToolCallSyntax syntax = ToolCallSyntax::kHermes;
    std::vector<std::string> allowed_names;  // the tools a call may name
    std::string id_prefix = "call_";         // ids are id_prefix + 0, 1, ...
    // > 0: every id is exactly this long where id_prefix allows: the first characters of
    // id_prefix, then the index (Mistral's 9-character ids).
    size_t id_length = 0;
    int max_calls = 1 << 20;  // calls beyond this stay text
};

// Splits a choice's output into text and calls as it arrives. Text that may still turn out to be
// the start of a call is held back until it is resolved; whitespace around calls is dropped.
class ToolCallParser {
  public:
    explicit ToolCallParser(ToolCallParserOptions options);

    // The outputs that the text so far resolves, in order.
    std::vector<ToolCallOutput> Feed(std::string_view text);
    // The output is over: everything still held, resolved (an unfinished call that parses is a
    // call, else text).
    std::vector<ToolCallOutput> Finish();
    int num_calls() const { return num_calls_; }

  private:
    enum class State { kText, kInCall, kUndecided, kJson };
    void EmitText(std::string text, std::vector<ToolCallOutput>& out);
    // The call a JSON text holds, if it is one this request may make.
    std::optional<ToolCallOutput::Call> ParseCall(std::string_view json_text) const;
    void EmitCallOrText(std::string_view body, std::string raw, std::vector<ToolCallOutput>& out);
    void FeedHermes(std::vector<ToolCallOutput>& out);
    void FinishLlama3(std::vector<ToolCallOutput>& out);
    void FeedMistral(std::vector<ToolCallOutput>& out);
    // A [TOOL_CALLS] JSON array (or one call object): all its calls, or `raw` as text.
    void EmitMistralCalls(std::string_view body, std::string raw, std::vector<ToolCallOutput>& out);
    std::string NextId();

    ToolCallParserOptions options_;
    State state_;
    std::string buffer_;      // text not yet resolved
    std::string pending_ws_;  // whitespace held until text follows (dropped next to a call)
    int num_calls_ = 0;
    bool marked_ = false;  // kMistral, kInCall: the call array followed [TOOL_CALLS]
};

}  // namespace kvshard
