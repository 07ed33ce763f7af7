// Chat templates run by kvshard's Jinja interpreter (model/jinja_*.h): the variables HF's
// apply_chat_template passes, built from kvshard's chat messages, and the rendered prompt as
// pieces. Internal to model/chat_template.cc.
//
// The template sees what HF passes: messages (role, content; an assistant's tool_calls as
// [{"id", "type": "function", "function": {"name", "arguments": <object>}}]; a tool message's
// tool_call_id), tools (the OpenAI tools array, or none), documents (none),
// add_generation_prompt, bos_token and eos_token. Every string that comes from the request is
// literal in the pieces (the prompt encodes it as plain text); the template's own text is markup.
//
// Not supported for interpreted templates, refused by name: cache_control breakpoints (the
// template may move, repeat or transform message text, so a content offset has no one place in
// the prompt) and tools for a template that never names `tools` (they would be dropped).
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/chat_template.h"

namespace kvshard {
namespace jinja {
struct Template;
}

Result<std::shared_ptr<const jinja::Template>> ParseChatJinja(std::string_view source);

Result<RenderedChat> RenderJinjaChat(const jinja::Template& tmpl,
                                     const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt, const ChatTools* tools,
                                     const ChatTemplateTokens& tokens);

}  // namespace kvshard
