// The filters, tests, methods and global functions chat templates call, as jinja2 (in HF's
// ImmutableSandboxedEnvironment) defines them: filters trim, tojson (HF's json.dumps version:
// ensure_ascii=False, indent, separators, sort_keys), length/count, upper, lower, capitalize,
// title, string, int, float, abs, first, last, join, default/d, items, list, reverse, sort,
// unique, replace, safe, selectattr/rejectattr/select/reject, map; tests defined, undefined,
// none, boolean, true, false, string, number, integer, float, mapping, iterable, sequence,
// callable, equalto/eq/==, ne, lt/le/gt/ge, in, odd, even, divisibleby, lower, upper; str
// methods strip, lstrip, rstrip, split, rsplit, startswith, endswith, replace, upper, lower,
// title, capitalize, find, count, join, format is not; dict methods items, keys, values, get;
// globals namespace, range, dict, raise_exception, strftime_now. Methods that would modify a
// value (list.append, dict.update) are refused as the sandbox refuses them.
//
// Thread-safety: pure functions over one render's values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "model/jinja_value.h"

namespace kvshard::jinja {

// Work a render may do: every string or list a builtin builds is charged its size, so that a
// template cannot grow values without bound out of sight of the output limit.
class Budget {
  public:
    explicit Budget(size_t max_bytes) : left_(max_bytes) {}
    Status Charge(size_t bytes) {
        if (bytes > left_) {
            return Status(StatusCode::kResourceExhausted,
                          "the chat template built more than its budget of strings and lists");
        }
        left_ -= bytes;
        return Status::Ok();
    }

  private:
    size_t left_;
};

// The size a value is charged: bytes of a string, items of a list or dict.
size_t ChargeOf(const Value& v);

Result<Value> ApplyFilter(std::string_view name, const Value& operand, CallArgs& args,
                          Budget* budget);
// InvalidArgument naming an unknown test.
Result<bool> ApplyTest(std::string_view name, const Value& operand, CallArgs& args);
// obj.name(args): a method of str or dict.
Result<Value> CallMethod(const Value& obj, std::string_view name, CallArgs& args, Budget* budget);
// True when `name` is a method CallMethod knows for obj's type (obj.name then is a bound method,
// not an attribute lookup).
bool HasMethod(const Value& obj, std::string_view name);
// The global functions, by name; an undefined Value for other names.
Value GlobalFunction(std::string_view name, Budget* budget);

// Items of an iterable as a for loop sees them: a list's items, a dict's keys, a string's
// characters (UTF-8 code points); an undefined value is empty. InvalidArgument otherwise.
Result<List> Iterate(const Value& v);
// Python's <, for numbers and strings; InvalidArgument for other pairs.
Result<bool> Less(const Value& a, const Value& b);

}  // namespace kvshard::jinja
