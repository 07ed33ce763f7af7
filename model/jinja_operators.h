// Jinja's operators on values, as jinja2 (Python) computes them: subscripts (list and string
// items, negative indices from the end), slices seq[start:stop:step], and the binary operators:
// ~ (concatenation as strings), + on strings and lists, * repeating a string or list, and
// + - * / // % ** on numbers (bools count as ints; Python's floor division and modulo; an
// integer overflow is an error, not a wrap).
//
// Errors: InvalidArgument carrying only what went wrong (the renderer adds the template
// position); ResourceExhausted when `budget` is spent. Strings keep their literal marks where a
// substring keeps them (jinja_value.h).
// Thread-safety: pure functions over one render's values.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/status.h"
#include "model/jinja_builtins.h"
#include "model/jinja_value.h"

namespace kvshard::jinja {

// An int, or a bool as 0/1: what Python accepts as an index; nullopt for any other value.
std::optional<int64_t> AsIndex(const Value& v);
// obj[key] for a list or a string and an index key: the item, or an undefined value naming the
// missing element when it is out of range; nullopt when obj or key is of another kind.
std::optional<Value> ItemAt(const Value& obj, const Value& key);
// obj[start:stop:step] for a list or a string (by UTF-8 characters).
// REQUIRES: each bound none or an int (AsIndex).
Result<Value> Slice(const Value& obj, const Value (&bounds)[3], Budget* budget);
// a `op` b, with op one of ~ + - * / // % **.
Result<Value> BinaryOp(const std::string& op, const Value& a, const Value& b, Budget* budget);

}  // namespace kvshard::jinja
