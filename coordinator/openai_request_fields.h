// The field readers of the OpenAI request parsers (openai_protocol.cc, openai_chat_request.cc,
// openai_sampling_request.cc): a check that fails throws ValidationError, which ReadBody turns
// into the 400 the client gets, so that each field's check stays one line. Internal to
// coordinator/: the public contract is openai_protocol.h.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "coordinator/openai_protocol.h"

namespace kvshard::openai_request {

// Thrown by the readers, caught by ReadBody only.
struct ValidationError {
    ApiError error;
};

// Throws ValidationError with a 400 naming `param`.
[[noreturn]] void Fail(std::string message, std::string param);

// body[name], absent or null: nullopt (nullptr). Present with the wrong type, or an integer
// outside [min, max] (`rule` says the range in the message): Fail naming the field.
std::optional<int64_t> OptInt(const nlohmann::json& body, const char* name, int64_t min,
                              int64_t max, std::string_view rule);
std::optional<double> OptNumber(const nlohmann::json& body, const char* name);
std::optional<bool> OptBool(const nlohmann::json& body, const char* name);
const nlohmann::json* OptString(const nlohmann::json& body, const char* name);

// The body checks every route shares (UTF-8, no NUL, JSON within the nesting bound, an object,
// a "model" this server serves), then `read` on the JSON object. The error a client gets when
// any of it fails, or a Fail inside `read`; nullopt when all passed. No exception escapes.
std::optional<ApiError> ReadBody(std::string_view body, const ServedModel& model,
                                 const std::function<void(const nlohmann::json&)>& read);

}  // namespace kvshard::openai_request
