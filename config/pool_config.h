// The pools: list of the serve config (config/server_config.h): parsing and whole-list checks.
// Internal to config/.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "common/status.h"
#include "config/server_config.h"

namespace kvshard {

// Parses a YAML list of pools:
//   - name: prefill          (required, unique)
//     role: prefill          (mixed | prefill | decode; default mixed)
//     instances:             (required, at least one)
//       - tp: 2              (default 1)
//         devices: [0, 1]    (optional: one per worker, "cpu" or a GPU ordinal)
// Errors name the file, line, key and value.
Status ParsePools(const std::string& source, const YAML::Node& node,
                  std::vector<PoolConfig>* pools);

// Roles that make a cluster: only mixed pools, or at least one prefill and one decode pool and no
// mixed one. Unique names.
Status ValidatePools(const std::string& where, const std::vector<PoolConfig>& pools);

}  // namespace kvshard
