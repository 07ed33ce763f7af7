#include "model/jinja_operators.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvshard::jinja {
namespace {

// Python's slice indices of a sequence of length n.
std::vector<int64_t> SliceIndices(int64_t n, const Value& start, const Value& stop,
                                  const Value& step) {
    const int64_t st = step.is_none() || step.is_undefined() ? 1 : step.i();
    auto clamp = [&](const Value& v, int64_t dflt, bool is_start) -> int64_t {
        if (v.is_none() || v.is_undefined()) return dflt;
        int64_t x = v.i();
        if (x < 0) x += n;
        if (st > 0) return std::clamp<int64_t>(x, 0, n);
        (void)is_start;
        return std::clamp<int64_t>(x, -1, n - 1);
    };
    std::vector<int64_t> out;
    if (st > 0) {
        const int64_t b = clamp(start, 0, true);
        const int64_t e = clamp(stop, n, false);
        for (int64_t i = b; i < e; i += st) out.push_back(i);
    } else {
        const int64_t b = clamp(start, n - 1, true);
        const int64_t e = clamp(stop, -1, false);
        for (int64_t i = b; i > e; i += st) out.push_back(i);
    }
    return out;
}

// Byte offsets of the UTF-8 characters of s, and s.size() at the end.
std::vector<size_t> CharStarts(const std::string& s) {
    std::vector<size_t> out;
    for (size_t i = 0; i < s.size(); ++i) {
        if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) out.push_back(i);
    }
    out.push_back(s.size());
    return out;
}

bool IsIndex(const Value& v) {
    return v.kind() == Value::Kind::kInt || v.kind() == Value::Kind::kBool;
}
int64_t IndexOf(const Value& v) { return v.kind() == Value::Kind::kBool ? v.b() : v.i(); }

}  // namespace

std::optional<int64_t> AsIndex(const Value& v) {
    if (!IsIndex(v)) return std::nullopt;
    return IndexOf(v);
}

std::optional<Value> ItemAt(const Value& obj, const Value& key) {
    if (obj.is_list() && IsIndex(key)) {
        const int64_t n = static_cast<int64_t>(obj.list().size());
        int64_t i = IndexOf(key);
        if (i < 0) i += n;
        if (i >= 0 && i < n) return obj.list()[i];
        return Value::Undefined("list object has no element " + std::to_string(IndexOf(key)));
    }
    if (obj.is_string() && IsIndex(key)) {
        const std::vector<size_t> starts = CharStarts(obj.str());
        const int64_t n = static_cast<int64_t>(starts.size()) - 1;
        int64_t i = IndexOf(key);
        if (i < 0) i += n;
        if (i >= 0 && i < n) return Substr(obj, starts[i], starts[i + 1]);
        return Value::Undefined("str object has no element " + std::to_string(IndexOf(key)));
    }
    return std::nullopt;
}

Result<Value> Slice(const Value& obj, const Value (&bounds)[3], Budget* budget) {
    if (bounds[2].kind() == Value::Kind::kInt && bounds[2].i() == 0) {
        return InvalidArgument("slice step cannot be zero");
    }
    if (obj.is_undefined()) return InvalidArgument(obj.undefined_name());
    if (obj.is_list()) {
        const auto idx =
            SliceIndices(static_cast<int64_t>(obj.list().size()), bounds[0], bounds[1], bounds[2]);
        KV_RETURN_IF_ERROR(budget->Charge(idx.size()));
        List items;
        for (int64_t i : idx) items.push_back(obj.list()[i]);
        return Value::NewList(std::move(items));
    }
    if (obj.is_string()) {
        const std::vector<size_t> starts = CharStarts(obj.str());
        const auto idx =
            SliceIndices(static_cast<int64_t>(starts.size()) - 1, bounds[0], bounds[1], bounds[2]);
        KV_RETURN_IF_ERROR(budget->Charge(obj.str().size()));
        const bool step_one = bounds[2].is_none() || bounds[2].i() == 1;
        if (step_one) {
            if (idx.empty()) return Value::String("");
            return Substr(obj, starts[idx.front()], starts[idx.back() + 1]);
        }
        std::string text;
        for (int64_t i : idx) text += obj.str().substr(starts[i], starts[i + 1] - starts[i]);
        return Derived(std::move(text), obj.HasLiteral());
    }
    return InvalidArgument("a " + std::string(obj.TypeName()) + " cannot be sliced");
}

Result<Value> BinaryOp(const std::string& op, const Value& a, const Value& b, Budget* budget) {
    if (op == "~") {
        MarkedText t;
        t.Append(a.ToStr());
        t.Append(b.ToStr());
        KV_RETURN_IF_ERROR(budget->Charge(t.text().size()));
        return std::move(t).ToValue();
    }
    if (a.is_undefined()) return InvalidArgument(a.undefined_name());
    if (b.is_undefined()) return InvalidArgument(b.undefined_name());
    auto type_error = [&] {
        return InvalidArgument("unsupported operand types for " + op + ": '" +
                               std::string(a.TypeName()) + "' and '" + std::string(b.TypeName()) +
                               "'");
    };
    if (op == "+" && a.is_string() && b.is_string()) {
        MarkedText t;
        t.Append(a);
        t.Append(b);
        KV_RETURN_IF_ERROR(budget->Charge(t.text().size()));
        return std::move(t).ToValue();
    }
    if (op == "+" && a.is_list() && b.is_list()) {
        List items = a.list();
        items.insert(items.end(), b.list().begin(), b.list().end());
        KV_RETURN_IF_ERROR(budget->Charge(items.size()));
        return Value::NewList(std::move(items));
    }
    if (op == "*" && (a.is_string() || a.is_list()) && IsIndex(b)) {
        const int64_t n = std::max<int64_t>(0, IndexOf(b));
        const size_t unit = a.is_string() ? a.str().size() : a.list().size();
        if (unit > 0 && static_cast<uint64_t>(n) > (uint64_t{1} << 40) / unit) {
            return budget->Charge(SIZE_MAX);
        }
        KV_RETURN_IF_ERROR(budget->Charge(unit * static_cast<size_t>(n)));
        if (a.is_string()) {
            std::string text;
            for (int64_t i = 0; i < n; ++i) text += a.str();
            return Derived(std::move(text), a.HasLiteral());
        }
        List items;
        for (int64_t i = 0; i < n; ++i) items.insert(items.end(), a.list().begin(), a.list().end());
        return Value::NewList(std::move(items));
    }
    const bool ints = (IsIndex(a)) && (IsIndex(b));
    if (!(a.is_number() || a.kind() == Value::Kind::kBool) ||
        !(b.is_number() || b.kind() == Value::Kind::kBool)) {
        return type_error();
    }
    const double x = IsIndex(a) ? static_cast<double>(IndexOf(a)) : a.f();
    const double y = IsIndex(b) ? static_cast<double>(IndexOf(b)) : b.f();
    if (ints && (op == "+" || op == "-" || op == "*")) {
        int64_t r = 0;
        const int64_t p = IndexOf(a);
        const int64_t q = IndexOf(b);
        const bool overflow = op == "+"   ? __builtin_add_overflow(p, q, &r)
                              : op == "-" ? __builtin_sub_overflow(p, q, &r)
                                          : __builtin_mul_overflow(p, q, &r);
        if (overflow) return InvalidArgument("integer overflow in " + op);
        return Value::Int(r);
    }
    if (op == "+") return Value::Float(x + y);
    if (op == "-") return Value::Float(x - y);
    if (op == "*") return Value::Float(x * y);
    if ((op == "/" || op == "//" || op == "%") && y == 0) {
        return InvalidArgument("division by zero");
    }
    if (op == "/") return Value::Float(x / y);
    if (op == "//" || op == "%") {
        if (ints) {
            const int64_t p = IndexOf(a);
            const int64_t q = IndexOf(b);
            int64_t d = p / q;
            if ((p % q != 0) && ((p < 0) != (q < 0))) --d;
            return Value::Int(op == "//" ? d : p - d * q);
        }
        const double d = std::floor(x / y);
        return Value::Float(op == "//" ? d : x - d * y);
    }
    if (op == "**") {
        if (ints && IndexOf(b) >= 0) {
            int64_t r = 1;
            for (int64_t i = 0; i < IndexOf(b); ++i) {
                if (__builtin_mul_overflow(r, IndexOf(a), &r)) {
                    return InvalidArgument("integer overflow in **");
                }
                if (r == 0 || r == 1) break;
            }
            return Value::Int(r);
        }
        return Value::Float(std::pow(x, y));
    }
    return type_error();
}

}  // namespace kvshard::jinja
