// Shared by the sim tests: the real config.json files of tests/kv/configs.
#pragma once

#include <string>

#include "common/build_config.h"
#include "common/check.h"
#include "config/arch_config.h"

namespace kvshard::sim {

inline ArchConfig Config(const std::string& name) {
    Result<ArchConfig> a =
        ReadArchConfig(std::string(KVSHARD_SOURCE_DIR) + "/tests/kv/configs/" + name);
    KV_CHECK(a.ok()) << a.status().ToString();
    return *a;
}

}  // namespace kvshard::sim
