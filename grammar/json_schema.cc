// JSON Schema (OpenAI strict-mode subset) and json_object into a Grammar; the policy is in
// grammar/compilers.h.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "common/check.h"
#include "grammar/compilers.h"

namespace kvshard::grammar {
namespace {

using nlohmann::json;

constexpr int64_t kMaxCount = 1000;  // largest minLength / maxLength / minItems / maxItems bound
constexpr int64_t kMaxInteger = 9'999'999'999'999'999;  // 16 digits, as the integer grammar

// The string formats, as regexes over the string's characters (grammar/compilers.h documents
// each); null when unknown.
const char* FormatRegex(const std::string& format) {
    static const std::map<std::string, const char*> k = {
        {"date",
         R"((?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)-)"
         R"((?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30))"
         R"(|02-(?:0[1-9]|1[0-9]|2[0-8])))"},
        {"time", R"((?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?)"
                 R"((?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9]))"},
        {"uuid", "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"},
        {"email",
         R"([a-z0-9]{1,16}(?:[._+-][a-z0-9]{1,16}){0,3}@)"
         R"([a-z0-9]{1,16}(?:-[a-z0-9]{1,16}){0,2}(?:\.[a-z0-9]{1,16}(?:-[a-z0-9]{1,16}){0,2}){0,3})"
         R"(\.[a-z]{2,24})"},
        {"ipv4", R"((?:(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3})"
                 R"((?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9]))"},
    };
    if (format == "date-time") {
        static const std::string k_date_time =
            std::string(k.at("date")) + "T" + std::string(k.at("time"));
        return k_date_time.c_str();
    }
    auto it = k.find(format);
    return it == k.end() ? nullptr : it->second;
}

const std::set<std::string>& Annotations() {
    static const std::set<std::string> k = {"title",    "description", "default",  "examples",
                                            "$schema",  "$id",         "$comment", "deprecated",
                                            "readOnly", "writeOnly",   "$defs",    "definitions"};
    return k;
}

class SchemaCompiler {
  public:
    SchemaCompiler(Grammar& g, const json& root) : g_(g), root_(root) {
        sp_ = g_.Optional({g_.Byte(' ')});
        const Symbol digit = g_.Bytes(ByteSet::Range('0', '9'));
        const Symbol int_part = g_.Alt(
            {{g_.Byte('0')}, {g_.Bytes(ByteSet::Range('1', '9')), g_.Repeat({digit}, 0, 15)}});
        integer_ = g_.Seq({g_.Optional({g_.Byte('-')}), int_part});
        ByteSet e;
        e.Add('e');
        e.Add('E');
        ByteSet sign;
        sign.Add('+');
        sign.Add('-');
        number_ = g_.Seq(
            {integer_, g_.Optional({g_.Byte('.'), g_.Repeat({digit}, 1, 16)}),
             g_.Optional({g_.Bytes(e), g_.Optional({g_.Bytes(sign)}), g_.Repeat({digit}, 1, 3)})});
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
                return InvalidArgument(path + ".allOf: only a list of one schema is supported");
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
            KV_RETURN_IF_ERROR(
                OnlyKeywords(s, path, {"type", "minLength", "maxLength", "pattern", "format"}));
            if (s.contains("pattern") || s.contains("format")) return CompilePatterned(s, path);
            KV_ASSIGN_OR_RETURN(const int64_t min, Count(s, "minLength", path, 0));
            KV_ASSIGN_OR_RETURN(const int64_t max, Count(s, "maxLength", path, -1));
            if (max >= 0 && max < min)
                return InvalidArgument(path + ".maxLength: is below minLength");
            if (min == 0 && max < 0) return string_;
            return g_.Seq({g_.Byte('"'), g_.Repeat({char_}, min, max), g_.Byte('"')});
        }
        if (type == "integer") {
            KV_RETURN_IF_ERROR(OnlyKeywords(
                s, path, {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}));
            return CompileInteger(s, path);
        }
        if (type == "number") {
            KV_RETURN_IF_ERROR(OnlyKeywords(s, path, {"type"}));
            return number_;
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
            if (max >= 0 && max < min)
                return InvalidArgument(path + ".maxItems: is below minItems");
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

    // A string with pattern or format (either alone: they do not combine with each other or with
    // the length bounds).
    Result<Symbol> CompilePatterned(const json& s, const std::string& path) {
        for (const char* key : {"minLength", "maxLength"}) {
            if (s.contains(key)) {
                return InvalidArgument(path + "." + key +
                                       ": not supported together with pattern or format");
            }
        }
        std::string regex;
        std::string at;
        if (s.contains("pattern")) {
            at = path + ".pattern";
            if (s.contains("format"))
                return InvalidArgument(path + ".format: not supported together with pattern");
            if (!s["pattern"].is_string()) return InvalidArgument(at + ": must be a string");
            regex = s["pattern"].get<std::string>();
        } else {
            at = path + ".format";
            if (!s["format"].is_string()) return InvalidArgument(at + ": must be a string");
            const char* r = FormatRegex(s["format"].get<std::string>());
            if (r == nullptr) {
                return InvalidArgument(at + ": format '" + s["format"].get<std::string>() +
                                       "' is not supported (date, time, date-time, uuid, email, "
                                       "ipv4 are)");
            }
            regex = r;
        }
        Result<Symbol> body = AddRegex(&g_, regex, /*json_string=*/true);
        if (!body.ok()) return InvalidArgument(at + ": " + body.status().message());
        return g_.Seq({g_.Byte('"'), *body, g_.Byte('"')});
    }

    // An integer bound, rounded inward to an integer and clamped to the 16-digit range.
    Status Bound(const json& s, const char* key, bool lower, bool exclusive, int64_t* bound,
                 const std::string& path) {
        if (!s.contains(key)) return Status::Ok();
        const json& v = s[key];
        if (!v.is_number()) {
            return InvalidArgument(
                path + "." + key + ": must be a number" +
                (v.is_boolean() ? " (draft 4's boolean form is not supported)" : ""));
        }
        int64_t b = 0;
        if (v.is_number_integer() && !v.is_number_unsigned()) {
            b = std::clamp<int64_t>(v.get<int64_t>(), -kMaxInteger - 2, kMaxInteger + 2);
            if (exclusive) b += lower ? 1 : -1;
        } else {
            const double d = std::clamp(v.get<double>(), -1e17, 1e17);
            const double r = lower ? (exclusive ? std::floor(d) + 1 : std::ceil(d))
                                   : (exclusive ? std::ceil(d) - 1 : std::floor(d));
            b = static_cast<int64_t>(r);
        }
        *bound = lower ? std::max(*bound, b) : std::min(*bound, b);
        return Status::Ok();
    }

    Result<Symbol> CompileInteger(const json& s, const std::string& path) {
        int64_t lo = -kMaxInteger, hi = kMaxInteger;
        KV_RETURN_IF_ERROR(Bound(s, "minimum", true, false, &lo, path));
        KV_RETURN_IF_ERROR(Bound(s, "exclusiveMinimum", true, true, &lo, path));
        KV_RETURN_IF_ERROR(Bound(s, "maximum", false, false, &hi, path));
        KV_RETURN_IF_ERROR(Bound(s, "exclusiveMaximum", false, true, &hi, path));
        if (lo == -kMaxInteger && hi == kMaxInteger) return integer_;
        if (lo > hi) {
            return InvalidArgument(path +
                                   ": no integer of at most 16 digits is within its "
                                   "minimum and maximum");
        }
        std::vector<std::vector<Symbol>> alts;
        if (lo < 0) alts.push_back({g_.Byte('-'), Natural(hi < 0 ? -hi : 1, -lo)});
        if (hi >= 0) alts.push_back({Natural(std::max<int64_t>(lo, 0), hi)});
        return g_.Alt(alts);
    }

    // The decimal numerals (no leading zero) of a..b. REQUIRES: 0 <= a <= b.
    Symbol Natural(int64_t a, int64_t b) {
        const size_t len_a = std::to_string(a).size(), len_b = std::to_string(b).size();
        std::vector<std::vector<Symbol>> alts;
        int64_t first = 1;  // 10^(len - 1)
        for (size_t len = 1; len <= len_b; ++len, first *= 10) {
            if (len < len_a) continue;
            const int64_t lo = len == len_a ? a : first;
            const int64_t hi = len == len_b ? b : first * 10 - 1;
            alts.push_back(SameLength(std::to_string(lo), std::to_string(hi)));
        }
        return g_.Alt(alts);
    }

    // The digit strings of one length between lo and hi (as strings). REQUIRES: lo <= hi,
    // lo.size() == hi.size().
    std::vector<Symbol> SameLength(const std::string& lo, const std::string& hi) {
        const size_t n = lo.size();
        std::vector<Symbol> seq;
        size_t i = 0;
        for (; i < n && lo[i] == hi[i]; ++i) seq.push_back(g_.Byte(static_cast<uint8_t>(lo[i])));
        if (i == n) return seq;
        const size_t rest = n - i - 1;
        const bool lo_tail_min = lo.find_first_not_of('0', i + 1) == std::string::npos;
        const bool hi_tail_max = hi.find_first_not_of('9', i + 1) == std::string::npos;
        const char middle_lo = lo_tail_min ? lo[i] : static_cast<char>(lo[i] + 1);
        const char middle_hi = hi_tail_max ? hi[i] : static_cast<char>(hi[i] - 1);
        const Symbol digit = g_.Bytes(ByteSet::Range('0', '9'));
        std::vector<std::vector<Symbol>> alts;
        if (!lo_tail_min) {
            std::vector<Symbol> a = {g_.Byte(static_cast<uint8_t>(lo[i]))};
            const auto tail = SameLength(lo.substr(i + 1), std::string(rest, '9'));
            a.insert(a.end(), tail.begin(), tail.end());
            alts.push_back(a);
        }
        if (middle_lo <= middle_hi) {
            std::vector<Symbol> m = {g_.Bytes(
                ByteSet::Range(static_cast<uint8_t>(middle_lo), static_cast<uint8_t>(middle_hi)))};
            m.insert(m.end(), rest, digit);
            alts.push_back(m);
        }
        if (!hi_tail_max) {
            std::vector<Symbol> h = {g_.Byte(static_cast<uint8_t>(hi[i]))};
            const auto tail = SameLength(std::string(rest, '0'), hi.substr(i + 1));
            h.insert(h.end(), tail.begin(), tail.end());
            alts.push_back(h);
        }
        seq.push_back(g_.Alt(alts));
        return seq;
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
                if (!n.is_string() ||
                    std::find(names.begin(), names.end(), n.get<std::string>()) == names.end()) {
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
