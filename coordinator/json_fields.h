// The small JSON readers both request parsers share (coordinator/openai_*request*.cc with
// openai_protocol.cc, and coordinator/anthropic_protocol.cc): how a value's type is named in an
// error, how a client's number is echoed, a field that is absent or null, and an integer that may
// arrive as 3.0. Each parser keeps its own error wording and paths; these only read.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace kvshard::json_fields {

// "null", "a boolean", "an integer", "a number", "a string", "an array", "an object".
std::string TypeName(const nlohmann::json& v);
// A client's number as a short text: "%g" (1e+308, not its 309 digits).
std::string Number(double x);
// The field, or nullptr when it is absent or null (null means "not given", as clients send it).
const nlohmann::json* Field(const nlohmann::json& object, const char* name);
// The value as an integer: an integer (unsigned ones above INT64_MAX clamp to it) or a finite
// float with no fraction below 9e18; nullopt for anything else.
std::optional<int64_t> Integer(const nlohmann::json& v);

// The deepest nesting of arrays and objects kvshard reads in a request's JSON: the body, and the
// JSON texts carried inside it (tool arguments, a guided_json schema, a model's tool call).
// nlohmann parses iteratively but prints (dump) and compares recursively, and so do kvshard's
// schema compiler and prompt writers: a 1 MiB body of brackets nested 100,000 deep exhausted a
// server thread's stack. Real requests nest a dozen levels.
inline constexpr int kMaxJsonDepth = 64;

// json::parse(text, nullptr, /*allow_exceptions=*/false), but a text whose arrays and objects
// nest deeper than kMaxJsonDepth is refused before it is parsed: the result is discarded and
// *too_deep (when given) is set. Strings may hold any brackets.
nlohmann::json ParseJson(std::string_view text, bool* too_deep = nullptr);

// The nesting depth of a JSON text (0 for a scalar), counting no further than `limit` + 1; a
// malformed text gets the depth of its brackets, which is all ParseJson needs of it.
int JsonNestingDepth(std::string_view text, int limit = kMaxJsonDepth);

}  // namespace kvshard::json_fields
