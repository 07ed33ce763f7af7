#include "coordinator/tool_calls.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "coordinator/json_fields.h"
#include "grammar/compilers.h"

namespace kvshard {

using nlohmann::json;

namespace {

constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";
constexpr std::string_view kMistralCalls = "[TOOL_CALLS]";
constexpr std::string_view kSpace = " \t\n\r\v\f";

std::string Dump(const json& j, int indent = -1) {
    return j.dump(indent, ' ', false, json::error_handler_t::replace);
}

std::string_view Trim(std::string_view s) {
    const size_t begin = s.find_first_not_of(kSpace);
    if (begin == std::string_view::npos) return {};
    return s.substr(begin, s.find_last_not_of(kSpace) - begin + 1);
}

// The tool as the chat templates write it: {"type": "function", "function": {...}}.
json ToolJson(const ToolDefinition& tool) {
    json parameters = json::parse(tool.parameters, nullptr, /*allow_exceptions=*/false);
    if (parameters.is_discarded()) parameters = json::object();
    json function = {{"name", tool.name}};
    if (!tool.description.empty()) function["description"] = tool.description;
    function["parameters"] = std::move(parameters);
    return {{"type", "function"}, {"function", std::move(function)}};
}

std::string ChoiceLine(const ToolChoice& choice) {
    switch (choice.mode) {
        case ToolChoiceMode::kRequired:
            return "\n\nYou must answer with at least one function call.";
        case ToolChoiceMode::kNamed:
            return "\n\nYou must answer with a call of the function \"" + choice.name + "\".";
        case ToolChoiceMode::kAuto:
        case ToolChoiceMode::kNone:
            return "";
    }
    return "";
}

// The objects of "{...}; {...}\n{...}": each one's text, or nullopt when anything else is there
// (or a brace is left open).
std::optional<std::vector<std::string_view>> SplitJsonObjects(std::string_view text) {
    std::vector<std::string_view> out;
    size_t i = 0;
    while (i < text.size()) {
        const char c = text[i];
        if (kSpace.find(c) != std::string_view::npos || c == ';' || c == ',') {
            ++i;
            continue;
        }
        if (c != '{') return std::nullopt;
        const size_t start = i;
        int depth = 0;
        bool in_string = false, escaped = false;
        for (; i < text.size(); ++i) {
            const char d = text[i];
            if (in_string) {
                if (escaped) {
                    escaped = false;
                } else if (d == '\\') {
                    escaped = true;
                } else if (d == '"') {
                    in_string = false;
                }
            } else if (d == '"') {
                in_string = true;
            } else if (d == '{') {
                ++depth;
            } else if (d == '}' && --depth == 0) {
                break;
            }
        }
        if (i == text.size()) return std::nullopt;
        out.push_back(text.substr(start, i + 1 - start));
        ++i;
    }
    if (out.empty()) return std::nullopt;
    return out;
}

// The end of the JSON array or object that opens `text` (its first byte is '[' or '{'): the
// offset just past its closing bracket, or npos while it is still open.
size_t JsonValueEnd(std::string_view text) {
    int depth = 0;
    bool in_string = false, escaped = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (escaped) {
                escaped = false;
            } else if (c == '\\') {
                escaped = true;
            } else if (c == '"') {
                in_string = false;
            }
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            ++depth;
        } else if ((c == ']' || c == '}') && --depth == 0) {
            return i + 1;
        }
    }
    return std::string_view::npos;
}

// The call a JSON value holds, if it is one naming a tool of `allowed`.
std::optional<ToolCallOutput::Call> CallOf(const json& j, const std::vector<std::string>& allowed) {
    if (!j.is_object()) return std::nullopt;
    auto name = j.find("name");
    if (name == j.end() || !name->is_string()) return std::nullopt;
    const std::string& n = name->get_ref<const std::string&>();
    if (std::find(allowed.begin(), allowed.end(), n) == allowed.end()) return std::nullopt;
    json arguments = json::object();
    for (const char* key : {"arguments", "parameters"}) {
        auto it = j.find(key);
        if (it == j.end() || it->is_null()) continue;
        arguments = *it;
        // Some models write the arguments as a JSON string.
        if (arguments.is_string()) {
            arguments = json_fields::ParseJson(arguments.get<std::string>());
        }
        break;
    }
    if (arguments.is_discarded() || !arguments.is_object()) return std::nullopt;
    return ToolCallOutput::Call{"", n, Dump(arguments)};
}

}  // namespace

Result<ToolCallSyntax> ToolCallSyntaxFor(const ChatTemplate& chat_template) {
    if (chat_template.writes_mistral_tool_calls()) return ToolCallSyntax::kMistral;
    KV_ASSIGN_OR_RETURN(const ChatTemplateStyle style, chat_template.ToolCallStyle());
    return ToolCallSyntaxFor(style);
}

Result<ToolCallSyntax> ToolCallSyntaxFor(ChatTemplateStyle style) {
    switch (style) {
        case ChatTemplateStyle::kChatMl:
            return ToolCallSyntax::kHermes;
        case ChatTemplateStyle::kLlama3:
            return ToolCallSyntax::kLlama3Json;
        case ChatTemplateStyle::kLlama2:
            return InvalidArgument(
                "this model's chat template (Llama 2) has no tool-call convention; tools need a "
                "ChatML or Llama 3 template");
        case ChatTemplateStyle::kGemma:
            return InvalidArgument(
                "this model's chat template (Gemma) has no tool-call convention; tools need a "
                "ChatML or Llama 3 template");
    }
    return InvalidArgument("unknown chat template style");
}

ChatTools RenderTools(ToolCallSyntax syntax, const std::vector<ToolDefinition>& tools,
                      const ToolChoice& choice) {
    ChatTools out;
    if (tools.empty() || choice.mode == ToolChoiceMode::kNone) return out;
    // For templates kvshard interprets, which render the tools themselves: the request's order
    // of keys is kept (tojson prints them in that order, as a Python server would).
    nlohmann::ordered_json definitions = nlohmann::ordered_json::array();
    for (const ToolDefinition& tool : tools) {
        nlohmann::ordered_json function = {{"name", tool.name}};
        if (!tool.description.empty()) function["description"] = tool.description;
        nlohmann::ordered_json parameters =
            nlohmann::ordered_json::parse(tool.parameters, nullptr, /*allow_exceptions=*/false);
        function["parameters"] =
            parameters.is_discarded() ? nlohmann::ordered_json::object() : std::move(parameters);
        definitions.push_back({{"type", "function"}, {"function", std::move(function)}});
    }
    out.definitions =
        definitions.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
    std::string& p = out.prompt;
    switch (syntax) {
        case ToolCallSyntax::kHermes:
            p = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>";
            for (const ToolDefinition& tool : tools) {
                p += "\n" + Dump(ToolJson(tool));
                if (tool.cache_ttl_ms > 0) out.cache_marks.push_back({p.size(), tool.cache_ttl_ms});
            }
            p += "\n</tools>\n\nFor each function call, return a json object with function name "
                 "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                 "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
            p += ChoiceLine(choice);
            break;
        case ToolCallSyntax::kLlama3Json:
            p = "Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\nRespond in the "
                "format {\"name\": function name, \"parameters\": dictionary of argument name and "
                "its value}. Do not use variables.";
            p += ChoiceLine(choice);
            p += "\n\n";
            for (const ToolDefinition& tool : tools) {
                p += Dump(ToolJson(tool), 4);
                if (tool.cache_ttl_ms > 0) out.cache_marks.push_back({p.size(), tool.cache_ttl_ms});
                p += "\n\n";
            }
            break;
        case ToolCallSyntax::kMistral:
            break;  // the template renders `definitions` between [AVAILABLE_TOOLS] markers
    }
    return out;
}

ToolCallParser::ToolCallParser(ToolCallParserOptions options)
    : options_(std::move(options)),
      state_(options_.syntax == ToolCallSyntax::kHermes ? State::kText : State::kUndecided) {}

// Trailing whitespace is held: it is dropped when a call follows, and sent with the next text.
void ToolCallParser::EmitText(std::string text, std::vector<ToolCallOutput>& out) {
    if (text.empty()) return;
    const size_t last = text.find_last_not_of(kSpace);
    if (last == std::string::npos) {
        pending_ws_ += text;
        return;
    }
    std::string trailing = text.substr(last + 1);
    text.erase(last + 1);
    text.insert(0, pending_ws_);
    pending_ws_ = std::move(trailing);
    if (!out.empty() && !out.back().call) {
        out.back().text += text;
    } else {
        out.push_back({std::move(text), std::nullopt});
    }
}

std::optional<ToolCallOutput::Call> ToolCallParser::ParseCall(std::string_view json_text) const {
    // A model's text: as deep as it likes to write, so bounded like a request's JSON.
    const json j = json_fields::ParseJson(Trim(json_text));
    if (j.is_discarded()) return std::nullopt;
    return CallOf(j, options_.allowed_names);
}

std::string ToolCallParser::NextId() {
    const std::string index = std::to_string(num_calls_++);
    if (options_.id_length == 0) return options_.id_prefix + index;
    const size_t room = options_.id_length > index.size() ? options_.id_length - index.size() : 0;
    return options_.id_prefix.substr(0, room) + index;
}

void ToolCallParser::EmitCallOrText(std::string_view body, std::string raw,
                                    std::vector<ToolCallOutput>& out) {
    std::optional<ToolCallOutput::Call> call;
    if (num_calls_ < options_.max_calls) call = ParseCall(body);
    if (!call) return EmitText(std::move(raw), out);
    pending_ws_.clear();
    call->id = NextId();
    out.push_back({"", std::move(call)});
}

void ToolCallParser::FeedHermes(std::vector<ToolCallOutput>& out) {
    while (true) {
        if (state_ == State::kText) {
            const size_t open = buffer_.find(kCallOpen);
            if (open != std::string::npos) {
                EmitText(buffer_.substr(0, open), out);
                buffer_.erase(0, open + kCallOpen.size());
                state_ = State::kInCall;
                continue;
            }
            // Hold back the longest tail that may begin "<tool_call>".
            size_t keep = std::min(buffer_.size(), kCallOpen.size() - 1);
            while (keep > 0 &&
                   buffer_.compare(buffer_.size() - keep, keep, kCallOpen.data(), keep) != 0) {
                --keep;
            }
            EmitText(buffer_.substr(0, buffer_.size() - keep), out);
            buffer_.erase(0, buffer_.size() - keep);
            return;
        }
        const size_t close = buffer_.find(kCallClose);
        if (close == std::string::npos) return;
        const std::string body = buffer_.substr(0, close);
        buffer_.erase(0, close + kCallClose.size());
        state_ = State::kText;
        EmitCallOrText(body, std::string(kCallOpen) + body + std::string(kCallClose), out);
    }
}

std::vector<ToolCallOutput> ToolCallParser::Feed(std::string_view text) {
    std::vector<ToolCallOutput> out;
    buffer_.append(text);
    if (options_.syntax == ToolCallSyntax::kHermes) {
        FeedHermes(out);
        return out;
    }
    if (options_.syntax == ToolCallSyntax::kMistral) {
        FeedMistral(out);
        return out;
    }
    if (state_ == State::kUndecided) {
        const std::string_view rest = Trim(buffer_);
        if (rest.empty()) return out;
        if (rest.front() == '{' || rest.substr(0, kPythonTag.size()) == kPythonTag) {
            state_ = State::kJson;
        } else if (kPythonTag.substr(0, rest.size()) == rest) {
            return out;  // may still become <|python_tag|>
        } else {
            state_ = State::kText;
        }
    }
    if (state_ == State::kText) {
        EmitText(std::move(buffer_), out);
        buffer_.clear();
    }
    return out;  // kJson: held until the end
}

void ToolCallParser::FinishLlama3(std::vector<ToolCallOutput>& out) {
    std::string_view body = Trim(buffer_);
    if (body.substr(0, kPythonTag.size()) == kPythonTag) body.remove_prefix(kPythonTag.size());
    std::vector<ToolCallOutput::Call> calls;
    if (auto objects = SplitJsonObjects(body)) {
        for (std::string_view object : *objects) {
            std::optional<ToolCallOutput::Call> call;
            if (num_calls_ + static_cast<int>(calls.size()) < options_.max_calls) {
                call = ParseCall(object);
            }
            if (!call) {
                calls.clear();
                break;
            }
            calls.push_back(std::move(*call));
        }
    }
    if (calls.empty()) return EmitText(std::move(buffer_), out);
    pending_ws_.clear();
    for (ToolCallOutput::Call& call : calls) {
        call.id = NextId();
        out.push_back({"", std::move(call)});
    }
}

void ToolCallParser::EmitMistralCalls(std::string_view body, std::string raw,
                                      std::vector<ToolCallOutput>& out) {
    const json j = json_fields::ParseJson(Trim(body));
    std::vector<ToolCallOutput::Call> calls;
    if (!j.is_discarded()) {
        const json items = j.is_array() ? j : json::array({j});
        for (const json& item : items) {
            std::optional<ToolCallOutput::Call> call;
            if (num_calls_ + static_cast<int>(calls.size()) < options_.max_calls) {
                call = CallOf(item, options_.allowed_names);
            }
            if (!call) {
                calls.clear();
                break;
            }
            calls.push_back(std::move(*call));
        }
    }
    if (calls.empty()) return EmitText(std::move(raw), out);
    pending_ws_.clear();
    for (ToolCallOutput::Call& call : calls) {
        call.id = NextId();
        out.push_back({"", std::move(call)});
    }
}

void ToolCallParser::FeedMistral(std::vector<ToolCallOutput>& out) {
    while (true) {
        if (state_ == State::kUndecided) {
            // At the start of the answer a bare array is a call list too: the [TOOL_CALLS]
            // control token before it has no text unless skip_special_tokens is false.
            const std::string_view rest = Trim(buffer_);
            if (rest.empty()) return;
            if (rest.front() == '[' && rest.substr(0, kMistralCalls.size()) != kMistralCalls) {
                if (kMistralCalls.substr(0, rest.size()) == rest) return;  // may be the marker
                buffer_.erase(0, buffer_.find('['));
                marked_ = false;
                state_ = State::kInCall;
            } else {
                state_ = State::kText;
            }
            continue;
        }
        if (state_ == State::kText) {
            const size_t open = buffer_.find(kMistralCalls);
            if (open != std::string::npos) {
                EmitText(buffer_.substr(0, open), out);
                buffer_.erase(0, open + kMistralCalls.size());
                marked_ = true;
                state_ = State::kInCall;
                continue;
            }
            // Hold back the longest tail that may begin "[TOOL_CALLS]".
            size_t keep = std::min(buffer_.size(), kMistralCalls.size() - 1);
            while (keep > 0 &&
                   buffer_.compare(buffer_.size() - keep, keep, kMistralCalls.data(), keep) != 0) {
                --keep;
            }
            EmitText(buffer_.substr(0, buffer_.size() - keep), out);
            buffer_.erase(0, buffer_.size() - keep);
            return;
        }
        // kInCall: the array (or object) runs to its closing bracket.
        const size_t begin = buffer_.find_first_not_of(kSpace);
        if (begin == std::string::npos) return;
        const std::string marker(marked_ ? kMistralCalls : "");
        size_t end = std::string::npos;
        if (buffer_[begin] == '[' || buffer_[begin] == '{') {
            end = JsonValueEnd(std::string_view(buffer_).substr(begin));
            if (end == std::string::npos) return;
            end += begin;
        } else {
            end = 0;  // not a call list: what follows the marker is text
        }
        const std::string body = buffer_.substr(0, end);
        buffer_.erase(0, end);
        state_ = State::kText;
        EmitMistralCalls(body, marker + body, out);
    }
}

std::vector<ToolCallOutput> ToolCallParser::Finish() {
    std::vector<ToolCallOutput> out;
    switch (state_) {
        case State::kText:
            EmitText(std::move(buffer_), out);
            break;
        case State::kInCall:
            // The model ended (EOS, max_tokens) inside a call: a call if what it wrote parses.
            if (options_.syntax == ToolCallSyntax::kMistral) {
                EmitMistralCalls(buffer_, std::string(marked_ ? kMistralCalls : "") + buffer_, out);
            } else {
                EmitCallOrText(buffer_, std::string(kCallOpen) + buffer_, out);
            }
            break;
        case State::kUndecided:
            EmitText(std::move(buffer_), out);
            break;
        case State::kJson:
            FinishLlama3(out);
            break;
    }
    buffer_.clear();
    if (num_calls_ == 0 && !pending_ws_.empty()) {
        if (!out.empty() && !out.back().call) {
            out.back().text += pending_ws_;
        } else {
            out.push_back({pending_ws_, std::nullopt});
        }
    }
    pending_ws_.clear();
    return out;
}

Result<std::shared_ptr<const grammar::Grammar>> ToolCallGrammar(
    ToolCallSyntax syntax, const std::vector<ToolDefinition>& tools, const ToolChoice& choice,
    bool single_call) {
    auto g = std::make_shared<grammar::Grammar>();
    const grammar::Symbol sp = g->Optional({g->Byte(' ')});
    std::vector<std::vector<grammar::Symbol>> calls;
    for (size_t i = 0; i < tools.size(); ++i) {
        const ToolDefinition& t = tools[i];
        if (choice.mode == ToolChoiceMode::kNamed && t.name != choice.name) continue;
        const std::string path = "tools[" + std::to_string(i) + "].function.parameters";
        json schema = json::parse(t.parameters, nullptr, /*allow_exceptions=*/false);
        if (schema.is_discarded()) return InvalidArgument(path + ": not valid JSON");
        KV_ASSIGN_OR_RETURN(const grammar::Symbol args,
                            grammar::AddJsonSchema(g.get(), schema, schema, path));
        // {"name": "NAME", "arguments": ARGS} (Llama 3: "parameters").
        std::vector<grammar::Symbol> call = g->Literal("{\"name\":");
        call.push_back(sp);
        for (grammar::Symbol s : g->Literal(json(t.name).dump() + ",")) call.push_back(s);
        call.push_back(sp);
        const char* key =
            syntax == ToolCallSyntax::kLlama3Json ? "\"parameters\":" : "\"arguments\":";
        for (grammar::Symbol s : g->Literal(key)) call.push_back(s);
        call.push_back(sp);
        call.push_back(args);
        call.push_back(g->Byte('}'));
        calls.push_back(std::move(call));
    }
    if (calls.empty()) return InvalidArgument("tool_choice: no tool of the request to call");
    std::vector<grammar::Symbol> one;
    const grammar::Symbol body = g->Alt(calls);
    switch (syntax) {
        case ToolCallSyntax::kHermes: {
            one = g->Literal(std::string(kCallOpen) + "\n");
            one.push_back(body);
            for (grammar::Symbol s : g->Literal("\n</tool_call>")) one.push_back(s);
            break;
        }
        case ToolCallSyntax::kLlama3Json:
        case ToolCallSyntax::kMistral:
            one = {body};
            break;
    }
    std::vector<grammar::Symbol> answer;
    if (syntax == ToolCallSyntax::kMistral) {
        // [CALL, CALL, ...]: the array the parser reads at the start of an answer.
        answer = {g->Byte('[')};
        answer.push_back(body);
        if (!single_call) answer.push_back(g->Star({g->Byte(','), sp, body}));
        answer.push_back(g->Byte(']'));
    } else {
        std::vector<grammar::Symbol> more = {g->Byte('\n')};
        more.insert(more.end(), one.begin(), one.end());
        answer = one;
        if (!single_call) answer.push_back(g->Star(more));
    }
    const uint32_t root = g->Rule("tool_calls", {answer});
    KV_RETURN_IF_ERROR(g->Finish(root));
    return std::shared_ptr<const grammar::Grammar>(std::move(g));
}

}  // namespace kvshard
