#include "model/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace kvshard::jinja {

const Value* CallArgs::Get(size_t index, std::string_view name) const {
    for (const auto& [k, v] : keyword) {
        if (k == name) return &v;
    }
    return index < positional.size() ? &positional[index] : nullptr;
}

Value Value::Undefined(std::string why) {
    Value v;
    v.s_ = std::move(why);
    return v;
}
Value Value::None() {
    Value v;
    v.kind_ = Kind::kNone;
    return v;
}
Value Value::Bool(bool b) {
    Value v;
    v.kind_ = Kind::kBool;
    v.b_ = b;
    return v;
}
Value Value::Int(int64_t i) {
    Value v;
    v.kind_ = Kind::kInt;
    v.i_ = i;
    return v;
}
Value Value::Float(double f) {
    Value v;
    v.kind_ = Kind::kFloat;
    v.f_ = f;
    return v;
}
Value Value::String(std::string s, LiteralSpans spans) {
    Value v;
    v.kind_ = Kind::kString;
    v.s_ = std::move(s);
    v.spans_ = std::move(spans);
    return v;
}
Value Value::LiteralString(std::string s) {
    LiteralSpans spans;
    if (!s.empty()) spans.push_back({0, s.size()});
    return String(std::move(s), std::move(spans));
}
namespace {

uint16_t DepthOver(int deepest) {
    return static_cast<uint16_t>(std::min(deepest + 1, int{UINT16_MAX}));
}

}  // namespace

Value Value::NewList(List items) {
    Value v;
    v.kind_ = Kind::kList;
    int deepest = 0;
    for (const Value& item : items) deepest = std::max(deepest, item.depth());
    v.depth_ = DepthOver(deepest);
    v.list_ = std::make_shared<List>(std::move(items));
    return v;
}
Value Value::NewDict(Dict items) {
    Value v;
    v.kind_ = Kind::kDict;
    int deepest = 0;
    for (const auto& kv : items) deepest = std::max(deepest, kv.second.depth());
    v.depth_ = DepthOver(deepest);
    v.dict_ = std::make_shared<Dict>(std::move(items));
    return v;
}
Value Value::NewNamespace(Dict items) {
    Value v = NewDict(std::move(items));
    v.kind_ = Kind::kNamespace;
    v.depth_ = 1;
    return v;
}
Value Value::NewFunction(Function fn) {
    Value v;
    v.kind_ = Kind::kFunction;
    v.fn_ = std::make_shared<Function>(std::move(fn));
    return v;
}

int JsonDepth(const nlohmann::ordered_json& j, int limit) {
    if (!j.is_structured()) return 0;
    if (limit < 0) return 1;
    int deepest = 0;
    for (const auto& e : j) deepest = std::max(deepest, JsonDepth(e, limit - 1));
    return deepest + 1;
}

Value Value::FromJson(const nlohmann::ordered_json& j, bool literal) {
    switch (j.type()) {
        case nlohmann::ordered_json::value_t::null:
            return None();
        case nlohmann::ordered_json::value_t::boolean:
            return Bool(j.get<bool>());
        case nlohmann::ordered_json::value_t::number_integer:
        case nlohmann::ordered_json::value_t::number_unsigned:
            return Int(j.get<int64_t>());
        case nlohmann::ordered_json::value_t::number_float:
            return Float(j.get<double>());
        case nlohmann::ordered_json::value_t::string:
            return literal ? LiteralString(j.get<std::string>()) : String(j.get<std::string>());
        case nlohmann::ordered_json::value_t::array: {
            List items;
            for (const nlohmann::ordered_json& e : j) items.push_back(FromJson(e, literal));
            return NewList(std::move(items));
        }
        case nlohmann::ordered_json::value_t::object: {
            Dict items;
            for (auto it = j.begin(); it != j.end(); ++it) {
                items.emplace_back(it.key(), FromJson(it.value(), literal));
            }
            return NewDict(std::move(items));
        }
        case nlohmann::ordered_json::value_t::binary:
        case nlohmann::ordered_json::value_t::discarded:
            return None();
    }
    return None();
}

bool Value::Truthy() const {
    switch (kind_) {
        case Kind::kUndefined:
        case Kind::kNone:
            return false;
        case Kind::kBool:
            return b_;
        case Kind::kInt:
            return i_ != 0;
        case Kind::kFloat:
            return f_ != 0;
        case Kind::kString:
            return !s_.empty();
        case Kind::kList:
            return !list_->empty();
        case Kind::kDict:
            return !dict_->empty();
        case Kind::kNamespace:
        case Kind::kFunction:
            return true;
    }
    return false;
}

Value* Value::Find(std::string_view key) const {
    if (!dict_) return nullptr;
    for (auto& [k, v] : *dict_) {
        if (k == key) return &v;
    }
    return nullptr;
}

void Value::Set(const std::string& key, Value v) const {
    if (Value* old = Find(key)) {
        *old = std::move(v);
    } else {
        dict_->emplace_back(key, std::move(v));
    }
}

bool Value::ContainsLiteral() const { return ContainsLiteralAt(0); }

bool Value::ContainsLiteralAt(int depth) const {
    if (depth > kMaxNesting) return true;  // too deep to look: assume request text is inside
    switch (kind_) {
        case Kind::kString:
            return !spans_.empty();
        case Kind::kList:
            return std::any_of(list_->begin(), list_->end(),
                               [depth](const Value& v) { return v.ContainsLiteralAt(depth + 1); });
        case Kind::kDict:
        case Kind::kNamespace:
            return std::any_of(dict_->begin(), dict_->end(), [depth](const auto& kv) {
                return kv.second.ContainsLiteralAt(depth + 1);
            });
        case Kind::kUndefined:
        case Kind::kNone:
        case Kind::kBool:
        case Kind::kInt:
        case Kind::kFloat:
        case Kind::kFunction:
            return false;
    }
    return false;
}

namespace {

// Python's repr() of a float.
std::string FloatRepr(double f) {
    if (std::isnan(f)) return "nan";
    if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), f);
    std::string s(buf, end);
    if (s.find_first_of(".en") == std::string::npos) s += ".0";
    return s;
}

// Python's repr() of a str.
std::string StrRepr(const std::string& s) {
    const char quote =
        (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
    std::string out(1, quote);
    for (unsigned char c : s) {
        if (c == '\\' || c == static_cast<unsigned char>(quote)) {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c == '\n') {
            out += "\\n";
        } else if (c == '\r') {
            out += "\\r";
        } else if (c == '\t') {
            out += "\\t";
        } else if (c < 0x20 || c == 0x7f) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\x%02x", c);
            out += buf;
        } else {
            out += static_cast<char>(c);
        }
    }
    out += quote;
    return out;
}

void Repr(const Value& v, std::string* out, bool top, int depth = 0) {
    if (depth > kMaxNesting) {
        *out += "...";
        return;
    }
    switch (v.kind()) {
        case Value::Kind::kUndefined:
            if (!top) *out += "Undefined";
            return;
        case Value::Kind::kNone:
            *out += "None";
            return;
        case Value::Kind::kBool:
            *out += v.b() ? "True" : "False";
            return;
        case Value::Kind::kInt:
            *out += std::to_string(v.i());
            return;
        case Value::Kind::kFloat:
            *out += FloatRepr(v.f());
            return;
        case Value::Kind::kString:
            *out += top ? v.str() : StrRepr(v.str());
            return;
        case Value::Kind::kList: {
            *out += '[';
            for (size_t i = 0; i < v.list().size(); ++i) {
                if (i > 0) *out += ", ";
                Repr(v.list()[i], out, false, depth + 1);
            }
            *out += ']';
            return;
        }
        case Value::Kind::kDict: {
            *out += '{';
            bool first = true;
            for (const auto& [k, e] : v.dict()) {
                if (!first) *out += ", ";
                first = false;
                *out += StrRepr(k) + ": ";
                Repr(e, out, false, depth + 1);
            }
            *out += '}';
            return;
        }
        case Value::Kind::kNamespace:
            *out += "<Namespace>";
            return;
        case Value::Kind::kFunction:
            *out += "<function>";
            return;
    }
}

void JsonString(const std::string& s, std::string* out) {
    *out += '"';
    for (unsigned char c : s) {
        switch (c) {
            case '"':
                *out += "\\\"";
                break;
            case '\\':
                *out += "\\\\";
                break;
            case '\n':
                *out += "\\n";
                break;
            case '\r':
                *out += "\\r";
                break;
            case '\t':
                *out += "\\t";
                break;
            case '\b':
                *out += "\\b";
                break;
            case '\f':
                *out += "\\f";
                break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    snprintf(buf, sizeof(buf), "\\u%04x", c);
                    *out += buf;
                } else {
                    *out += static_cast<char>(c);
                }
        }
    }
    *out += '"';
}

struct JsonStyle {
    int indent;  // < 0: none
    std::string_view item_sep;
    std::string_view key_sep;
    bool sort_keys;
};

Status Json(const Value& v, const JsonStyle& style, int depth, std::string* out) {
    if (depth > kMaxNesting) {
        return InvalidArgument("tojson: the value nests deeper than " +
                               std::to_string(kMaxNesting) + " levels");
    }
    auto newline = [&](int level) {
        if (style.indent < 0) return;
        *out += '\n';
        out->append(static_cast<size_t>(style.indent) * level, ' ');
    };
    switch (v.kind()) {
        case Value::Kind::kUndefined:
            return InvalidArgument("tojson: " + v.undefined_name());
        case Value::Kind::kFunction:
            return InvalidArgument("tojson: a function is not JSON");
        case Value::Kind::kNone:
            *out += "null";
            return Status::Ok();
        case Value::Kind::kBool:
            *out += v.b() ? "true" : "false";
            return Status::Ok();
        case Value::Kind::kInt:
            *out += std::to_string(v.i());
            return Status::Ok();
        case Value::Kind::kFloat:
            if (std::isnan(v.f())) {
                *out += "NaN";
            } else if (std::isinf(v.f())) {
                *out += v.f() > 0 ? "Infinity" : "-Infinity";
            } else {
                *out += FloatRepr(v.f());
            }
            return Status::Ok();
        case Value::Kind::kString:
            JsonString(v.str(), out);
            return Status::Ok();
        case Value::Kind::kList: {
            if (v.list().empty()) {
                *out += "[]";
                return Status::Ok();
            }
            *out += '[';
            for (size_t i = 0; i < v.list().size(); ++i) {
                if (i > 0) *out += style.item_sep;
                newline(depth + 1);
                KV_RETURN_IF_ERROR(Json(v.list()[i], style, depth + 1, out));
            }
            newline(depth);
            *out += ']';
            return Status::Ok();
        }
        case Value::Kind::kDict:
        case Value::Kind::kNamespace: {
            if (v.dict().empty()) {
                *out += "{}";
                return Status::Ok();
            }
            std::vector<const std::pair<std::string, Value>*> items;
            for (const auto& kv : v.dict()) items.push_back(&kv);
            if (style.sort_keys) {
                std::stable_sort(items.begin(), items.end(),
                                 [](auto* a, auto* b) { return a->first < b->first; });
            }
            *out += '{';
            for (size_t i = 0; i < items.size(); ++i) {
                if (i > 0) *out += style.item_sep;
                newline(depth + 1);
                JsonString(items[i]->first, out);
                *out += style.key_sep;
                KV_RETURN_IF_ERROR(Json(items[i]->second, style, depth + 1, out));
            }
            newline(depth);
            *out += '}';
            return Status::Ok();
        }
    }
    return Status::Ok();
}

}  // namespace

Value Value::ToStr() const {
    if (kind_ == Kind::kString) return *this;
    std::string out;
    Repr(*this, &out, true);
    return Derived(std::move(out), ContainsLiteral());
}

Result<std::string> Value::ToJson(int indent, std::string_view item_sep, std::string_view key_sep,
                                  bool sort_keys) const {
    std::string out;
    KV_RETURN_IF_ERROR(Json(*this, {indent, item_sep, key_sep, sort_keys}, 0, &out));
    return out;
}

bool operator==(const Value& a, const Value& b) { return Value::Equal(a, b, 0); }

bool Value::Equal(const Value& a, const Value& b, int depth) {
    using K = Value::Kind;
    if (depth > kMaxNesting) return false;
    if (a.is_number() && b.is_number()) {
        if (a.kind() == K::kInt && b.kind() == K::kInt) return a.i() == b.i();
        return a.f() == b.f();
    }
    if ((a.kind() == K::kBool && b.is_number()) || (a.is_number() && b.kind() == K::kBool)) {
        const double x = a.kind() == K::kBool ? a.b() : a.f();
        const double y = b.kind() == K::kBool ? b.b() : b.f();
        return x == y;
    }
    if (a.kind() != b.kind()) return false;
    switch (a.kind()) {
        case K::kUndefined:
        case K::kNone:
            return true;
        case K::kBool:
            return a.b() == b.b();
        case K::kInt:
        case K::kFloat:
            return false;  // handled above
        case K::kString:
            return a.str() == b.str();
        case K::kList:
            if (&a.list() == &b.list()) return true;
            if (a.list().size() != b.list().size()) return false;
            for (size_t i = 0; i < a.list().size(); ++i) {
                if (!Equal(a.list()[i], b.list()[i], depth + 1)) return false;
            }
            return true;
        case K::kDict:
            if (&a.dict() == &b.dict()) return true;
            if (a.dict().size() != b.dict().size()) return false;
            for (const auto& [k, v] : a.dict()) {
                const Value* other = b.Find(k);
                if (other == nullptr || !Equal(v, *other, depth + 1)) return false;
            }
            return true;
        case K::kNamespace:
            return &a.dict() == &b.dict();
        case K::kFunction:
            return &a.function() == &b.function();
    }
    return false;
}

std::string_view Value::TypeName() const {
    switch (kind_) {
        case Kind::kUndefined:
            return "undefined";
        case Kind::kNone:
            return "NoneType";
        case Kind::kBool:
            return "bool";
        case Kind::kInt:
            return "int";
        case Kind::kFloat:
            return "float";
        case Kind::kString:
            return "str";
        case Kind::kList:
            return "list";
        case Kind::kDict:
            return "dict";
        case Kind::kNamespace:
            return "Namespace";
        case Kind::kFunction:
            return "function";
    }
    return "?";
}

void MarkedText::Append(const std::string& text, const LiteralSpans& spans) {
    const size_t base = text_.size();
    for (const auto& [b, e] : spans) {
        if (!spans_.empty() && spans_.back().second == base + b) {
            spans_.back().second = base + e;
        } else {
            spans_.push_back({base + b, base + e});
        }
    }
    text_ += text;
}

void MarkedText::AppendMarkup(std::string_view text) { text_.append(text); }

std::vector<TextPiece> MarkedText::Pieces() const {
    std::vector<TextPiece> out;
    size_t pos = 0;
    for (const auto& [b, e] : spans_) {
        if (b > pos) out.push_back({text_.substr(pos, b - pos), false});
        if (e > b) out.push_back({text_.substr(b, e - b), true});
        pos = e;
    }
    if (pos < text_.size()) out.push_back({text_.substr(pos), false});
    return out;
}

Value Substr(const Value& s, size_t begin, size_t end) {
    end = std::min(end, s.str().size());
    begin = std::min(begin, end);
    LiteralSpans spans;
    for (const auto& [b, e] : s.spans()) {
        const size_t nb = std::max(b, begin);
        const size_t ne = std::min(e, end);
        if (nb < ne) spans.push_back({nb - begin, ne - begin});
    }
    return Value::String(s.str().substr(begin, end - begin), std::move(spans));
}

Value Derived(std::string text, bool literal) {
    return literal ? Value::LiteralString(std::move(text)) : Value::String(std::move(text));
}

}  // namespace kvshard::jinja
