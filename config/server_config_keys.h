// The keys of the config file (internal to config/): each dotted key ("scheduler.max_num_seqs")
// with how a YAML value sets its field of ServerConfig — its parser, its range and the message
// naming the key and value when it is wrong. server_config.cc reads the file and the flag
// overrides through this table; docs/config.md lists the same keys.
#pragma once

#include <yaml-cpp/yaml.h>

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "config/server_config.h"

namespace kvshard::config_keys {

// Where a value came from, for messages: "serve.yaml:7" or "flag --port".
struct ValueSource {
    std::string where;
    std::string key;
};

// One setting: its dotted key and how a YAML node sets it in the config.
struct Setting {
    std::string_view key;
    std::function<Status(const ValueSource&, const YAML::Node&, ServerConfig&)> apply;
};

// Every key, in documentation order.
const std::vector<Setting>& Settings();
// The key's setting, or null when there is no such key.
const Setting* FindSetting(std::string_view key);

}  // namespace kvshard::config_keys
