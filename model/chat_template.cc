#include "model/chat_template.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "model/chat_template_jinja.h"
#include "model/chat_template_native.h"

namespace kvshard {

std::string_view ChatTemplateStyleName(ChatTemplateStyle style) {
    switch (style) {
        case ChatTemplateStyle::kChatMl:
            return "chatml";
        case ChatTemplateStyle::kLlama2:
            return "llama2";
        case ChatTemplateStyle::kLlama3:
            return "llama3";
        case ChatTemplateStyle::kGemma:
            return "gemma";
    }
    return "chatml";
}

ChatTemplateTokens ChatTemplateTokensOf(const TokenizerData& data) {
    auto piece = [&data](int32_t id) {
        return id >= 0 && id < static_cast<int32_t>(data.tokens.size()) ? data.tokens[id]
                                                                        : std::string();
    };
    return {piece(data.bos_id), piece(data.eos_id)};
}

using native_chat::kEndOfTurn;
using native_chat::kEotId;
using native_chat::kHeaderStart;
using native_chat::kImEnd;
using native_chat::kImStart;
using native_chat::kStartOfTurn;

namespace {

bool Contains(std::string_view s, std::string_view needle) {
    return s.find(needle) != std::string_view::npos;
}

// The style a template's markers suggest, if any.
std::optional<ChatTemplateStyle> StyleByMarkers(std::string_view jinja) {
    if (Contains(jinja, kImStart)) return ChatTemplateStyle::kChatMl;
    if (Contains(jinja, kHeaderStart) && Contains(jinja, kEotId)) return ChatTemplateStyle::kLlama3;
    if (Contains(jinja, "[INST]") && Contains(jinja, "<<SYS>>")) return ChatTemplateStyle::kLlama2;
    if (Contains(jinja, kStartOfTurn) && Contains(jinja, kEndOfTurn))
        return ChatTemplateStyle::kGemma;
    return std::nullopt;
}

// Conversations on which a native style must render as the template does to stand in for it.
const std::vector<std::vector<ChatMessage>>& ProbeConversations() {
    static const auto* kProbes = [] {
        auto message = [](std::string role, std::string content) {
            ChatMessage m;
            m.role = std::move(role);
            m.content = std::move(content);
            return m;
        };
        return new std::vector<std::vector<ChatMessage>>{
            {message("system", " Be brief.\n"), message("user", " Hi there "),
             message("assistant", "Hello! "), message("user", "What is 2+2?")},
            {message("user", "Hello")},
            {message("user", "Hello"), message("assistant", " Hi.")},
        };
    }();
    return *kProbes;
}

bool RendersAlike(const ChatTemplate& a, const ChatTemplate& b) {
    for (const auto& conversation : ProbeConversations()) {
        for (bool gen : {true, false}) {
            Result<std::string> x = a.Render(conversation, gen);
            Result<std::string> y = b.Render(conversation, gen);
            if (!x.ok() || !y.ok() || *x != *y) return false;
        }
    }
    return true;
}

}  // namespace

Result<ChatTemplate> ChatTemplate::FromJinjaInterpreted(std::string_view jinja,
                                                        const ChatTemplateTokens& tokens,
                                                        std::string_view origin) {
    Result<std::shared_ptr<const jinja::Template>> parsed = ParseChatJinja(jinja);
    if (!parsed.ok()) {
        return InvalidArgument(std::string(origin) + ": " + parsed.status().message());
    }
    const std::optional<ChatTemplateStyle> family = StyleByMarkers(jinja);
    const bool mistral_tool_calls =
        Contains(jinja, "[TOOL_CALLS]") && Contains(jinja, "[AVAILABLE_TOOLS]");
    return ChatTemplate(family.value_or(ChatTemplateStyle::kLlama2), tokens, "",
                        std::move(parsed).value(), family.has_value(), mistral_tool_calls);
}

Result<ChatTemplate> ChatTemplate::FromJinja(std::string_view jinja,
                                             const ChatTemplateTokens& tokens,
                                             std::string_view origin) {
    const std::optional<ChatTemplateStyle> style = StyleByMarkers(jinja);
    Result<ChatTemplate> interpreted = FromJinjaInterpreted(jinja, tokens, origin);
    if (!style) {
        if (interpreted.ok()) {
            spdlog::info("{} is of no built-in style; running the template itself", origin);
        }
        return interpreted;
    }
    const std::string default_system =
        *style == ChatTemplateStyle::kChatMl ? native_chat::DefaultChatMlSystemPrompt(jinja) : "";
    ChatTemplate native(*style, tokens, default_system);
    if (!interpreted.ok()) {
        spdlog::warn(
            "{} does not parse ({}); rendering it as the built-in '{}' style its "
            "markers suggest",
            origin, interpreted.status().message(), ChatTemplateStyleName(*style));
        return native;
    }
    if (RendersAlike(native, *interpreted)) return native;
    spdlog::info(
        "{} has '{}' markers but renders differently from kvshard's built-in style; "
        "running the template itself",
        origin, ChatTemplateStyleName(*style));
    return interpreted;
}

Result<ChatTemplateStyle> ChatTemplate::ToolCallStyle() const {
    if (interpreted() && !has_family_) {
        return InvalidArgument(
            "this model's chat template writes tool calls in a syntax kvshard does not parse "
            "(kvshard parses Hermes <tool_call>, Llama 3 JSON and Mistral [TOOL_CALLS] calls)");
    }
    return style_;
}

ChatTemplate ChatTemplate::FromStyle(ChatTemplateStyle style, const ChatTemplateTokens& tokens) {
    return ChatTemplate(style, tokens, "");
}

Result<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                         bool add_generation_prompt) const {
    KV_ASSIGN_OR_RETURN(std::vector<TextPiece> pieces,
                        RenderPieces(messages, add_generation_prompt));
    std::string text;
    for (const TextPiece& p : pieces) text += p.text;
    return text;
}

Result<std::vector<TextPiece>> ChatTemplate::RenderPieces(const std::vector<ChatMessage>& messages,
                                                          bool add_generation_prompt) const {
    KV_ASSIGN_OR_RETURN(RenderedChat r, RenderChat(messages, add_generation_prompt, nullptr));
    return std::move(r.pieces);
}

Result<RenderedChat> ChatTemplate::RenderChat(const std::vector<ChatMessage>& messages,
                                              bool add_generation_prompt,
                                              const ChatTools* tools) const {
    if (jinja_) return RenderJinjaChat(*jinja_, messages, add_generation_prompt, tools, tokens_);
    switch (style_) {
        case ChatTemplateStyle::kChatMl:
            return native_chat::RenderChatMl(messages, add_generation_prompt,
                                             default_system_prompt_, tools);
        case ChatTemplateStyle::kLlama2:
            return native_chat::RenderLlama2(messages, tokens_, tools);
        case ChatTemplateStyle::kLlama3:
            return native_chat::RenderLlama3(messages, add_generation_prompt, tokens_, tools);
        case ChatTemplateStyle::kGemma:
            return native_chat::RenderGemma(messages, add_generation_prompt, tokens_, tools);
    }
    return Internal("unknown chat template style");
}

std::string ChatTemplate::end_of_turn() const {
    switch (style_) {
        case ChatTemplateStyle::kChatMl:
            return std::string(kImEnd);
        case ChatTemplateStyle::kLlama2:
            return tokens_.eos;
        case ChatTemplateStyle::kLlama3:
            return std::string(kEotId);
        case ChatTemplateStyle::kGemma:
            return std::string(kEndOfTurn);
    }
    return tokens_.eos;
}

std::optional<ChatTemplateStyle> DefaultChatStyleFor(std::string_view architecture) {
    if (architecture == "gemma3") return ChatTemplateStyle::kGemma;
    return std::nullopt;
}

Result<std::optional<ChatTemplate>> ResolveChatTemplate(std::string_view model_template,
                                                        const std::string& override_spec,
                                                        const ChatTemplateTokens& tokens,
                                                        std::string_view architecture) {
    if (override_spec == "jinja") {
        if (model_template.empty()) {
            return NotFound("--chat-template jinja: the model carries no chat template to run");
        }
        KV_ASSIGN_OR_RETURN(ChatTemplate t,
                            ChatTemplate::FromJinjaInterpreted(model_template, tokens,
                                                               "the model's chat template"));
        return std::optional<ChatTemplate>(std::move(t));
    }
    if (!override_spec.empty()) {
        for (ChatTemplateStyle style : {ChatTemplateStyle::kChatMl, ChatTemplateStyle::kLlama2,
                                        ChatTemplateStyle::kLlama3, ChatTemplateStyle::kGemma}) {
            if (override_spec == ChatTemplateStyleName(style)) {
                return std::optional<ChatTemplate>(ChatTemplate::FromStyle(style, tokens));
            }
        }
        std::ifstream in(override_spec, std::ios::binary);
        if (!in) {
            return NotFound(
                "--chat-template " + override_spec +
                ": neither a built-in style (chatml, llama2, llama3, gemma), nor jinja, "
                "nor a readable file");
        }
        std::stringstream text;
        text << in.rdbuf();
        KV_ASSIGN_OR_RETURN(
            ChatTemplate t,
            ChatTemplate::FromJinja(text.str(), tokens, "chat template file " + override_spec));
        return std::optional<ChatTemplate>(std::move(t));
    }
    if (model_template.empty()) {
        const std::optional<ChatTemplateStyle> style = DefaultChatStyleFor(architecture);
        if (!style) return std::optional<ChatTemplate>();
        spdlog::info(
            "the model has no chat template: using the built-in '{}' template of its "
            "architecture {} (--chat-template overrides)",
            ChatTemplateStyleName(*style), architecture);
        return std::optional<ChatTemplate>(ChatTemplate::FromStyle(*style, tokens));
    }
    KV_ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::FromJinja(model_template, tokens,
                                                                "the model's chat template"));
    return std::optional<ChatTemplate>(std::move(t));
}

}  // namespace kvshard
