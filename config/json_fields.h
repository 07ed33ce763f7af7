// Private to config/: typed access to the fields of one JSON object, shared by the
// config.json readers (arch_config.cc, hf_config.cc).
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard::config_internal {

// Typed access to one JSON object; errors read "<path>: field '<prefix><name>': <problem>".
// Holds references to `object` and `path`: both must outlive it.
class Fields {
  public:
    using json = nlohmann::json;

    Fields(const json& object, const std::string& path, std::string prefix = "")
        : object_(object), path_(path), prefix_(std::move(prefix)) {}

    Status Error(std::string_view name, const std::string& problem) const {
        return InvalidArgument(path_ + ": field '" + prefix_ + std::string(name) + "': " + problem);
    }

    // nullptr when absent or null (transformers writes null for "not set").
    const json* Find(std::string_view name) const {
        auto it = object_.find(name);
        return it == object_.end() || it->is_null() ? nullptr : &*it;
    }

    Result<int64_t> Int(std::string_view name, std::optional<int64_t> default_value) const {
        const json* j = Find(name);
        if (j == nullptr) {
            if (default_value) return *default_value;
            return Error(name, "missing");
        }
        if (!j->is_number_integer()) return Error(name, "must be an integer, got " + j->dump());
        if (j->is_number_unsigned() &&
            j->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            return Error(name, "value " + j->dump() + " is too large");
        }
        return j->get<int64_t>();
    }

    // Any integer > 0.
    Result<int64_t> PositiveInt(std::string_view name,
                                std::optional<int64_t> default_value = std::nullopt) const {
        KV_ASSIGN_OR_RETURN(int64_t v, Int(name, default_value));
        if (v <= 0) return Error(name, "must be positive, got " + std::to_string(v));
        return v;
    }

    // Positive, and small enough that products of a few of them cannot overflow int64.
    Result<int64_t> Positive(std::string_view name,
                             std::optional<int64_t> default_value = std::nullopt) const {
        KV_ASSIGN_OR_RETURN(int64_t v, PositiveInt(name, default_value));
        if (v > (int64_t{1} << 31)) {
            return Error(name, "value " + std::to_string(v) + " is implausibly large");
        }
        return v;
    }

    // Like Positive, but 0 when absent or null.
    Result<int64_t> OptionalPositive(std::string_view name) const {
        if (Find(name) == nullptr) return int64_t{0};
        return Positive(name);
    }

    Result<int64_t> NonNegative(std::string_view name, int64_t default_value) const {
        KV_ASSIGN_OR_RETURN(int64_t v, Int(name, default_value));
        if (v < 0) return Error(name, "must be >= 0, got " + std::to_string(v));
        return v;
    }

    Result<double> Number(std::string_view name, std::optional<double> default_value) const {
        const json* j = Find(name);
        if (j == nullptr) {
            if (default_value) return *default_value;
            return Error(name, "missing");
        }
        if (!j->is_number()) return Error(name, "must be a number, got " + j->dump());
        return j->get<double>();
    }

    // > 0 and finite as a float.
    Result<double> PositiveNumber(std::string_view name,
                                  std::optional<double> default_value = std::nullopt) const {
        KV_ASSIGN_OR_RETURN(double v, Number(name, default_value));
        if (!(v > 0) || v > std::numeric_limits<float>::max()) {
            return Error(name, "must be a positive number, got " + json(v).dump());
        }
        return v;
    }

    Result<bool> Bool(std::string_view name, bool default_value) const {
        const json* j = Find(name);
        if (j == nullptr) return default_value;
        if (!j->is_boolean()) return Error(name, "must be true or false, got " + j->dump());
        return j->get<bool>();
    }

    Result<std::string> String(std::string_view name,
                               std::optional<std::string> default_value) const {
        const json* j = Find(name);
        if (j == nullptr) {
            if (default_value) return *default_value;
            return Error(name, "missing");
        }
        if (!j->is_string()) return Error(name, "must be a string, got " + j->dump());
        return j->get<std::string>();
    }

    // Empty when absent or null.
    Result<std::vector<int64_t>> IntList(std::string_view name) const {
        std::vector<int64_t> out;
        const json* j = Find(name);
        if (j == nullptr) return out;
        if (!j->is_array()) return Error(name, "must be a list of integers, got " + j->dump());
        for (const json& v : *j) {
            if (!v.is_number_integer())
                return Error(name, "must be a list of integers, got " + j->dump());
            out.push_back(v.get<int64_t>());
        }
        return out;
    }

    // A token id: an integer, a list of integers (the first is taken), or null/absent (-1).
    Result<int32_t> TokenId(std::string_view name) const {
        const json* j = Find(name);
        if (j == nullptr) return -1;
        const json* id = j;
        if (j->is_array()) {
            if (j->empty()) return -1;
            id = &(*j)[0];
        }
        if (!id->is_number_integer() || id->get<int64_t>() < 0 ||
            id->get<int64_t>() > std::numeric_limits<int32_t>::max()) {
            return Error(name, "must be a token id or a list of token ids, got " + j->dump());
        }
        return static_cast<int32_t>(id->get<int64_t>());
    }

  private:
    const json& object_;
    const std::string& path_;
    std::string prefix_;
};

}  // namespace kvshard::config_internal
