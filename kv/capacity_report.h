// The two renderings of a CapacityPlan that `kvshard plan` prints: a table for people and one JSON
// object for scripts. Formatting only: no I/O.
#pragma once

#include <string>

#include "kv/capacity_planner.h"

namespace kvshard::kv {

// One JSON object on one line (no trailing newline). Byte and token figures are integers; it has at
// least kv_bytes_per_token, kv_bytes_per_token_per_gpu, weight_bytes_per_gpu, kv_tokens_capacity
// and max_concurrent_sequences.
std::string CapacityPlanJson(const CapacityPlan& plan);

// A human-readable table, one figure per line, ending with a newline.
std::string CapacityPlanTable(const CapacityPlan& plan);

}  // namespace kvshard::kv
