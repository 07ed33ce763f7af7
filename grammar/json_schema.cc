// JSON Schema (OpenAI strict-mode subset) and json_object into a Grammar; the policy is in
// grammar/compilers.h.
#include <map>
#include <set>

#include "common/check.h"

#include "grammar/compilers.h"

namespace kvshard::grammar {
namespace {

using nlohmann::json;

constexpr int64_t kMaxCount = 1000;  // largest minLength / maxLength / minItems / maxItems bound

const std::set<std::string>& Annotations() {
    static const std::set<std::string> k = {"title",   "description", "default",    "examples",
                                            "$schema", "$id",         "$comment",   "deprecated",
                                            "readOnly", "writeOnly",  "$defs",      "definitions"};
    return k;
}

class SchemaCompiler {
  public:
    SchemaCompiler(Grammar& g, const json& root) : g_(g), root_(root) {
        sp_ = g_.Optional({g_.Byte(' ')});
        const Symbol digit = g_.Bytes(ByteSet::Range('0', '9'));
        const Symbol int_part =
            g_.Alt({{g_.Byte('0')},
                    {g_.Bytes(ByteSet::Range('1', '9')), g_.Repeat({digit}, 0, 15)}});
        integer_ = g_.Seq({g_.Optional({g_.Byte('-')}), int_part});
        ByteSet e;
        e.Add('e');
        e.Add('E');
        ByteSet sign;
        sign.Add('+');
        sign.Add('-');
        number_ = g_.Seq({integer_, g_.Optional({g_.Byte('.'), g_.Repeat({digit}, 1, 16)}),
                          g_.Optional({g_.Bytes(e), g_.Optional({g_.Bytes(sign)}),
                                       g_.Repeat({digit}, 1, 3)})});
        // A string character: printable ASCII but '"' and '\', any UTF-8 character above, or an
        // escape.
        ByteSet plain = ByteSet::Range(0x20, 0x7E);
        plain.words['"' >> 6] &= ~(uint64_t{1} << ('"' & 63));
        plain.words['\\' >> 6] &= ~(uint64_t{1} << ('\\' & 63));
        ByteSet simple_escape;
        for (char c : std::string("\"\\/bfnrt")) simple_escape.Add(static_cast<uint8_t>(c));
        ByteSet hex = ByteSet::Range('0', '9');
        hex |= ByteSet::Range('a', 'f');
        hex |= ByteSet::Range('A', 'F');
        const Symbol h = g_.Bytes(hex);
        const Symbol escape = g_.Alt({{g_.Bytes(simple_escape)}, {g_.Byte('u'), h, h, h, h}});
        char_ = g_.Alt({{g_.Utf8Char(plain)}, {g_.Byte('\\'), escape}});
        string_ = g_.Seq({g_.Byte('"'), g_.Star({char_}), g_.Byte('"')});
    }

    Symbol AnyValue() {
        if (any_value_ != 0) return any_value_;
        const uint32_t value = g_.Declare("value");
        any_value_ = Grammar::Ref(value);
        const Symbol member = g_.Seq({string_, g_.Byte(':'), sp_, any_value_});
        const Symbol object = g_.Seq({g_.Byte('{'), List(member, 0, -1), g_.Byte('}')});
        const Symbol array = g_.Seq({g_.Byte('['), List(any_value_, 0, -1), g_.Byte(']')});
        g_.Define(value, {{object},
                          {array},
                          {string_},
                          {number_},
                          g_.Literal("true"),
                          g_.Literal("false"),
                          g_.Literal("null")});
        return any_value_;
    }

    Symbol AnyObject() {
        const Symbol member = g_.Seq({string_, g_.Byte(':'), sp_, AnyValue()});
        return g_.Seq({g_.Byte('{'), List(member, 0, -1), g_.Byte('}')});
    }

    Result<Symbol> Compile(const json& s, const std::string& path) {
        if (s.is_boolean()) {
            if (s.get<bool>()) return AnyValue();
            return InvalidArgument(path + ": the schema false accepts no value");
        }
        if (!s.is_object()) return InvalidArgument(path + ": a schema must be an object");
        if (s.contains("$ref")) return CompileRef(s, path);
        if (s.contains("const")) {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"const", "type", "enum"}));
            return g_.Seq(g_.Literal(s["const"].dump()));
        }
        if (s.contains("enum")) {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"enum", "type"}));
            const json& values = s["enum"];
            if (!values.is_array() || values.empty())
                return InvalidArgument(path + ".enum: must be a non-empty array");
            std::vector<std::vector<Symbol>> alts;
            for (const json& v : values) alts.push_back(g_.Literal(v.dump()));
            return g_.Alt(alts);
        }
        if (s.contains("anyOf")) {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"anyOf"}));
            return CompileAlternatives(s["anyOf"], path + ".anyOf");
        }
        if (s.contains("allOf")) {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"allOf"}));
            const json& all = s["allOf"];
            if (!all.is_array() || all.size() != 1) {
                return InvalidArgument(path +
                                       ".allOf: only a list of one schema is supported");
            }
            return Compile(all[0], path + ".allOf[0]");
        }
        if (!s.contains("type")) {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {}));
            return AnyValue();
        }
        const json& type = s["type"];
        if (type.is_string()) return CompileTyped(s, type.get<std::string>(), path);
        if (!type.is_array() || type.empty())
            return InvalidArgument(path + ".type: must be a type name or a list of them");
        std::vector<std::vector<Symbol>> alts;
        for (const json& t : type) {
            if (!t.is_string()) return InvalidArgument(path + ".type: must list type names");
            KV_ASSIGN_OR_RETURN(const Symbol one, CompileTyped(s, t.get<std::string>(), path));
            alts.push_back({one});
        }
        return g_.Alt(alts);
    }

  private:
    Status OnlyKeywords(const json& s, const std::string& path,
                        std::initializer_list<const char*> allowed) {
        for (const auto& [key, value] : s.items()) {
            if (Annotations().count(key) != 0) continue;
            bool ok = false;
            for (const char* a : allowed) ok = ok || key == a;
            if (!ok) {
                return InvalidArgument(path + "." + key +
                                       ": JSON Schema keyword not supported for structured "
                                       "outputs here");
            }
        }
        return Status::Ok();
    }

    // item (, item)* between min and max times (max < 0: unbounded).
    Symbol List(Symbol item, int64_t min, int64_t max) {
        const std::vector<Symbol> more = {g_.Byte(','), sp_, item};
        if (max == 0) return g_.Seq({});
        const Symbol rest = g_.Repeat(more, std::max<int64_t>(min - 1, 0), max < 0 ? -1 : max - 1);
        const Symbol nonempty = g_.Seq({item, rest});
        return min == 0 ? g_.Optional({nonempty}) : nonempty;
    }

    Result<int64_t> Count(const json& s, const char* key, const std::string& path,
                          int64_t fallback) {
        if (!s.contains(key)) return fallback;
        const json& v = s[key];
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxCount) {
            return InvalidArgument(path + "." + key + ": must be an integer in 0.." +
                                   std::to_string(kMaxCount));
        }
        return v.get<int64_t>();
    }

    Result<Symbol> CompileAlternatives(const json& list, const std::string& path) {
        if (!list.is_array() || list.empty())
            return InvalidArgument(path + ": must be a non-empty array of schemas");
        std::vector<std::vector<Symbol>> alts;
        for (size_t i = 0; i < list.size(); ++i) {
            KV_ASSIGN_OR_RETURN(const Symbol one,
                                Compile(list[i], path + "[" + std::to_string(i) + "]"));
            alts.push_back({one});
        }
        return g_.Alt(alts);
    }

    Result<Symbol> CompileRef(const json& s, const std::string& path) {
        KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"$ref"}));
        if (!s["$ref"].is_string()) return InvalidArgument(path + ".$ref: must be a string");
        const std::string ref = s["$ref"].get<std::string>();
        if (auto it = refs_.find(ref); it != refs_.end()) return Grammar::Ref(it->second);
        const json* target = nullptr;
        if (ref == "#") {
            target = &root_;
        } else {
            for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
                const std::string p = prefix;
                if (ref.rfind(p, 0) != 0) continue;
                const std::string section = p.substr(2, p.size() - 3);
                const std::string name = ref.substr(p.size());
                if (root_.contains(section) && root_[section].is_object() &&
                    root_[section].contains(name)) {
                    target = &root_[section][name];
                }
            }
        }
        if (target == nullptr) {
            return InvalidArgument(path + ".$ref: '" + ref +
                                   "' is not # or a #/$defs/ (#/definitions/) entry of the schema");
        }
        const uint32_t rule = g_.Declare(ref);
        refs_[ref] = rule;
        KV_ASSIGN_OR_RETURN(const Symbol body, Compile(*target, ref));
        g_.Define(rule, {{body}});
        return Grammar::Ref(rule);
    }

    Result<Symbol> CompileTyped(const json& s, const std::string& type, const std::string& path) {
        if (type == "string") {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"type", "minLength", "maxLength"}));
            KV_ASSIGN_OR_RETURN(const int64_t min, Count(s, "minLength", path, 0));
            KV_ASSIGN_OR_RETURN(const int64_t max, Count(s, "maxLength", path, -1));
            if (max >= 0 && max < min)
                return InvalidArgument(path + ".maxLength: is below minLength");
            if (min == 0 && max < 0) return string_;
            return g_.Seq({g_.Byte('"'), g_.Repeat({char_}, min, max), g_.Byte('"')});
        }
        if (type == "integer" || type == "number") {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"type"}));
            return type == "integer" ? integer_ : number_;
        }
        if (type == "boolean") {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"type"}));
            return g_.Alt({g_.Literal("true"), g_.Literal("false")});
        }
        if (type == "null") {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"type"}));
            return g_.Seq(g_.Literal("null"));
        }
        if (type == "array") {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"type", "items", "minItems", "maxItems"}));
            KV_ASSIGN_OR_RETURN(const int64_t min, Count(s, "minItems", path, 0));
            KV_ASSIGN_OR_RETURN(const int64_t max, Count(s, "maxItems", path, -1));
            if (max >= 0 && max < min) return InvalidArgument(path + ".maxItems: is below minItems");
            Symbol item = 0;
            if (s.contains("items")) {
                KV_ASSIGN_OR_RETURN(item, Compile(s["items"], path + ".items"));
            } else {
                item = AnyValue();
            }
            return g_.Seq({g_.Byte('['), List(item, min, max), g_.Byte(']')});
        }
        if (type == "object") return CompileObject(s, path);
        return InvalidArgument(path + ".type: unknown type '" + type + "'");
    }

    Result<Symbol> CompileObject(const json& s, const std::string& path) {
        KV_RETURN_IF_ERROR(
            OnlyKeywords(s, path, {"type", "properties", "required", "additionalProperties"}));
        std::vector<std::string> names;
        std::vector<Symbol> values;
        if (s.contains("properties")) {
            if (!s["properties"].is_object())
                return InvalidArgument(path + ".properties: must be an object");
            // nlohmann::json keeps object keys sorted, so properties come in name order (any
            // order validates).
            for (const auto& [name, sub] : s["properties"].items()) {
                KV_ASSIGN_OR_RETURN(const Symbol v, Compile(sub, path + ".properties." + name));
                names.push_back(name);
                values.push_back(v);
            }
        }
        std::set<std::string> required;
        if (s.contains("required")) {
            const json& r = s["required"];
            if (!r.is_array()) return InvalidArgument(path + ".required: must be an array");
            for (const json& n : r) {
                if (!n.is_string() || std::find(names.begin(), names.end(), n.get<std::string>()) ==
                                          names.end()) {
                    return InvalidArgument(path + ".required: " + n.dump() +
                                           " is not one of the properties");
                }
                required.insert(n.get<std::string>());
            }
        }
        if (names.empty()) {
            if (s.contains("additionalProperties") && s["additionalProperties"].is_object()) {
                KV_ASSIGN_OR_RETURN(const Symbol v, Compile(s["additionalProperties"],
                                                            path + ".additionalProperties"));
                const Symbol member = g_.Seq({string_, g_.Byte(':'), sp_, v});
                return g_.Seq({g_.Byte('{'), List(member, 0, -1), g_.Byte('}')});
            }
            if (s.contains("additionalProperties") && s["additionalProperties"] == false)
                return g_.Seq(g_.Literal("{}"));
            return AnyObject();
        }
        // Properties in order; S(i, first) generates those from i on. A required one is always
        // there; an optional one may be skipped. Built back to front.
        const size_t n = names.size();
        std::vector<Symbol> after_first(n + 1), at_first(n + 1);
        after_first[n] = at_first[n] = g_.Seq({});
        for (size_t i = n; i-- > 0;) {
            std::vector<Symbol> kv = g_.Literal(json(names[i]).dump());
            kv.push_back(g_.Byte(':'));
            kv.push_back(sp_);
            kv.push_back(values[i]);
            std::vector<Symbol> with_sep = {g_.Byte(','), sp_};
            with_sep.insert(with_sep.end(), kv.begin(), kv.end());
            with_sep.push_back(after_first[i + 1]);
            std::vector<Symbol> first = kv;
            first.push_back(after_first[i + 1]);
            if (required.count(names[i]) != 0) {
                after_first[i] = g_.Seq(with_sep);
                at_first[i] = g_.Seq(first);
            } else {
                after_first[i] = g_.Alt({with_sep, {after_first[i + 1]}});
                at_first[i] = g_.Alt({first, {at_first[i + 1]}});
            }
        }
        return g_.Seq({g_.Byte('{'), at_first[0], g_.Byte('}')});
    }

    Grammar& g_;
    const json& root_;
    std::map<std::string, uint32_t> refs_;
    Symbol sp_ = 0, integer_ = 0, number_ = 0, char_ = 0, string_ = 0, any_value_ = 0;
};

}  // namespace

Result<Symbol> AddJsonSchema(Grammar* g, const nlohmann::json& schema, const nlohmann::json& root,
                             const std::string& path) {
    SchemaCompiler c(*g, root);
    return c.Compile(schema, path);
}

Result<std::shared_ptr<const Grammar>> CompileJsonSchema(const nlohmann::json& schema,
                                                         const std::string& path) {
    auto g = std::make_shared<Grammar>();
    KV_ASSIGN_OR_RETURN(const Symbol value, AddJsonSchema(g.get(), schema, schema, path));
    const uint32_t root = g->Rule("root", {{value}});
    KV_RETURN_IF_ERROR(g->Finish(root).WithContext(path));
    return std::shared_ptr<const Grammar>(std::move(g));
}

std::shared_ptr<const Grammar> CompileJsonObject() {
    auto g = std::make_shared<Grammar>();
    SchemaCompiler c(*g, nlohmann::json::object());
    const uint32_t root = g->Rule("root", {{c.AnyObject()}});
    const Status st = g->Finish(root);
    KV_CHECK(st.ok()) << st.ToString();
    return g;
}

}  // namespace kvshard::grammar
