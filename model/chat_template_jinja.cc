#include "model/chat_template_jinja.h"

#include <nlohmann/json.hpp>

#include "model/jinja_eval.h"
#include "model/jinja_parser.h"
#include "model/jinja_value.h"

namespace kvshard {

using jinja::Value;

Result<std::shared_ptr<const jinja::Template>> ParseChatJinja(std::string_view source) {
    return jinja::Parse(source);
}

namespace {

bool HasCacheMarks(const std::vector<ChatMessage>& messages, const ChatTools* tools) {
    if (tools != nullptr && !tools->cache_marks.empty()) return true;
    for (const ChatMessage& m : messages) {
        if (!m.cache_marks.empty()) return true;
        for (const ChatToolCall& c : m.tool_calls) {
            if (c.cache_ttl_ms > 0) return true;
        }
    }
    return false;
}

Result<Value> MessageValue(const ChatMessage& m) {
    jinja::Dict d;
    d.emplace_back("role", Value::LiteralString(m.role));
    d.emplace_back("content", Value::LiteralString(m.content));
    if (!m.tool_calls.empty()) {
        jinja::List calls;
        for (const ChatToolCall& c : m.tool_calls) {
            nlohmann::ordered_json args =
                nlohmann::ordered_json::parse(c.arguments, nullptr, false);
            if (!args.is_discarded() && jinja::JsonDepth(args) > jinja::kMaxNesting) {
                return InvalidArgument("tool_calls: the arguments of call '" + c.id +
                                       "' nest deeper than " + std::to_string(jinja::kMaxNesting) +
                                       " levels");
            }
            Value arguments = args.is_discarded() ? Value::LiteralString(c.arguments)
                                                  : Value::FromJson(args, /*literal=*/true);
            Value function = Value::NewDict(
                {{"name", Value::LiteralString(c.name)}, {"arguments", std::move(arguments)}});
            calls.push_back(Value::NewDict({{"id", Value::LiteralString(c.id)},
                                            {"type", Value::String("function")},
                                            {"function", std::move(function)}}));
        }
        d.emplace_back("tool_calls", Value::NewList(std::move(calls)));
    }
    if (!m.tool_call_id.empty()) {
        d.emplace_back("tool_call_id", Value::LiteralString(m.tool_call_id));
    }
    return Value::NewDict(std::move(d));
}

}  // namespace

Result<RenderedChat> RenderJinjaChat(const jinja::Template& tmpl,
                                     const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt, const ChatTools* tools,
                                     const ChatTemplateTokens& tokens) {
    if (HasCacheMarks(messages, tools)) {
        return InvalidArgument(
            "cache_control breakpoints are not supported with this model's chat template, which "
            "kvshard runs in its Jinja interpreter (breakpoints need one of the built-in styles: "
            "--chat-template chatml|llama2|llama3|gemma)");
    }
    if (tools != nullptr && !tools->prompt.empty() && tools->definitions.empty()) {
        return Internal("tools reached an interpreted chat template without their definitions");
    }
    Value tools_value = Value::None();
    if (tools != nullptr && !tools->definitions.empty()) {
        if (tmpl.source.find("tools") == std::string::npos) {
            return InvalidArgument(
                "tools: this model's chat template does not render tools, so the model would "
                "not see them");
        }
        nlohmann::ordered_json defs =
            nlohmann::ordered_json::parse(tools->definitions, nullptr, false);
        if (defs.is_discarded() || !defs.is_array()) {
            return Internal("the tools definitions are not a JSON array");
        }
        if (jinja::JsonDepth(defs) > jinja::kMaxNesting) {
            return InvalidArgument("tools: the definitions nest deeper than " +
                                   std::to_string(jinja::kMaxNesting) + " levels");
        }
        tools_value = Value::FromJson(defs, /*literal=*/true);
    }
    jinja::List list;
    for (const ChatMessage& m : messages) {
        KV_ASSIGN_OR_RETURN(Value v, MessageValue(m));
        list.push_back(std::move(v));
    }
    const jinja::Dict context = {
        {"messages", Value::NewList(std::move(list))},
        {"tools", std::move(tools_value)},
        {"documents", Value::None()},
        {"add_generation_prompt", Value::Bool(add_generation_prompt)},
        {"bos_token", Value::String(tokens.bos)},
        {"eos_token", Value::String(tokens.eos)},
    };
    KV_ASSIGN_OR_RETURN(jinja::MarkedText text, jinja::Render(tmpl, context, {}));
    RenderedChat out;
    out.pieces = text.Pieces();
    return out;
}

}  // namespace kvshard
