#include "coordinator/json_fields.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kvshard::json_fields {

using nlohmann::json;

std::string TypeName(const json& v) {
    switch (v.type()) {
        case json::value_t::null:
            return "null";
        case json::value_t::boolean:
            return "a boolean";
        case json::value_t::number_integer:
        case json::value_t::number_unsigned:
            return "an integer";
        case json::value_t::number_float:
            return "a number";
        case json::value_t::string:
            return "a string";
        case json::value_t::array:
            return "an array";
        case json::value_t::object:
            return "an object";
        case json::value_t::binary:
        case json::value_t::discarded:
            return "an unknown value";
    }
    return "an unknown value";
}

std::string Number(double x) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", x);
    return text;
}

const json* Field(const json& object, const char* name) {
    auto it = object.find(name);
    if (it == object.end() || it->is_null()) return nullptr;
    return &*it;
}

std::optional<int64_t> Integer(const json& v) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}) return INT64_MAX;
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
        const double d = v.get<double>();
        if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9e18) {
            return static_cast<int64_t>(d);
        }
    }
    return std::nullopt;
}

int JsonNestingDepth(std::string_view text, int limit) {
    int depth = 0, deepest = 0;
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\') {
                ++i;  // the escaped character, whatever it is
            } else if (c == '"') {
                in_string = false;
            }
            continue;
        }
        if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            deepest = std::max(deepest, ++depth);
            if (deepest > limit) return deepest;
        } else if ((c == ']' || c == '}') && depth > 0) {
            --depth;
        }
    }
    return deepest;
}

json ParseJson(std::string_view text, bool* too_deep) {
    const bool deep = JsonNestingDepth(text) > kMaxJsonDepth;
    if (too_deep != nullptr) *too_deep = deep;
    if (deep) return json(json::value_t::discarded);
    return json::parse(text, nullptr, /*allow_exceptions=*/false);
}

}  // namespace kvshard::json_fields
