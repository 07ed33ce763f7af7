// The pool layouts of `kvshard simulate`: --placement's text form and every placement of a GPU
// budget that --search ranks (docs/simulate.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/server_config.h"

namespace kvshard::cli {

// "mixed=2x4" or "prefill=1x4,decode=2x2": pools of COUNT instances of tp TP. InvalidArgument
// naming --placement and the item otherwise; either mixed pools only, or a prefill and a decode
// pool.
Result<std::vector<PoolConfig>> ParsePlacement(const std::string& text);
// The inverse: "mixed=2x4".
std::string PlacementText(const std::vector<PoolConfig>& pools);
// Every way to spend `gpus` GPUs on instances of tp in {1, 2, 4, ..., max_tp}: colocated (one
// mixed pool) and disaggregated (a prefill and a decode pool, each of one tp).
std::vector<std::vector<PoolConfig>> Placements(int64_t gpus, int max_tp);

}  // namespace kvshard::cli
