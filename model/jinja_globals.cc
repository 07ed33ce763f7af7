#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>

#include "model/jinja_builtins.h"

// Tests, global functions, iteration and ordering (jinja_builtins.h); filters and methods are in
// jinja_builtins.cc.
namespace kvshard::jinja {

Result<bool> ApplyTest(std::string_view name, const Value& v, CallArgs& args) {
    using K = Value::Kind;
    const Value* other = args.Get(0, "other");
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.kind() == K::kBool;
    if (name == "true") return v.kind() == K::kBool && v.b();
    if (name == "false") return v.kind() == K::kBool && !v.b();
    if (name == "string") return v.is_string();
    if (name == "number") return v.is_number() || v.kind() == K::kBool;
    if (name == "integer") return v.kind() == K::kInt;
    if (name == "float") return v.kind() == K::kFloat;
    if (name == "mapping") return v.kind() == K::kDict;
    if (name == "iterable")
        return v.is_string() || v.is_list() || v.is_mapping() || v.is_undefined();
    if (name == "sequence") return v.is_string() || v.is_list() || v.kind() == K::kDict;
    if (name == "callable") return v.kind() == K::kFunction;
    if (name == "lower" || name == "upper") {
        if (!v.is_string()) return false;
        const bool upper = name == "upper";
        bool cased = false;
        for (char c : v.str()) {
            if (std::isalpha(static_cast<unsigned char>(c))) {
                cased = true;
                if ((std::isupper(static_cast<unsigned char>(c)) != 0) != upper) return false;
            }
        }
        return cased;
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {
        if (v.kind() != K::kInt)
            return InvalidArgument("the test '" + std::string(name) + "' needs an integer");
        if (name == "odd") return v.i() % 2 != 0;
        if (name == "even") return v.i() % 2 == 0;
        const Value* n = args.Get(0, "num");
        if (n == nullptr || n->kind() != K::kInt || n->i() == 0) {
            return InvalidArgument("divisibleby needs a non-zero integer");
        }
        return v.i() % n->i() == 0;
    }
    if (other == nullptr && (name == "equalto" || name == "eq" || name == "==" || name == "ne" ||
                             name == "!=" || name == "in" || name == "sameas" || name == "lt" ||
                             name == "le" || name == "gt" || name == "ge")) {
        return InvalidArgument("the test '" + std::string(name) + "' needs an argument");
    }
    if (name == "equalto" || name == "eq" || name == "==") return v == *other;
    if (name == "ne" || name == "!=") return !(v == *other);
    if (name == "sameas") return v == *other && (v.is_none() || v.kind() == K::kBool);
    if (name == "lt" || name == "<") return Less(v, *other);
    if (name == "gt" || name == ">") return Less(*other, v);
    if (name == "le" || name == "<=") {
        KV_ASSIGN_OR_RETURN(bool gt, Less(*other, v));
        return !gt;
    }
    if (name == "ge" || name == ">=") {
        KV_ASSIGN_OR_RETURN(bool lt, Less(v, *other));
        return !lt;
    }
    if (name == "in") {
        const Value& seq = *other;
        if (seq.is_string()) {
            if (!v.is_string()) {
                return InvalidArgument("'in <string>' needs a string on the left, not " +
                                       std::string(v.TypeName()));
            }
            return seq.str().find(v.str()) != std::string::npos;
        }
        if (seq.is_mapping()) return v.is_string() && seq.Find(v.str()) != nullptr;
        if (seq.is_list()) {
            return std::any_of(seq.list().begin(), seq.list().end(),
                               [&](const Value& e) { return e == v; });
        }
        if (seq.is_undefined()) return false;
        return InvalidArgument("argument of type '" + std::string(seq.TypeName()) +
                               "' is not iterable");
    }
    return InvalidArgument("the test '" + std::string(name) +
                           "' is not supported by kvshard's chat template interpreter");
}

Value GlobalFunction(std::string_view name, Budget* budget) {
    if (name == "namespace" || name == "dict") {
        const bool ns = name == "namespace";
        return Value::NewFunction([ns](CallArgs& args) -> Result<Value> {
            Dict items;
            for (const Value& p : args.positional) {
                if (!p.is_mapping())
                    return InvalidArgument("namespace()/dict() take a mapping or keywords");
                for (const auto& kv : p.dict()) items.push_back(kv);
            }
            for (auto& kv : args.keyword) items.push_back(kv);
            return ns ? Value::NewNamespace(std::move(items)) : Value::NewDict(std::move(items));
        });
    }
    if (name == "range") {
        return Value::NewFunction([budget](CallArgs& args) -> Result<Value> {
            int64_t v[3] = {0, 0, 1};
            const size_t n = args.positional.size();
            if (n < 1 || n > 3) return InvalidArgument("range takes 1 to 3 integers");
            for (size_t i = 0; i < n; ++i) {
                if (args.positional[i].kind() != Value::Kind::kInt) {
                    return InvalidArgument("range takes integers");
                }
            }
            if (n == 1) {
                v[1] = args.positional[0].i();
            } else {
                for (size_t i = 0; i < n; ++i) v[i] = args.positional[i].i();
            }
            if (v[2] == 0) return InvalidArgument("range step must not be zero");
            const double count = std::ceil((static_cast<double>(v[1]) - v[0]) / v[2]);
            if (count > 1e7) return budget->Charge(SIZE_MAX);
            List out;
            if (count > 0) {
                KV_RETURN_IF_ERROR(budget->Charge(static_cast<size_t>(count)));
                for (int64_t x = v[0]; v[2] > 0 ? x < v[1] : x > v[1]; x += v[2]) {
                    out.push_back(Value::Int(x));
                }
            }
            return Value::NewList(std::move(out));
        });
    }
    if (name == "raise_exception") {
        return Value::NewFunction([](CallArgs& args) -> Result<Value> {
            const std::string what =
                args.positional.empty() ? std::string() : args.positional[0].ToStr().str();
            return InvalidArgument("the model's chat template refused the conversation: " + what);
        });
    }
    if (name == "strftime_now") {
        return Value::NewFunction([](CallArgs& args) -> Result<Value> {
            if (args.positional.empty() || !args.positional[0].is_string()) {
                return InvalidArgument("strftime_now needs a format string");
            }
            const std::string& format = args.positional[0].str();
            if (format.size() > 256) return InvalidArgument("strftime_now: format too long");
            const std::time_t now =
                std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
            std::tm tm{};
            localtime_r(&now, &tm);
            char buf[1024];
            const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &tm);
            return Value::String(std::string(buf, n));
        });
    }
    return Value();
}

Result<List> Iterate(const Value& v) {
    switch (v.kind()) {
        case Value::Kind::kUndefined:
            return List{};
        case Value::Kind::kList:
            return v.list();
        case Value::Kind::kDict:
        case Value::Kind::kNamespace: {
            const bool literal = v.ContainsLiteral();
            List keys;
            for (const auto& kv : v.dict()) keys.push_back(Derived(kv.first, literal));
            return keys;
        }
        case Value::Kind::kString: {
            List chars;
            const std::string& s = v.str();
            size_t start = 0;
            for (size_t i = 1; i <= s.size(); ++i) {
                if (i == s.size() || (static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) {
                    chars.push_back(Substr(v, start, i));
                    start = i;
                }
            }
            return chars;
        }
        case Value::Kind::kNone:
        case Value::Kind::kBool:
        case Value::Kind::kInt:
        case Value::Kind::kFloat:
        case Value::Kind::kFunction:
            break;
    }
    return InvalidArgument("'" + std::string(v.TypeName()) + "' object is not iterable");
}

Result<bool> Less(const Value& a, const Value& b) {
    auto num = [](const Value& v) { return v.is_number() || v.kind() == Value::Kind::kBool; };
    auto as_double = [](const Value& v) {
        return v.kind() == Value::Kind::kBool ? static_cast<double>(v.b()) : v.f();
    };
    if (num(a) && num(b)) {
        if (a.kind() == Value::Kind::kInt && b.kind() == Value::Kind::kInt) return a.i() < b.i();
        return as_double(a) < as_double(b);
    }
    if (a.is_string() && b.is_string()) return a.str() < b.str();
    if (a.is_undefined()) return InvalidArgument(a.undefined_name());
    if (b.is_undefined()) return InvalidArgument(b.undefined_name());
    return InvalidArgument("'<' is not supported between '" + std::string(a.TypeName()) +
                           "' and '" + std::string(b.TypeName()) + "'");
}

}  // namespace kvshard::jinja
