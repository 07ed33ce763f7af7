// Shared by the sim tests: the real config.json files of tests/kv/configs, and a one-instance
// cluster to run the engine on.
#pragma once

#include <string>

#include "common/build_config.h"
#include "common/check.h"
#include "config/arch_config.h"
#include "sim/cluster/simulator.h"

namespace kvshard::sim {

inline ArchConfig Config(const std::string& name) {
    Result<ArchConfig> a =
        ReadArchConfig(std::string(KVSHARD_SOURCE_DIR) + "/tests/kv/configs/" + name);
    KV_CHECK(a.ok()) << a.status().ToString();
    return *a;
}

// Llama 3 8B on one H200, at most 4 sequences and `max_num_batched_tokens` tokens a step.
inline SimulationOptions OneH200Instance(int64_t max_num_batched_tokens) {
    SimulationOptions o;
    o.arch = Config("llama-3-8b.json");
    PoolConfig p;
    p.name = "mixed";
    p.instances.assign(1, InstanceConfig{1, {}});
    o.pools = {p};
    o.device = *FindAccelerator("h200");
    o.scheduler.max_num_seqs = 4;
    o.scheduler.max_num_batched_tokens = max_num_batched_tokens;
    o.scheduler.max_model_len = 8192;
    return o;
}

}  // namespace kvshard::sim
