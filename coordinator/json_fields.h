// The small JSON readers both request parsers share (coordinator/openai_protocol.cc,
// coordinator/anthropic_protocol.cc): how a value's type is named in an error, how a client's
// number is echoed, a field that is absent or null, and an integer that may arrive as 3.0.
// Each parser keeps its own error wording and paths; these only read.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

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

}  // namespace kvshard::json_fields
