#include "coordinator/structured_output.h"

#include <deque>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "coordinator/json_fields.h"
#include "grammar/compilers.h"

namespace kvshard {
namespace {

using nlohmann::json;
using GrammarResult = Result<std::shared_ptr<const grammar::Grammar>>;

// Compiled grammars by what they were compiled from, so that requests with one schema share a
// grammar and with it the masks the vocabulary caches for its states (grammar/token_mask.h).
GrammarResult Cached(const std::string& key, const std::function<GrammarResult()>& compile) {
    static std::mutex mu;
    static std::unordered_map<std::string, std::shared_ptr<const grammar::Grammar>> cache;
    static std::deque<std::string> order;  // oldest first
    constexpr size_t kMaxGrammars = 64;
    {
        std::lock_guard<std::mutex> lock(mu);
        if (auto it = cache.find(key); it != cache.end()) return it->second;
    }
    GrammarResult g = compile();
    if (!g.ok()) return g;
    std::lock_guard<std::mutex> lock(mu);
    if (cache.emplace(key, *g).second) {
        order.push_back(key);
        if (order.size() > kMaxGrammars) {
            cache.erase(order.front());
            order.pop_front();
        }
    }
    return g;
}

// A schema given as an object, or (vLLM accepts both) as its JSON text.
Result<std::shared_ptr<const grammar::Grammar>> SchemaGrammar(const json& value,
                                                              const std::string& path) {
    if (value.is_string()) {
        bool too_deep = false;
        json parsed = json_fields::ParseJson(value.get<std::string>(), &too_deep);
        if (too_deep) {
            return InvalidArgument(path + ": the schema nests deeper than " +
                                   std::to_string(json_fields::kMaxJsonDepth) + " levels");
        }
        if (parsed.is_discarded()) return InvalidArgument(path + ": the schema is not valid JSON");
        return Cached("json:" + parsed.dump(),
                      [&] { return grammar::CompileJsonSchema(parsed, path); });
    }
    if (!value.is_object() && !value.is_boolean())
        return InvalidArgument(path + ": must be a JSON Schema object");
    return Cached("json:" + value.dump(), [&] { return grammar::CompileJsonSchema(value, path); });
}

GrammarResult JsonObject() {
    return Cached("json_object", [] { return GrammarResult(grammar::CompileJsonObject()); });
}

Result<std::shared_ptr<const grammar::Grammar>> ChoiceGrammar(const json& value,
                                                              const std::string& path) {
    if (!value.is_array() || value.empty())
        return InvalidArgument(path + ": must be a non-empty array of strings");
    std::vector<std::string> choices;
    for (const json& c : value) {
        if (!c.is_string()) return InvalidArgument(path + ": must hold strings only");
        choices.push_back(c.get<std::string>());
    }
    auto g = Cached("choice:" + value.dump(), [&] { return grammar::CompileChoice(choices); });
    if (!g.ok()) return InvalidArgument(path + ": " + g.status().message());
    return g;
}

Result<std::shared_ptr<const grammar::Grammar>> RegexGrammar(const json& value,
                                                             const std::string& path) {
    if (!value.is_string()) return InvalidArgument(path + ": must be a string");
    auto g = Cached("regex:" + value.get<std::string>(),
                    [&] { return grammar::CompileRegex(value.get<std::string>()); });
    if (!g.ok()) return InvalidArgument(path + ": " + g.status().message());
    return g;
}

// A GBNF grammar's text (vLLM's guided_grammar; vLLM also takes Lark EBNF, which is refused by
// grammar::CompileGbnf with a message that says GBNF is what is accepted).
Result<std::shared_ptr<const grammar::Grammar>> GbnfGrammar(const json& value,
                                                            const std::string& path) {
    if (!value.is_string()) return InvalidArgument(path + ": must be a string (a GBNF grammar)");
    auto g = Cached("gbnf:" + value.get<std::string>(),
                    [&] { return grammar::CompileGbnf(value.get<std::string>()); });
    if (!g.ok()) return InvalidArgument(path + ": " + g.status().message());
    return g;
}

// A json_schema format's {"schema", "strict", ...}: chat's response_format.json_schema, or the
// Responses API's text.format itself. `at` names the object in errors.
GrammarResult JsonSchemaFormat(const json& f, const std::string& at, std::string* param) {
    *param = at;
    if (f.contains("strict") && !f["strict"].is_boolean() && !f["strict"].is_null())
        return InvalidArgument("'" + at + ".strict' must be a boolean");
    // No schema: any JSON value, as OpenAI documents for a missing schema.
    if (!f.contains("schema") || f["schema"].is_null())
        return grammar::CompileJsonSchema(json::object(), at + ".schema");
    *param = at + ".schema";
    return SchemaGrammar(f["schema"], at + ".schema");
}

// A format object: chat's response_format (`at` "response_format", its schema nested under
// "json_schema") or the Responses API's text.format (`at` "text.format", the schema's fields beside
// "type"). {"type": "text"} is a null grammar.
GrammarResult Format(const json& f, const std::string& at, std::string* param) {
    *param = at;
    if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
        return InvalidArgument("'" + at + "' must be an object with a 'type'");
    const std::string type = f["type"].get<std::string>();
    if (type == "text") return std::shared_ptr<const grammar::Grammar>();
    if (type == "json_object") return JsonObject();
    if (type != "json_schema") {
        *param = at + ".type";
        return InvalidArgument("'" + at +
                               ".type' must be \"text\", \"json_object\" or "
                               "\"json_schema\", got '" +
                               type + "'");
    }
    if (at != "response_format") return JsonSchemaFormat(f, at, param);
    *param = at + ".json_schema";
    if (!f.contains("json_schema") || !f["json_schema"].is_object())
        return InvalidArgument("'" + at + ".json_schema' must be an object");
    return JsonSchemaFormat(f["json_schema"], at + ".json_schema", param);
}

}  // namespace

Result<StructuredOutput> ReadStructuredOutput(const json& body, bool chat, std::string* param) {
    StructuredOutput out;
    std::vector<std::string> given;
    auto take = [&](Result<std::shared_ptr<const grammar::Grammar>> g,
                    const std::string& name) -> Status {
        if (!g.ok()) return g.status();
        if (*g == nullptr) return Status::Ok();
        given.push_back(name);
        if (given.size() > 1) {
            *param = name;
            return InvalidArgument("'" + given[0] + "' and '" + name +
                                   "' both constrain the output; give one");
        }
        out.grammar = *g;
        return Status::Ok();
    };
    auto field = [&](const char* name) -> const json* {
        auto it = body.find(name);
        return it == body.end() || it->is_null() ? nullptr : &*it;
    };
    if (chat) {
        if (const json* f = field("response_format")) {
            KV_RETURN_IF_ERROR(take(Format(*f, "response_format", param), "response_format"));
        }
    }
    if (const json* f = field("guided_json")) {
        *param = "guided_json";
        KV_RETURN_IF_ERROR(take(SchemaGrammar(*f, "guided_json"), "guided_json"));
    }
    if (const json* f = field("guided_regex")) {
        *param = "guided_regex";
        KV_RETURN_IF_ERROR(take(RegexGrammar(*f, "guided_regex"), "guided_regex"));
    }
    if (const json* f = field("guided_choice")) {
        *param = "guided_choice";
        KV_RETURN_IF_ERROR(take(ChoiceGrammar(*f, "guided_choice"), "guided_choice"));
    }
    if (const json* f = field("guided_grammar")) {
        *param = "guided_grammar";
        KV_RETURN_IF_ERROR(take(GbnfGrammar(*f, "guided_grammar"), "guided_grammar"));
    }
    if (const json* so = field("structured_outputs")) {
        *param = "structured_outputs";
        if (!so->is_object()) return InvalidArgument("'structured_outputs' must be an object");
        for (const auto& [key, value] : so->items()) {
            const std::string path = "structured_outputs." + key;
            *param = path;
            if (value.is_null()) continue;
            if (key == "json") {
                KV_RETURN_IF_ERROR(take(SchemaGrammar(value, path), path));
            } else if (key == "regex") {
                KV_RETURN_IF_ERROR(take(RegexGrammar(value, path), path));
            } else if (key == "choice") {
                KV_RETURN_IF_ERROR(take(ChoiceGrammar(value, path), path));
            } else if (key == "json_object") {
                if (value == true) KV_RETURN_IF_ERROR(take(JsonObject(), path));
            } else if (key == "grammar") {
                KV_RETURN_IF_ERROR(take(GbnfGrammar(value, path), path));
            } else if (key == "structural_tag") {
                return Unimplemented("'" + path +
                                     "' is not supported: kvshard has no structural "
                                     "tags (use json, regex, choice, grammar or json_object)");
            } else {
                return InvalidArgument("'" + path +
                                       "' is not a structured output kvshard knows "
                                       "(json, regex, choice, grammar, json_object)");
            }
        }
    }
    return out;
}

Result<StructuredOutput> ReadTextFormat(const json& format, std::string* param) {
    GrammarResult g = Format(format, "text.format", param);
    if (!g.ok()) return g.status();
    return StructuredOutput{*g};
}

}  // namespace kvshard
