// kvshard's own renderings of the four built-in chat template styles (ChatML, Llama 2,
// Llama 3, Gemma): the markers each writes and the prompt, as pieces (markup and literal
// content) with the cache breakpoints placed. ChatTemplate::RenderChat calls them for a native
// style; ChatTemplate::FromJinja checks them against the model's template before using them.
// Internal to model/.
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/chat_template.h"

namespace kvshard::native_chat {

inline constexpr std::string_view kImStart = "<|im_start|>";
inline constexpr std::string_view kImEnd = "<|im_end|>";
inline constexpr std::string_view kHeaderStart = "<|start_header_id|>";
inline constexpr std::string_view kHeaderEnd = "<|end_header_id|>";
inline constexpr std::string_view kEotId = "<|eot_id|>";
inline constexpr std::string_view kStartOfTurn = "<start_of_turn>";
inline constexpr std::string_view kEndOfTurn = "<end_of_turn>";

// A ChatML template may carry a default system prompt as a literal:
//   '<|im_start|>system\nYou are a helpful AI assistant ...<|im_end|>\n'
// The newline is either a real one or the two characters "\n" of a Jinja string literal. Returns
// "" when there is none or the text between the markers is not a plain literal (an expression).
std::string DefaultChatMlSystemPrompt(std::string_view jinja);

// `default_system` opens the prompt when the conversation has no system message.
RenderedChat RenderChatMl(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                          const std::string& default_system, const ChatTools* tools);
// Llama 2 and Gemma have no tool-call convention: tools or tool calls are InvalidArgument.
Result<RenderedChat> RenderLlama2(const std::vector<ChatMessage>& messages,
                                  const ChatTemplateTokens& tokens, const ChatTools* tools);
Result<RenderedChat> RenderGemma(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt, const ChatTemplateTokens& tokens,
                                 const ChatTools* tools);
Result<RenderedChat> RenderLlama3(const std::vector<ChatMessage>& messages,
                                  bool add_generation_prompt, const ChatTemplateTokens& tokens,
                                  const ChatTools* tools);

}  // namespace kvshard::native_chat
