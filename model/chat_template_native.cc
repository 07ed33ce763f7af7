#include "model/chat_template_native.h"

#include <algorithm>

namespace kvshard::native_chat {
namespace {

// Python's str.strip() (and Jinja's trim) over ASCII whitespace.
std::string_view Strip(std::string_view s) {
    constexpr std::string_view kSpace = " \t\n\r\v\f";
    const size_t begin = s.find_first_not_of(kSpace);
    if (begin == std::string_view::npos) return {};
    const size_t end = s.find_last_not_of(kSpace);
    return s.substr(begin, end - begin + 1);
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

Status NoToolConvention(std::string_view what, std::string_view style) {
    return InvalidArgument("the " + std::string(style) +
                           " chat template has no tool-call convention, so " + std::string(what) +
                           " cannot be rendered; use a ChatML or Llama 3 model (or "
                           "--chat-template chatml|llama3)");
}

// Llama 2 and Gemma: no tools, tool calls or tool results (they have no convention for them), and
// the messages after the optional first system message (from `first` on) alternate user and
// assistant, starting with user.
Status CheckTurns(const std::vector<ChatMessage>& messages, size_t first, const ChatTools* tools,
                  std::string_view style) {
    if (HasTools(tools)) return NoToolConvention("tools", style);
    for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        if (m.role == "tool" || !m.tool_calls.empty()) {
            return NoToolConvention("tool calls and tool results", style);
        }
        const bool expect_user = (i - first) % 2 == 0;
        if ((m.role == "user") != expect_user || (m.role != "user" && m.role != "assistant")) {
            return InvalidArgument("the " + std::string(style) +
                                   " chat template needs roles alternating user/assistant/user/... "
                                   "after an optional first system message; message " +
                                   std::to_string(i) + " has role '" + m.role + "'");
        }
    }
    return Status::Ok();
}

}  // namespace

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

Result<RenderedChat> RenderLlama2(const std::vector<ChatMessage>& messages,
                                  const ChatTemplateTokens& tokens, const ChatTools* tools) {
    size_t first = 0;
    const bool has_system = !messages.empty() && messages.front().role == "system";
    if (has_system) first = 1;
    KV_RETURN_IF_ERROR(CheckTurns(messages, first, tools, "Llama 2"));
    PieceWriter out;
    RenderedChat r;
    for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
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
    const bool has_system = !messages.empty() && messages.front().role == "system";
    const size_t first = has_system ? 1 : 0;
    KV_RETURN_IF_ERROR(CheckTurns(messages, first, tools, "Gemma"));
    PieceWriter out;
    RenderedChat r;
    out.Markup(tokens.bos);
    for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
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

}  // namespace kvshard::native_chat
