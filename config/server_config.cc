#include "config/server_config.h"

#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>

#include "config/pool_config.h"
#include "config/server_config_keys.h"

namespace kvshard {

std::string_view ServeBackendName(ServeBackend backend) {
    switch (backend) {
        case ServeBackend::kCpu:
            return "cpu";
        case ServeBackend::kCuda:
            return "cuda";
        case ServeBackend::kAuto:
            return "auto";
    }
    return "cpu";
}

std::string_view WorkersModeName(WorkersMode mode) {
    switch (mode) {
        case WorkersMode::kEmbedded:
            return "embedded";
        case WorkersMode::kProcesses:
            return "processes";
    }
    return "embedded";
}

std::string_view WorkersLauncherName(WorkersLauncher launcher) {
    switch (launcher) {
        case WorkersLauncher::kDirect:
            return "direct";
        case WorkersLauncher::kMpirun:
            return "mpirun";
        case WorkersLauncher::kExternal:
            return "external";
    }
    return "direct";
}

std::vector<PoolConfig> ServerConfig::EffectivePools() const {
    if (!pools.empty()) return pools;
    return {PoolConfig{.name = "default",
                       .role = PoolRole::kMixed,
                       .instances = {InstanceConfig{.tp = tp, .devices = {}}}}};
}

namespace {

using config_keys::FindSetting;
using config_keys::Setting;
using config_keys::Settings;
using config_keys::ValueSource;

bool IsSection(std::string_view name) {
    return name == "server" || name == "scheduler" || name == "kv_cache" || name == "workers" ||
           name == "kv_transfer";
}

std::string Where(const std::string& source, const YAML::Node& node) {
    const YAML::Mark mark = node.Mark();
    if (mark.line < 0) return source;
    return source + ":" + std::to_string(mark.line + 1);
}

Status UnknownKey(const std::string& where, const std::string& key) {
    std::string known;
    for (const Setting& s : Settings()) {
        if (!known.empty()) known += ", ";
        known += s.key;
    }
    return InvalidArgument(where + ": unknown key '" + key + "' (known keys: " + known + ")");
}

// Applies every key of `map` (the top level or one section) to `config`.
Status ApplyMap(const std::string& source, const YAML::Node& map, const std::string& prefix,
                ServerConfig& config) {
    for (const auto& item : map) {
        if (!item.first.IsScalar()) {
            return InvalidArgument(Where(source, item.first) + ": keys must be plain names");
        }
        const std::string key = prefix + item.first.Scalar();
        if (prefix.empty() && key == "pools") {
            KV_RETURN_IF_ERROR(ParsePools(source, item.second, &config.pools));
            continue;
        }
        if (prefix.empty() && IsSection(key)) {
            if (item.second.IsNull()) continue;
            if (!item.second.IsMap()) {
                return InvalidArgument(Where(source, item.second) + ": " + key +
                                       ": expected a map of settings");
            }
            KV_RETURN_IF_ERROR(ApplyMap(source, item.second, key + ".", config));
            continue;
        }
        const Setting* setting = FindSetting(key);
        if (setting == nullptr) return UnknownKey(Where(source, item.first), key);
        if (item.second.IsNull()) continue;  // "key:" with no value keeps the default
        KV_RETURN_IF_ERROR(setting->apply({Where(source, item.second), key}, item.second, config));
    }
    return Status::Ok();
}

Status ApplyOverride(const ConfigOverride& o, ServerConfig& config) {
    const ValueSource at{o.origin.empty() ? "override" : "flag " + o.origin, o.key};
    const Setting* setting = FindSetting(o.key);
    if (setting == nullptr) return UnknownKey(at.where, o.key);
    YAML::Node node;
    if (o.key == "server.api_keys" || o.key == "server.cors_allowed_origins" ||
        o.key == "served_model_name") {
        node = YAML::Node(YAML::NodeType::Sequence);
        std::stringstream in(o.value);
        std::string item;
        while (std::getline(in, item, ',')) node.push_back(item);
    } else {
        node = YAML::Node(o.value);
    }
    return setting->apply(at, node, config);
}

Status ValidateWhole(const ServerConfig& c) {
    const std::string where = c.source.empty() ? "config" : c.source;
    if (c.model_path.empty()) {
        return InvalidArgument(where + ": model: required (set it in the file or with --model)");
    }
    if (Status st = c.scheduler.Validate(); !st.ok()) {
        return InvalidArgument(where + ": " + st.message());
    }
    if (c.workers.dead_after_ms < c.workers.heartbeat_interval_ms) {
        return InvalidArgument(where + ": workers.dead_after_ms (" +
                               std::to_string(c.workers.dead_after_ms) +
                               ") must be >= workers.heartbeat_interval_ms (" +
                               std::to_string(c.workers.heartbeat_interval_ms) +
                               "): a live worker is heard from once per interval");
    }
    KV_RETURN_IF_ERROR(ValidatePools(where, c.pools));
    if (c.workers.mode == WorkersMode::kProcesses &&
        c.workers.launcher == WorkersLauncher::kExternal && c.workers.port == 0) {
        return InvalidArgument(where +
                               ": workers.port: invalid value '0': workers started by "
                               "hand (workers.launcher: external) need a fixed port to connect to");
    }
    if (c.workers.mode == WorkersMode::kProcesses &&
        c.workers.launcher == WorkersLauncher::kExternal && c.workers.token.empty()) {
        return InvalidArgument(
            where +
            ": workers.token: required with workers.launcher: external (the secret workers "
            "started by hand present when they register; give them the same value in "
            "KVSHARD_WORKER_TOKEN)");
    }
    return Status::Ok();
}

}  // namespace

Result<ServerConfig> ParseServerConfig(std::string_view yaml_text, const std::string& source,
                                       const std::vector<ConfigOverride>& overrides) {
    ServerConfig config;
    config.source = source;
    const std::string name = source.empty() ? "config" : source;
    YAML::Node root;
    try {
        root = YAML::Load(std::string(yaml_text));
    } catch (const YAML::Exception& e) {
        return InvalidArgument(name + ":" + std::to_string(e.mark.line + 1) +
                               ": not valid YAML: " + e.msg);
    }
    if (root.IsDefined() && !root.IsNull()) {
        if (!root.IsMap()) return InvalidArgument(name + ": expected a map of settings at the top");
        KV_RETURN_IF_ERROR(ApplyMap(name, root, "", config));
    }
    for (const ConfigOverride& o : overrides) KV_RETURN_IF_ERROR(ApplyOverride(o, config));
    KV_RETURN_IF_ERROR(ValidateWhole(config));
    return config;
}

std::vector<std::string_view> ServerConfigKeys() {
    std::vector<std::string_view> keys;
    for (const Setting& s : Settings()) keys.push_back(s.key);
    return keys;
}

Result<ServerConfig> LoadServerConfig(const std::string& path,
                                      const std::vector<ConfigOverride>& overrides) {
    if (path.empty()) return ParseServerConfig("", "", overrides);
    std::ifstream in(path, std::ios::binary);
    if (!in) return NotFound(path + ": cannot open the config file");
    std::stringstream text;
    text << in.rdbuf();
    return ParseServerConfig(text.str(), path, overrides);
}

}  // namespace kvshard
