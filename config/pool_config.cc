#include "config/pool_config.h"

#include <algorithm>
#include <charconv>

namespace kvshard {
namespace {

std::string At(const std::string& source, const YAML::Node& node) {
    const YAML::Mark mark = node.Mark();
    return mark.line < 0 ? source : source + ":" + std::to_string(mark.line + 1);
}

Status Bad(const std::string& source, const YAML::Node& node, const std::string& key,
           const std::string& why) {
    return InvalidArgument(At(source, node) + ": " + key + ": " + why);
}

Result<int64_t> Integer(const std::string& source, const YAML::Node& node, const std::string& key) {
    if (!node.IsScalar()) return Bad(source, node, key, "expected a number");
    const std::string& text = node.Scalar();
    int64_t v = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size()) {
        return Bad(source, node, key, "invalid value '" + text + "': expected an integer");
    }
    return v;
}

Status ParseInstance(const std::string& source, const YAML::Node& node, const std::string& key,
                     InstanceConfig* out) {
    if (!node.IsMap()) return Bad(source, node, key, "expected a map with tp and devices");
    for (const auto& item : node) {
        const std::string k = item.first.Scalar();
        if (k == "tp") {
            KV_ASSIGN_OR_RETURN(int64_t tp, Integer(source, item.second, key + ".tp"));
            if (tp < 1 || tp > 64)
                return Bad(source, item.second, key + ".tp",
                           "invalid value '" + item.second.Scalar() + "': must be 1..64");
            out->tp = static_cast<int>(tp);
        } else if (k == "devices") {
            if (!item.second.IsSequence())
                return Bad(source, item.second, key + ".devices", "expected a list");
            for (const YAML::Node& d : item.second) {
                const std::string text = d.IsScalar() ? d.Scalar() : "";
                int64_t ordinal = 0;
                auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), ordinal);
                const bool number = !text.empty() && ec == std::errc() &&
                                    end == text.data() + text.size() && ordinal >= 0;
                if (text != "cpu" && !number) {
                    return Bad(source, d, key + ".devices",
                               "invalid value '" + text + "': expected cpu or a GPU ordinal");
                }
                out->devices.push_back(text);
            }
        } else {
            return Bad(source, item.first, key + "." + k, "unknown key (known: tp, devices)");
        }
    }
    if (!out->devices.empty() && static_cast<int>(out->devices.size()) != out->tp) {
        return Bad(source, node, key + ".devices",
                   std::to_string(out->devices.size()) + " devices for tp " +
                       std::to_string(out->tp) + " (one per worker)");
    }
    return Status::Ok();
}

}  // namespace

Status ParsePools(const std::string& source, const YAML::Node& node,
                  std::vector<PoolConfig>* pools) {
    if (!node.IsSequence()) return Bad(source, node, "pools", "expected a list of pools");
    pools->clear();
    for (size_t i = 0; i < node.size(); ++i) {
        const YAML::Node p = node[i];
        const std::string key = "pools[" + std::to_string(i) + "]";
        if (!p.IsMap()) return Bad(source, p, key, "expected a map with name, role and instances");
        PoolConfig pool;
        bool has_instances = false;
        for (const auto& item : p) {
            const std::string k = item.first.Scalar();
            if (k == "name") {
                if (!item.second.IsScalar() || item.second.Scalar().empty())
                    return Bad(source, item.second, key + ".name", "must be a non-empty name");
                pool.name = item.second.Scalar();
            } else if (k == "role") {
                const std::string role = item.second.IsScalar() ? item.second.Scalar() : "";
                if (role == "mixed")
                    pool.role = PoolRole::kMixed;
                else if (role == "prefill")
                    pool.role = PoolRole::kPrefill;
                else if (role == "decode")
                    pool.role = PoolRole::kDecode;
                else
                    return Bad(source, item.second, key + ".role",
                               "invalid value '" + role + "': expected mixed, prefill or decode");
            } else if (k == "instances") {
                if (!item.second.IsSequence() || item.second.size() == 0) {
                    return Bad(source, item.second, key + ".instances",
                               "expected a non-empty list of instances");
                }
                has_instances = true;
                for (size_t j = 0; j < item.second.size(); ++j) {
                    InstanceConfig inst;
                    KV_RETURN_IF_ERROR(ParseInstance(source, item.second[j],
                                                     key + ".instances[" + std::to_string(j) + "]",
                                                     &inst));
                    pool.instances.push_back(std::move(inst));
                }
            } else {
                return Bad(source, item.first, key + "." + k,
                           "unknown key (known: name, role, instances)");
            }
        }
        if (pool.name.empty()) return Bad(source, p, key + ".name", "required");
        if (!has_instances)
            return Bad(source, p, key + ".instances", "required (at least one instance)");
        pools->push_back(std::move(pool));
    }
    return Status::Ok();
}

Status ValidatePools(const std::string& where, const std::vector<PoolConfig>& pools) {
    if (pools.empty()) return Status::Ok();
    int mixed = 0, prefill = 0, decode = 0;
    for (size_t i = 0; i < pools.size(); ++i) {
        for (size_t j = 0; j < i; ++j) {
            if (pools[i].name == pools[j].name)
                return InvalidArgument(where + ": pools: two pools are named '" + pools[i].name +
                                       "'");
        }
        switch (pools[i].role) {
            case PoolRole::kMixed:
                mixed++;
                break;
            case PoolRole::kPrefill:
                prefill++;
                break;
            case PoolRole::kDecode:
                decode++;
                break;
        }
    }
    if (mixed > 0 && prefill + decode > 0) {
        return InvalidArgument(where +
                               ": pools: mixed pools cannot be combined with prefill/decode pools");
    }
    if ((prefill > 0) != (decode > 0)) {
        return InvalidArgument(where + ": pools: a " +
                               std::string(prefill > 0 ? "prefill" : "decode") + " pool needs a " +
                               (prefill > 0 ? "decode" : "prefill") + " pool to hand KV to");
    }
    return Status::Ok();
}

}  // namespace kvshard
