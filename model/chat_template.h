// ChatTemplate: turns chat messages into the prompt text a chat model was trained on.
//
// The template that comes with a model (GGUF tokenizer.chat_template, tokenizer_config.json
// chat_template) is Jinja. kvshard renders it one of two ways:
//   native       the template is recognised as one of the styles below by its markers AND renders
//                a set of probe conversations byte for byte as the native renderer does (checked
//                with the interpreter at load). Native rendering places cache_control
//                breakpoints exactly.
//   interpreted  any other template, or --chat-template jinja: kvshard's Jinja interpreter
//                (model/jinja_*.h, model/chat_template_jinja.h) runs the template itself with
//                the variables HF's apply_chat_template passes. cache_control breakpoints are
//                refused by name; tools are passed as the OpenAI tools array.
// The native styles:
//   kChatMl  "<|im_start|>role\ncontent<|im_end|>\n" per message (SmolLM2, Qwen). A default
//            system prompt written into the template (SmolLM2: "You are a helpful AI assistant
//            named SmolLM, trained by Hugging Face") is inserted when the first message is not
//            a system message, as the template does.
//   kLlama2  "<s>[INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST] assistant </s>..."; roles
//            after an optional system message must alternate user/assistant.
//   kLlama3  "<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>"
//            (Llama 3.0's template; 3.1's date preamble is not reproduced, so 3.1 templates are
//            interpreted).
//   kGemma   "<bos><start_of_turn>user\ncontent<end_of_turn>\n<start_of_turn>model\n..." (Gemma
//            2/3): the assistant's turn is "model", a system message opens the first user turn
//            followed by a blank line, roles alternate user/assistant; no tool convention.
// Tool use (RenderChat with ChatTools; coordinator/tool_calls.h writes the tools prompt):
//   kChatMl  the Hermes / Qwen 2.5 convention: the tools prompt follows the system prompt in
//            the system turn; an assistant's calls are "\n<tool_call>\n{"name": ..., "arguments":
//            ...}\n</tool_call>" after its content; consecutive "tool" messages share one user
//            turn, each as "\n<tool_response>\n...\n</tool_response>".
//   kLlama3  Llama 3.1's JSON convention: the tools prompt opens the first user message; an
//            assistant's calls are {"name": ..., "parameters": ...} objects (one a line); a
//            "tool" message is an "ipython" turn.
//   kLlama2  has no tool convention: tools, tool calls and "tool" messages are InvalidArgument.
// An interpreted template has a family, by its markers: ChatML (its tool calls are parsed as
// Hermes <tool_call>), Llama 3 (JSON calls), Gemma, or none (DeepSeek, ...: tools are refused,
// since kvshard cannot parse that family's calls; turns end with EOS). One that writes
// Mistral's [TOOL_CALLS] and [AVAILABLE_TOOLS] has Mistral's calls (writes_mistral_tool_calls).
//
// Thread-safety: immutable after creation; Render may be called from any thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/tokenizer.h"
#include "model/tokenizer_data.h"

namespace kvshard {

// A prompt-caching breakpoint inside a text (engine_api.h CacheBreakpoint): the cached prefix
// ends after the first `content_end` bytes of that text as the template renders it.
struct ChatCacheMark {
    size_t content_end = 0;    // <= the text's size
    int64_t ttl_ms = 300'000;  // how long the prefix stays pinned after its last use
};

// A call an assistant message made (OpenAI tool_calls, Anthropic tool_use blocks).
struct ChatToolCall {
    std::string id;
    std::string name;
    std::string arguments = "{}";  // a JSON object, as compact JSON text
    int64_t cache_ttl_ms = 0;      // > 0: a cache breakpoint right after this call's text
};

struct ChatMessage {
    std::string role;  // "system", "user", "assistant" or "tool"
    std::string content;
    std::vector<ChatToolCall> tool_calls = {};  // assistant: the calls after its content
    std::string tool_call_id = {};              // tool: the call this message answers
    // Breakpoints inside `content`, in increasing content_end order (the OpenAI route's
    // cache_control extension and Anthropic's cache_control both land here).
    std::vector<ChatCacheMark> cache_marks = {};
};

// The tools a request offers, as prompt text in the model family's convention
// (coordinator/tool_calls.h), placed where the style's template puts it. Empty: no tools.
struct ChatTools {
    std::string prompt;
    std::vector<ChatCacheMark> cache_marks;  // breakpoints inside `prompt` (after a tool)
    // The OpenAI "tools" array as JSON text ([{"type": "function", "function": {...}}]): what an
    // interpreted template renders instead of `prompt`.
    std::string definitions = {};
};

// A breakpoint's place in the rendered prompt.
struct RenderedCacheMark {
    size_t text_end = 0;  // bytes of the rendered text before the breakpoint
    int64_t ttl_ms = 0;
};

struct RenderedChat {
    std::vector<TextPiece> pieces;               // as RenderPieces
    std::vector<RenderedCacheMark> cache_marks;  // in the order of the text
};

enum class ChatTemplateStyle { kChatMl, kLlama2, kLlama3, kGemma };
// "chatml", "llama2", "llama3", "gemma"
std::string_view ChatTemplateStyleName(ChatTemplateStyle style);

// Text of the special tokens the Jinja templates refer to as bos_token / eos_token.
struct ChatTemplateTokens {
    std::string bos;
    std::string eos;
};

// The BOS and EOS piece texts of a vocabulary ("" where it has none).
ChatTemplateTokens ChatTemplateTokensOf(const TokenizerData& data);

namespace jinja {
struct Template;
}

class ChatTemplate {
  public:
    // A native style when the template is recognised by its markers ("<|im_start|>",
    // "<|start_header_id|>", "[INST]" with "<<SYS>>", "<start_of_turn>") and renders the probe
    // conversations as that style does; otherwise the template interpreted. InvalidArgument
    // naming the position when the template does not parse and is not recognised; `origin`
    // names the template in messages (a file, "the model's chat template").
    static Result<ChatTemplate> FromJinja(std::string_view jinja, const ChatTemplateTokens& tokens,
                                          std::string_view origin);
    // The template interpreted, whatever its shape (--chat-template jinja).
    static Result<ChatTemplate> FromJinjaInterpreted(std::string_view jinja,
                                                     const ChatTemplateTokens& tokens,
                                                     std::string_view origin);
    // A built-in style with no default system prompt.
    static ChatTemplate FromStyle(ChatTemplateStyle style, const ChatTemplateTokens& tokens);

    // The prompt text. With add_generation_prompt it ends with the opening of an assistant turn
    // (no effect for kLlama2, whose user turns already end with "[/INST]"). InvalidArgument when
    // the messages break the style's rules (kLlama2 role order).
    Result<std::string> Render(const std::vector<ChatMessage>& messages,
                               bool add_generation_prompt) const;
    // The same text in pieces: the template's own text (markers, role names, BOS/EOS) and, as
    // literal pieces, the messages' content, so that special-token text a user writes can be
    // encoded as plain text (Tokenizer::EncodePieces). Adjacent pieces differ in `literal`.
    Result<std::vector<TextPiece>> RenderPieces(const std::vector<ChatMessage>& messages,
                                                bool add_generation_prompt) const;

    // The pieces together with where each cache mark of the messages (and of `tools`) falls in
    // the text. `tools` (may be null or empty) is rendered as the style's tool convention says;
    // InvalidArgument when the style has none and tools, tool calls or "tool" messages are given.
    Result<RenderedChat> RenderChat(const std::vector<ChatMessage>& messages,
                                    bool add_generation_prompt, const ChatTools* tools) const;

    // The native style, or an interpreted template's family (kLlama2 when it has none: no tool
    // convention, turns end with EOS).
    ChatTemplateStyle style() const { return style_; }
    bool interpreted() const { return jinja_ != nullptr; }
    // The style whose tool-call syntax the model writes: style(), or InvalidArgument for an
    // interpreted template of no family kvshard parses calls of.
    Result<ChatTemplateStyle> ToolCallStyle() const;
    // An interpreted template whose source writes "[TOOL_CALLS]" and "[AVAILABLE_TOOLS]"
    // (Mistral v0.3, Nemo): the model calls tools in Mistral's syntax, and the template renders
    // the tools itself.
    bool writes_mistral_tool_calls() const { return mistral_tool_calls_; }
    const std::string& default_system_prompt() const { return default_system_prompt_; }
    // The text that ends an assistant turn ("<|im_end|>", "<|eot_id|>", the EOS text): callers
    // may stop generation on its token as well as on EOS.
    std::string end_of_turn() const;

  private:
    ChatTemplate(ChatTemplateStyle style, ChatTemplateTokens tokens, std::string default_system,
                 std::shared_ptr<const jinja::Template> jinja = nullptr, bool has_family = true,
                 bool mistral_tool_calls = false)
        : style_(style),
          tokens_(std::move(tokens)),
          default_system_prompt_(std::move(default_system)),
          jinja_(std::move(jinja)),
          has_family_(has_family),
          mistral_tool_calls_(mistral_tool_calls) {}

    ChatTemplateStyle style_;
    ChatTemplateTokens tokens_;
    std::string default_system_prompt_;
    std::shared_ptr<const jinja::Template> jinja_;  // set: interpreted
    bool has_family_;
    bool mistral_tool_calls_;
};

// The built-in style a model of `architecture` (ModelSpec::architecture) was trained to chat in
// when its file carries no template: kGemma for "gemma3" (Google's GGUF conversions of the base
// models ship without tokenizer.chat_template, yet the vocabulary has <start_of_turn>). nullopt
// for the others, whose format varies by fine-tune.
std::optional<ChatTemplateStyle> DefaultChatStyleFor(std::string_view architecture);

// The template the server uses. `override_spec` (--chat-template / chat_template in the config)
// wins: a style name; "jinja" (the model's own template, interpreted); else a file holding a
// Jinja template (FromJinja). Otherwise the model's own template (FromJinja); without one,
// DefaultChatStyleFor(architecture) (logged at info). nullopt when none of them exists: chat
// requests then fail with a message saying how to give one.
Result<std::optional<ChatTemplate>> ResolveChatTemplate(std::string_view model_template,
                                                        const std::string& override_spec,
                                                        const ChatTemplateTokens& tokens,
                                                        std::string_view architecture = "");

}  // namespace kvshard
