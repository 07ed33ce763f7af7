#include "model/chat_template.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "model/chat_template_jinja.h"

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

namespace {

constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";
constexpr std::string_view kHeaderStart = "<|start_header_id|>";
constexpr std::string_view kHeaderEnd = "<|end_header_id|>";
constexpr std::string_view kEotId = "<|eot_id|>";
constexpr std::string_view kStartOfTurn = "<start_of_turn>";
constexpr std::string_view kEndOfTurn = "<end_of_turn>";

bool Contains(std::string_view s, std::string_view needle) {
    return s.find(needle) != std::string_view::npos;
}

// Python's str.strip() (and Jinja's trim) over ASCII whitespace.
std::string_view Strip(std::string_view s) {
    constexpr std::string_view kSpace = " \t\n\r\v\f";
    const size_t begin = s.find_first_not_of(kSpace);
    if (begin == std::string_view::npos) return {};
    const size_t end = s.find_last_not_of(kSpace);
    return s.substr(begin, end - begin + 1);
}

// A ChatML template may carry a default system prompt as a literal:
//   '<|im_start|>system\nYou are a helpful AI assistant ...<|im_end|>\n'
// The newline is either a real one or the two characters "\n" of a Jinja string literal. Returns
// "" when there is none or the text between the markers is not a plain literal (an expression).
std::string DefaultChatMlSystemPrompt(std::string_view jinja) {
    for (std::string_view opening : {"<|im_start|>system\n", "<|im_start|>system\\n"}) {
        const size_t start = jinja.find(opening);
        if (start == std::string_view::npos) continue;
        const size_t text_start = start + opening.size();
        const size_t end = jinja.find(kImEnd, text_start);
        if (end == std::string_view::npos) return "";
        std::string_view literal = jinja.substr(text_start, end - text_start);
        if (literal.find_first_of("'\"{}+") != std::string_view::npos) return "";
        std::string text;
        for (size_t i = 0; i < literal.size(); ++i) {
            if (literal[i] == '\\' && i + 1 < literal.size() && literal[i + 1] == 'n') {
                text += '\n';
                ++i;
            } else {
                text += literal[i];
            }
        }
        return text;
    }
    return "";
}

// Pieces of a rendered prompt: the template's own text (markers, role names) and the messages'
// content, which is literal (TextPiece).
class PieceWriter {
  public:
    PieceWriter& Markup(std::string_view text) { return Add(text, false); }
    PieceWriter& Content(std::string_view text) { return Add(text, true); }
    // Content whose cache marks are recorded at their place in this writer's text.
    PieceWriter& Content(std::string_view text, const std::vector<ChatCacheMark>& marks,
                         std::vector<RenderedCacheMark>* out) {
        const size_t start = size();
        for (const ChatCacheMark& m : marks) {
            out->push_back({start + std::min(m.content_end, text.size()), m.ttl_ms});
        }
        return Content(text);
    }
    // A mark at the current end of the text.
    void MarkHere(int64_t ttl_ms, std::vector<RenderedCacheMark>* out) const {
        if (ttl_ms > 0) out->push_back({size(), ttl_ms});
    }
    // Python's str.strip() over all the text, as if it were one string (the Jinja templates strip
    // content and markup together).
    PieceWriter& Strip() {
        constexpr std::string_view kSpace = " \t\n\r\v\f";
        while (!pieces_.empty()) {
            std::string& t = pieces_.front().text;
            t.erase(0, std::min(t.find_first_not_of(kSpace), t.size()));
            if (!t.empty()) break;
            pieces_.erase(pieces_.begin());
        }
        while (!pieces_.empty()) {
            std::string& t = pieces_.back().text;
            const size_t last = t.find_last_not_of(kSpace);
            t.erase(last == std::string::npos ? 0 : last + 1);
            if (!t.empty()) break;
            pieces_.pop_back();
        }
        return *this;
    }
    PieceWriter& Append(const PieceWriter& other) {
        for (const TextPiece& p : other.pieces_) Add(p.text, p.literal);
        return *this;
    }
    size_t size() const {
        size_t n = 0;
        for (const TextPiece& p : pieces_) n += p.text.size();
        return n;
    }
    std::string Text() const {
        std::string text;
        for (const TextPiece& p : pieces_) text += p.text;
        return text;
    }
    std::vector<TextPiece> Take() { return std::move(pieces_); }

  private:
    PieceWriter& Add(std::string_view text, bool literal) {
        if (text.empty()) return *this;
        if (!pieces_.empty() && pieces_.back().literal == literal) {
            pieces_.back().text.append(text);
        } else {
            pieces_.push_back({std::string(text), literal});
        }
        return *this;
    }
    std::vector<TextPiece> pieces_;
};

size_t LeadingSpace(std::string_view s) {
    const size_t begin = s.find_first_not_of(" \t\n\r\v\f");
    return begin == std::string_view::npos ? s.size() : begin;
}

// The marks of a text that is written stripped (Python's strip()): where they fall in the
// stripped text, which starts `leading` bytes in and holds `size` bytes.
std::vector<ChatCacheMark> StrippedMarks(const std::vector<ChatCacheMark>& marks, size_t leading,
                                         size_t size) {
    std::vector<ChatCacheMark> out;
    for (const ChatCacheMark& m : marks) {
        const size_t end = m.content_end > leading ? m.content_end - leading : 0;
        out.push_back({std::min(end, size), m.ttl_ms});
    }
    return out;
}

// A JSON string literal, for the names in tool-call text.
std::string JsonString(std::string_view s) {
    std::string out = "\"";
    for (const char c : s) {
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            default:
                if (static_cast<unsigned char>(c) < 0x20) {
                    static constexpr char kHex[] = "0123456789abcdef";
                    out += "\\u00";
                    out += kHex[(c >> 4) & 0xF];
                    out += kHex[c & 0xF];
                } else {
                    out += c;
                }
        }
    }
    return out + "\"";
}

// {"name": "<name>", "<arguments_key>": <arguments>}, as the tool conventions write a call.
std::string CallText(const ChatToolCall& call, std::string_view arguments_key) {
    return "{\"name\": " + JsonString(call.name) + ", \"" + std::string(arguments_key) +
           "\": " + (call.arguments.empty() ? std::string("{}") : call.arguments) + "}";
}

bool HasTools(const ChatTools* tools) { return tools != nullptr && !tools->prompt.empty(); }

RenderedChat RenderChatMl(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                          const std::string& default_system, const ChatTools* tools) {
    PieceWriter out;
    RenderedChat r;
    auto open = [&out](std::string_view role) { out.Markup(kImStart).Markup(role).Markup("\n"); };
    auto close = [&out] { out.Markup(kImEnd).Markup("\n"); };
    size_t first = 0;
    const bool system_first = !messages.empty() && messages.front().role == "system";
    // The system turn: the client's system prompt, else the template's default one; the tools
    // prompt after it.
    if (system_first || (!messages.empty() && (!default_system.empty() || HasTools(tools)))) {
        open("system");
        const std::string& system = system_first ? messages.front().content : default_system;
        if (system_first) {
            out.Content(system, messages.front().cache_marks, &r.cache_marks);
            first = 1;
        } else {
            out.Content(system);
        }
        if (HasTools(tools)) {
            if (!system.empty()) out.Markup("\n\n");
            out.Content(tools->prompt, tools->cache_marks, &r.cache_marks);
        }
        close();
    }
    for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "tool") {
            if (i == 0 || messages[i - 1].role != "tool") out.Markup(kImStart).Markup("user");
            out.Markup("\n<tool_response>\n");
            out.Content(m.content, m.cache_marks, &r.cache_marks);
            out.Markup("\n</tool_response>");
            if (i + 1 == messages.size() || messages[i + 1].role != "tool") close();
            continue;
        }
        if (!m.tool_calls.empty()) {
            out.Markup(kImStart).Markup(m.role);
            if (!m.content.empty()) out.Markup("\n");
            out.Content(m.content, m.cache_marks, &r.cache_marks);
            for (const ChatToolCall& call : m.tool_calls) {
                out.Markup("\n<tool_call>\n").Content(CallText(call, "arguments"));
                out.Markup("\n</tool_call>");
                out.MarkHere(call.cache_ttl_ms, &r.cache_marks);
            }
            close();
            continue;
        }
        open(m.role);
        out.Content(m.content, m.cache_marks, &r.cache_marks);
        close();
    }
    if (add_generation_prompt) out.Markup(kImStart).Markup("assistant\n");
    r.pieces = out.Take();
    return r;
}

Status NoToolConvention(std::string_view what, std::string_view style = "Llama 2") {
    return InvalidArgument("the " + std::string(style) +
                           " chat template has no tool-call convention, so " + std::string(what) +
                           " cannot be rendered; use a ChatML or Llama 3 model (or "
                           "--chat-template chatml|llama3)");
}

Result<RenderedChat> RenderLlama2(const std::vector<ChatMessage>& messages,
                                  const ChatTemplateTokens& tokens, const ChatTools* tools) {
    if (HasTools(tools)) return NoToolConvention("tools");
    size_t first = 0;
    const bool has_system = !messages.empty() && messages.front().role == "system";
    if (has_system) first = 1;
    PieceWriter out;
    RenderedChat r;
    for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "tool" || !m.tool_calls.empty()) {
            return NoToolConvention("tool calls and tool results");
        }
        const bool expect_user = (i - first) % 2 == 0;
        if ((m.role == "user") != expect_user || (m.role != "user" && m.role != "assistant")) {
            return InvalidArgument(
                "the Llama 2 chat template needs roles alternating user/assistant/user/... after "
                "an optional first system message; message " +
                std::to_string(i) + " has role '" + m.role + "'");
        }
        if (m.role == "user") out.Markup(tokens.bos).Markup("[INST] ");
        if (m.role == "assistant") out.Markup(" ");
        // The template strips the content (with the system block folded into the first one).
        PieceWriter content;
        std::vector<RenderedCacheMark> marks;  // in `content`, before the strip
        if (i == first && has_system) {
            content.Markup("<<SYS>>\n")
                .Content(messages.front().content, messages.front().cache_marks, &marks);
            content.Markup("\n<</SYS>>\n\n");
        }
        content.Content(m.content, m.cache_marks, &marks);
        const size_t leading = LeadingSpace(content.Text());
        content.Strip();
        const size_t start = out.size();
        for (const RenderedCacheMark& mark : marks) {
            const size_t end = mark.text_end > leading ? mark.text_end - leading : 0;
            r.cache_marks.push_back({start + std::min(end, content.size()), mark.ttl_ms});
        }
        out.Append(content);
        if (m.role == "user") {
            out.Markup(" [/INST]");
        } else {
            out.Markup(" ").Markup(tokens.eos);
        }
    }
    r.pieces = out.Take();
    return r;
}

// Gemma's template: BOS, then "<start_of_turn>role\ncontent<end_of_turn>\n" per message with the
// assistant's role named "model", content stripped, a system message's text + "\n\n" opening the
// first user turn, roles alternating user/model; no tool convention.
Result<RenderedChat> RenderGemma(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt, const ChatTemplateTokens& tokens,
                                 const ChatTools* tools) {
    if (HasTools(tools)) return NoToolConvention("tools", "Gemma");
    const bool has_system = !messages.empty() && messages.front().role == "system";
    const size_t first = has_system ? 1 : 0;
    PieceWriter out;
    RenderedChat r;
    out.Markup(tokens.bos);
    for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "tool" || !m.tool_calls.empty()) {
            return NoToolConvention("tool calls and tool results", "Gemma");
        }
        const bool expect_user = (i - first) % 2 == 0;
        if ((m.role == "user") != expect_user || (m.role != "user" && m.role != "assistant")) {
            return InvalidArgument(
                "the Gemma chat template needs roles alternating user/assistant/user/... after "
                "an optional first system message; message " +
                std::to_string(i) + " has role '" + m.role + "'");
        }
        out.Markup(kStartOfTurn).Markup(m.role == "assistant" ? "model" : "user").Markup("\n");
        if (i == first && has_system) {
            out.Content(messages.front().content, messages.front().cache_marks, &r.cache_marks);
            out.Markup("\n\n");
        }
        const std::string_view stripped = Strip(m.content);
        out.Content(stripped,
                    StrippedMarks(m.cache_marks, LeadingSpace(m.content), stripped.size()),
                    &r.cache_marks);
        out.Markup(kEndOfTurn).Markup("\n");
    }
    if (add_generation_prompt) out.Markup(kStartOfTurn).Markup("model\n");
    r.pieces = out.Take();
    return r;
}

Result<RenderedChat> RenderLlama3(const std::vector<ChatMessage>& messages,
                                  bool add_generation_prompt, const ChatTemplateTokens& tokens,
                                  const ChatTools* tools) {
    PieceWriter out;
    RenderedChat r;
    bool tools_pending = HasTools(tools);
    if (!messages.empty()) out.Markup(tokens.bos);
    for (const ChatMessage& m : messages) {
        // Llama 3.1 names the turn of a tool's result "ipython" and writes it unstripped.
        const bool tool = m.role == "tool";
        out.Markup(kHeaderStart).Markup(tool ? "ipython" : m.role).Markup(kHeaderEnd);
        out.Markup("\n\n");
        if (m.role == "user" && tools_pending) {
            out.Content(tools->prompt, tools->cache_marks, &r.cache_marks);
            tools_pending = false;
        }
        if (tool) {
            out.Content(m.content, m.cache_marks, &r.cache_marks);
        } else {
            const std::string_view stripped = Strip(m.content);
            out.Content(stripped,
                        StrippedMarks(m.cache_marks, LeadingSpace(m.content), stripped.size()),
                        &r.cache_marks);
        }
        for (size_t c = 0; c < m.tool_calls.size(); ++c) {
            if (c > 0 || !Strip(m.content).empty()) out.Markup("\n");
            out.Content(CallText(m.tool_calls[c], "parameters"));
            out.MarkHere(m.tool_calls[c].cache_ttl_ms, &r.cache_marks);
        }
        out.Markup(kEotId);
    }
    if (tools_pending) {
        return InvalidArgument(
            "the Llama 3 tool convention puts the tools in the first user message, and there is "
            "none");
    }
    if (add_generation_prompt)
        out.Markup(kHeaderStart).Markup("assistant").Markup(kHeaderEnd).Markup("\n\n");
    r.pieces = out.Take();
    return r;
}

}  // namespace

namespace {

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
        *style == ChatTemplateStyle::kChatMl ? DefaultChatMlSystemPrompt(jinja) : "";
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
            return RenderChatMl(messages, add_generation_prompt, default_system_prompt_, tools);
        case ChatTemplateStyle::kLlama2:
            return RenderLlama2(messages, tokens_, tools);
        case ChatTemplateStyle::kLlama3:
            return RenderLlama3(messages, add_generation_prompt, tokens_, tools);
        case ChatTemplateStyle::kGemma:
            return RenderGemma(messages, add_generation_prompt, tokens_, tools);
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
