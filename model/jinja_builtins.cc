#include "model/jinja_builtins.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <ctime>

namespace kvshard::jinja {
namespace {

constexpr std::string_view kSpace = " \t\n\r\v\f";

Result<std::string> StrArg(const CallArgs& args, size_t index, std::string_view name,
                           std::string_view what, const char* dflt = nullptr) {
    const Value* v = args.Get(index, name);
    if (v == nullptr || v->is_none()) {
        if (dflt != nullptr) return std::string(dflt);
        return InvalidArgument(std::string(what) + " needs its argument '" + std::string(name) +
                               "'");
    }
    if (!v->is_string()) {
        return InvalidArgument(std::string(what) + ": '" + std::string(name) +
                               "' must be a string, not " + std::string(v->TypeName()));
    }
    return v->str();
}

Status NeedString(const Value& v, std::string_view what) {
    if (v.is_undefined()) return InvalidArgument(v.undefined_name());
    if (v.is_string()) return Status::Ok();
    return InvalidArgument(std::string(what) + " needs a string, not " + std::string(v.TypeName()));
}

size_t CharCount(const std::string& s) {
    size_t n = 0;
    for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    return n;
}

// str.strip / lstrip / rstrip with Python's `chars` (None: whitespace).
Value StripChars(const Value& s, std::string_view chars, bool left, bool right) {
    size_t b = 0;
    size_t e = s.str().size();
    while (left && b < e && chars.find(s.str()[b]) != std::string_view::npos) ++b;
    while (right && e > b && chars.find(s.str()[e - 1]) != std::string_view::npos) --e;
    return Substr(s, b, e);
}

std::string MapChars(const std::string& s, int (*f)(int)) {
    std::string out = s;
    for (char& c : out) {
        if (static_cast<unsigned char>(c) < 0x80) c = static_cast<char>(f(c));
    }
    return out;
}

std::string Capitalize(const std::string& s) {
    std::string out = MapChars(s, [](int c) { return std::tolower(c); });
    if (!out.empty() && static_cast<unsigned char>(out[0]) < 0x80) out[0] = std::toupper(out[0]);
    return out;
}

std::string Title(const std::string& s) {
    std::string out = s;
    bool start = true;
    for (char& c : out) {
        const bool alpha = std::isalpha(static_cast<unsigned char>(c));
        if (static_cast<unsigned char>(c) < 0x80) {
            c = static_cast<char>(start ? std::toupper(c) : std::tolower(c));
        }
        start = !alpha;
    }
    return out;
}

// Python's str.split(sep, maxsplit); sep empty: split on runs of whitespace.
Result<List> Split(const Value& s, const std::string& sep, int64_t maxsplit, Budget* budget) {
    List out;
    const std::string& text = s.str();
    if (sep.empty()) {
        size_t i = text.find_first_not_of(kSpace);
        while (i != std::string::npos) {
            size_t end = text.find_first_of(kSpace, i);
            if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
                const size_t last = text.find_last_not_of(kSpace);
                end = last + 1;
            }
            if (end == std::string::npos) end = text.size();
            out.push_back(Substr(s, i, end));
            i = text.find_first_not_of(kSpace, end);
        }
    } else {
        size_t start = 0;
        while (true) {
            const size_t at = (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit)
                                  ? std::string::npos
                                  : text.find(sep, start);
            if (at == std::string::npos) {
                out.push_back(Substr(s, start, text.size()));
                break;
            }
            out.push_back(Substr(s, start, at));
            start = at + sep.size();
        }
    }
    KV_RETURN_IF_ERROR(budget->Charge(out.size() + text.size()));
    return out;
}

Result<Value> Replace(const Value& s, const CallArgs& args, Budget* budget) {
    KV_ASSIGN_OR_RETURN(std::string old, StrArg(args, 0, "old", "replace"));
    KV_ASSIGN_OR_RETURN(std::string repl, StrArg(args, 1, "new", "replace"));
    int64_t count = -1;
    if (const Value* c = args.Get(2, "count"); c != nullptr && c->kind() == Value::Kind::kInt) {
        count = c->i();
    }
    const std::string& text = s.str();
    std::string out;
    size_t pos = 0;
    int64_t done = 0;
    while (count < 0 || done < count) {
        const size_t at =
            old.empty() ? (pos <= text.size() ? pos : std::string::npos) : text.find(old, pos);
        if (at == std::string::npos) break;
        out.append(text, pos, at - pos);
        out += repl;
        KV_RETURN_IF_ERROR(budget->Charge(repl.size() + (at - pos)));
        ++done;
        if (old.empty()) {
            if (at < text.size()) out += text[at];
            pos = at + 1;
            if (pos > text.size()) break;
        } else {
            pos = at + old.size();
        }
    }
    if (pos < text.size()) out.append(text, pos);
    const bool literal = s.HasLiteral() || args.Get(1, "new")->HasLiteral();
    return Derived(std::move(out), literal);
}

// Items of a dict as [key, value] pairs; keys of request data are literal like its values.
Value ItemsOf(const Value& d) {
    const bool literal = d.ContainsLiteral();
    List items;
    for (const auto& [k, v] : d.dict()) {
        items.push_back(Value::NewList({Derived(k, literal), v}));
    }
    return Value::NewList(std::move(items));
}

// obj.attribute, with "a.b" paths as jinja2's make_attrgetter reads them.
Value AttrPath(const Value& obj, std::string_view path) {
    Value cur = obj;
    while (true) {
        const size_t dot = path.find('.');
        const std::string part(path.substr(0, dot));
        if (cur.is_mapping()) {
            const Value* v = cur.Find(part);
            cur = v != nullptr ? *v : Value::Undefined("no attribute '" + part + "'");
        } else if (cur.is_list() && !part.empty() &&
                   std::all_of(part.begin(), part.end(), ::isdigit)) {
            const size_t i = std::stoul(part);
            cur = i < cur.list().size() ? cur.list()[i] : Value::Undefined("no item " + part);
        } else {
            return Value::Undefined("no attribute '" + part + "'");
        }
        if (dot == std::string_view::npos) return cur;
        path.remove_prefix(dot + 1);
    }
}

// select / reject / selectattr / rejectattr.
Result<Value> SelectFilter(const Value& seq, CallArgs& args, bool by_attr, bool keep) {
    KV_ASSIGN_OR_RETURN(List items, Iterate(seq));
    size_t next = 0;
    std::string attr;
    if (by_attr) {
        if (args.positional.empty() || !args.positional[0].is_string()) {
            return InvalidArgument("selectattr/rejectattr need an attribute name");
        }
        attr = args.positional[next++].str();
    }
    std::string test;
    if (next < args.positional.size()) {
        if (!args.positional[next].is_string()) {
            return InvalidArgument("select/reject need a test name");
        }
        test = args.positional[next++].str();
    }
    CallArgs test_args;
    test_args.positional.assign(args.positional.begin() + next, args.positional.end());
    List out;
    for (Value& item : items) {
        const Value v = by_attr ? AttrPath(item, attr) : item;
        bool pass = v.Truthy();
        if (!test.empty()) {
            KV_ASSIGN_OR_RETURN(pass, ApplyTest(test, v, test_args));
        }
        if (pass == keep) out.push_back(std::move(item));
    }
    return Value::NewList(std::move(out));
}

Result<Value> MapFilter(const Value& seq, CallArgs& args, Budget* budget) {
    KV_ASSIGN_OR_RETURN(List items, Iterate(seq));
    List out;
    if (const Value* attr = args.Get(SIZE_MAX, "attribute")) {
        if (!attr->is_string()) return InvalidArgument("map: attribute must be a string");
        const Value* dflt = args.Get(SIZE_MAX, "default");
        for (const Value& item : items) {
            Value v = AttrPath(item, attr->str());
            if (v.is_undefined() && dflt != nullptr) v = *dflt;
            out.push_back(std::move(v));
        }
    } else {
        if (args.positional.empty() || !args.positional[0].is_string()) {
            return InvalidArgument("map needs a filter name or attribute=");
        }
        const std::string filter = args.positional[0].str();
        CallArgs rest;
        rest.positional.assign(args.positional.begin() + 1, args.positional.end());
        rest.keyword = args.keyword;
        for (const Value& item : items) {
            KV_ASSIGN_OR_RETURN(Value v, ApplyFilter(filter, item, rest, budget));
            out.push_back(std::move(v));
        }
    }
    KV_RETURN_IF_ERROR(budget->Charge(out.size()));
    return Value::NewList(std::move(out));
}

Result<Value> ToJsonFilter(const Value& v, const CallArgs& args, Budget* budget) {
    int indent = -1;
    if (const Value* i = args.Get(0, "indent"); i != nullptr && !i->is_none()) {
        if (i->kind() != Value::Kind::kInt || i->i() < 0 || i->i() > 64) {
            return InvalidArgument("tojson: indent must be an integer from 0 to 64");
        }
        indent = static_cast<int>(i->i());
    }
    std::string item_sep = indent >= 0 ? "," : ", ";
    std::string key_sep = ": ";
    if (const Value* s = args.Get(SIZE_MAX, "separators"); s != nullptr && !s->is_none()) {
        if (!s->is_list() || s->list().size() != 2 || !s->list()[0].is_string() ||
            !s->list()[1].is_string()) {
            return InvalidArgument("tojson: separators must be two strings");
        }
        item_sep = s->list()[0].str();
        key_sep = s->list()[1].str();
    }
    const Value* sort = args.Get(SIZE_MAX, "sort_keys");
    if (const Value* a = args.Get(SIZE_MAX, "ensure_ascii"); a != nullptr && a->Truthy()) {
        return InvalidArgument("tojson: ensure_ascii=true is not supported");
    }
    KV_ASSIGN_OR_RETURN(std::string text,
                        v.ToJson(indent, item_sep, key_sep, sort != nullptr && sort->Truthy()));
    KV_RETURN_IF_ERROR(budget->Charge(text.size()));
    return Derived(std::move(text), v.ContainsLiteral());
}

Result<Value> JoinFilter(const Value& seq, const CallArgs& args, Budget* budget) {
    KV_ASSIGN_OR_RETURN(List items, Iterate(seq));
    const Value* sep = args.Get(0, "d");
    const Value* attr = args.Get(1, "attribute");
    MarkedText out;
    for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0 && sep != nullptr) out.Append(sep->ToStr());
        out.Append(
            (attr != nullptr && attr->is_string() ? AttrPath(items[i], attr->str()) : items[i])
                .ToStr());
    }
    KV_RETURN_IF_ERROR(budget->Charge(out.text().size()));
    return std::move(out).ToValue();
}

Result<Value> SortFilter(const Value& seq, const CallArgs& args) {
    KV_ASSIGN_OR_RETURN(List items, Iterate(seq));
    const Value* reverse = args.Get(0, "reverse");
    const Value* attr = args.Get(2, "attribute");
    Status error;
    auto key = [&](const Value& v) {
        return attr != nullptr && attr->is_string() ? AttrPath(v, attr->str()) : v;
    };
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
        Result<bool> less = Less(key(a), key(b));
        if (!less.ok()) {
            error = less.status();
            return false;
        }
        return *less;
    });
    KV_RETURN_IF_ERROR(error);
    if (reverse != nullptr && reverse->Truthy()) std::reverse(items.begin(), items.end());
    return Value::NewList(std::move(items));
}

}  // namespace

size_t ChargeOf(const Value& v) {
    if (v.is_string()) return v.str().size();
    if (v.is_list()) return v.list().size();
    if (v.is_mapping()) return v.dict().size();
    return 1;
}

Result<Value> ApplyFilter(std::string_view name, const Value& v, CallArgs& args, Budget* budget) {
    if (name == "default" || name == "d") {
        const Value* dflt = args.Get(0, "default_value");
        const Value* boolean = args.Get(1, "boolean");
        const bool use =
            v.is_undefined() || (boolean != nullptr && boolean->Truthy() && !v.Truthy());
        if (use) return dflt != nullptr ? *dflt : Value::String("");
        return v;
    }
    if (name == "safe") return v;
    if (name == "string") return v.ToStr();
    if (name == "tojson") return ToJsonFilter(v, args, budget);
    if (name == "length" || name == "count") {
        if (v.is_string()) return Value::Int(static_cast<int64_t>(CharCount(v.str())));
        if (v.is_list()) return Value::Int(static_cast<int64_t>(v.list().size()));
        if (v.is_mapping()) return Value::Int(static_cast<int64_t>(v.dict().size()));
        if (v.is_undefined()) return Value::Int(0);
        return InvalidArgument("object of type '" + std::string(v.TypeName()) + "' has no len()");
    }
    if (name == "list") {
        KV_ASSIGN_OR_RETURN(List items, Iterate(v));
        KV_RETURN_IF_ERROR(budget->Charge(items.size()));
        return Value::NewList(std::move(items));
    }
    if (name == "items") {
        if (v.is_undefined()) return Value::NewList();
        if (!v.is_mapping())
            return InvalidArgument("items needs a mapping, not " + std::string(v.TypeName()));
        KV_RETURN_IF_ERROR(budget->Charge(v.dict().size()));
        return ItemsOf(v);
    }
    if (name == "first" || name == "last") {
        KV_ASSIGN_OR_RETURN(List items, Iterate(v));
        if (items.empty())
            return Value::Undefined("the sequence has no " + std::string(name) + " item");
        return name == "first" ? items.front() : items.back();
    }
    if (name == "reverse") {
        if (v.is_string()) {
            KV_ASSIGN_OR_RETURN(List chars, Iterate(v));
            std::string out;
            for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += it->str();
            return Derived(std::move(out), v.HasLiteral());
        }
        KV_ASSIGN_OR_RETURN(List items, Iterate(v));
        std::reverse(items.begin(), items.end());
        return Value::NewList(std::move(items));
    }
    if (name == "join") return JoinFilter(v, args, budget);
    if (name == "sort") return SortFilter(v, args);
    if (name == "unique") {
        KV_ASSIGN_OR_RETURN(List items, Iterate(v));
        List out;
        for (Value& item : items) {
            if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return o == item; })) {
                out.push_back(std::move(item));
            }
        }
        return Value::NewList(std::move(out));
    }
    if (name == "map") return MapFilter(v, args, budget);
    if (name == "select" || name == "reject") return SelectFilter(v, args, false, name == "select");
    if (name == "selectattr" || name == "rejectattr") {
        return SelectFilter(v, args, true, name == "selectattr");
    }
    if (name == "abs") {
        if (v.kind() == Value::Kind::kInt) return Value::Int(v.i() < 0 ? -v.i() : v.i());
        if (v.kind() == Value::Kind::kFloat) return Value::Float(std::fabs(v.f()));
        return InvalidArgument("abs needs a number");
    }
    if (name == "int" || name == "float") {
        const bool to_int = name == "int";
        const Value* dflt = args.Get(0, "default");
        Value fallback = dflt != nullptr ? *dflt : (to_int ? Value::Int(0) : Value::Float(0));
        if (v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool) {
            const int64_t i = v.kind() == Value::Kind::kBool ? v.b() : v.i();
            return to_int ? Value::Int(i) : Value::Float(static_cast<double>(i));
        }
        if (v.kind() == Value::Kind::kFloat) {
            if (!to_int) return v;
            if (!std::isfinite(v.f()) || std::fabs(v.f()) > 9e18) return fallback;
            return Value::Int(static_cast<int64_t>(v.f()));
        }
        if (v.is_string()) {
            try {
                size_t used = 0;
                const std::string s(StripChars(v, kSpace, true, true).str());
                if (to_int) {
                    const int64_t i = std::stoll(s, &used);
                    if (used == s.size()) return Value::Int(i);
                } else {
                    const double f = std::stod(s, &used);
                    if (used == s.size()) return Value::Float(f);
                }
            } catch (const std::exception&) {
            }
        }
        return fallback;
    }
    if (v.is_undefined() && (name == "trim" || name == "upper" || name == "lower" ||
                             name == "capitalize" || name == "title" || name == "replace")) {
        return InvalidArgument(v.undefined_name());
    }
    if (name == "trim") {
        const Value s = v.ToStr();
        const Value* chars = args.Get(0, "chars");
        return StripChars(s, chars != nullptr && chars->is_string() ? chars->str() : kSpace, true,
                          true);
    }
    if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
        const Value s = v.ToStr();
        std::string out = name == "upper" ? MapChars(s.str(), [](int c) { return std::toupper(c); })
                          : name == "lower"
                              ? MapChars(s.str(), [](int c) { return std::tolower(c); })
                          : name == "title" ? Title(s.str())
                                            : Capitalize(s.str());
        return Derived(std::move(out), s.HasLiteral());
    }
    if (name == "replace") return Replace(v.ToStr(), args, budget);
    return InvalidArgument("the filter '" + std::string(name) +
                           "' is not supported by kvshard's chat template interpreter");
}

bool HasMethod(const Value& obj, std::string_view name) {
    static constexpr std::string_view kStr[] = {
        "strip", "lstrip", "rstrip", "split",      "rsplit", "startswith", "endswith", "replace",
        "upper", "lower",  "title",  "capitalize", "find",   "count",      "join"};
    static constexpr std::string_view kDict[] = {"items", "keys", "values", "get"};
    if (obj.is_string()) return std::find(std::begin(kStr), std::end(kStr), name) != std::end(kStr);
    if (obj.kind() == Value::Kind::kDict) {
        return std::find(std::begin(kDict), std::end(kDict), name) != std::end(kDict);
    }
    return false;
}

Result<Value> CallMethod(const Value& obj, std::string_view name, CallArgs& args, Budget* budget) {
    if (obj.kind() == Value::Kind::kDict) {
        if (name == "items") return ItemsOf(obj);
        if (name == "keys" || name == "values") {
            const bool literal = obj.ContainsLiteral();
            List out;
            for (const auto& [k, v] : obj.dict()) {
                out.push_back(name == "keys" ? Derived(k, literal) : v);
            }
            KV_RETURN_IF_ERROR(budget->Charge(out.size()));
            return Value::NewList(std::move(out));
        }
        // get
        KV_ASSIGN_OR_RETURN(std::string key, StrArg(args, 0, "key", "dict.get"));
        if (const Value* v = obj.Find(key)) return *v;
        const Value* dflt = args.Get(1, "default");
        return dflt != nullptr ? *dflt : Value::None();
    }
    KV_RETURN_IF_ERROR(NeedString(obj, "a string method"));
    const std::string& s = obj.str();
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
        KV_ASSIGN_OR_RETURN(std::string chars, StrArg(args, 0, "chars", name, " \t\n\r\v\f"));
        return StripChars(obj, chars, name != "rstrip", name != "lstrip");
    }
    if (name == "split" || name == "rsplit") {
        KV_ASSIGN_OR_RETURN(std::string sep, StrArg(args, 0, "sep", name, ""));
        const Value* max = args.Get(1, "maxsplit");
        const int64_t maxsplit = max != nullptr && max->kind() == Value::Kind::kInt ? max->i() : -1;
        if (name == "rsplit" && maxsplit >= 0) {
            return Status(StatusCode::kUnimplemented, "str.rsplit with maxsplit is not supported");
        }
        if (args.Get(0, "sep") != nullptr && !args.Get(0, "sep")->is_none() && sep.empty()) {
            return InvalidArgument("str.split: empty separator");
        }
        KV_ASSIGN_OR_RETURN(List parts, Split(obj, sep, maxsplit, budget));
        return Value::NewList(std::move(parts));
    }
    if (name == "startswith" || name == "endswith") {
        const Value* p = args.Get(0, "prefix");
        if (p == nullptr) return InvalidArgument(std::string(name) + " needs an argument");
        List options = p->is_list() ? p->list() : List{*p};
        for (const Value& o : options) {
            KV_RETURN_IF_ERROR(NeedString(o, name));
            const std::string& t = o.str();
            if (t.size() <= s.size() &&
                (name == "startswith" ? s.compare(0, t.size(), t) == 0
                                      : s.compare(s.size() - t.size(), t.size(), t) == 0)) {
                return Value::Bool(true);
            }
        }
        return Value::Bool(false);
    }
    if (name == "replace") return Replace(obj, args, budget);
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
        CallArgs none;
        return ApplyFilter(name, obj, none, budget);
    }
    if (name == "find" || name == "count") {
        KV_ASSIGN_OR_RETURN(std::string sub, StrArg(args, 0, "sub", name));
        if (name == "find") {
            const size_t at = s.find(sub);
            return Value::Int(
                at == std::string::npos ? -1 : static_cast<int64_t>(CharCount(s.substr(0, at))));
        }
        if (sub.empty()) return Value::Int(static_cast<int64_t>(CharCount(s) + 1));
        int64_t n = 0;
        for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size()))
            ++n;
        return Value::Int(n);
    }
    // join
    const Value* seq = args.Get(0, "iterable");
    if (seq == nullptr) return InvalidArgument("str.join needs an iterable");
    CallArgs join_args;
    join_args.positional.push_back(obj);
    return JoinFilter(*seq, join_args, budget);
}

}  // namespace kvshard::jinja
