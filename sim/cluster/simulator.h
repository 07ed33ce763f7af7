// Simulator: `kvshard simulate`'s event loop. It runs the coordinator's own InstanceEngines
// (scheduler, BlockManager, prefix cache, handoff protocol) and Router — the code `kvshard serve`
// runs — on a VirtualClock, each instance's StepExecutor replaced by a modelled one: a step's plan
// is "run" by the CostModel, which says how long it takes on the instance's GPUs, and the sampled
// tokens are made up (requests ignore EOS, so the lengths are the workload's).
//
// Discrete events, in time order: a request arrives (Router::Submit), or an instance's step ends
// (InstanceEngine::CompleteStep at start + modelled cost). After each event every idle instance
// with work plans its next step (InstanceEngine::PlanStep) at that time. KV handoffs add their
// transfer time over the link between the two instances (NVLink within a node, the network
// between nodes) to the prefill step that sends them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/arch_config.h"
#include "config/server_config.h"
#include "coordinator/engine.h"
#include "kv/kv_geometry.h"
#include "kv/weight_footprint.h"
#include "loadgen/bench_runner.h"
#include "sim/accelerator.h"
#include "sim/cost_model.h"
#include "sim/workload.h"

namespace kvshard::sim {

struct SimulationOptions {
    ArchConfig arch;
    kv::WeightDtype weight_dtype = kv::WeightDtype::kBf16;
    KvDtype kv_dtype = KvDtype::kBf16;
    std::vector<PoolConfig> pools;  // as in the serve config (roles, instances, tp)
    Accelerator device;             // every instance's GPUs
    std::optional<CpuProfile> profile;  // measured step costs instead of the roofline (cpu)
    SchedulerConfig scheduler;
    int64_t block_size = 16;
    double memory_utilization = 0.9;
    int64_t num_kv_blocks = 0;  // per instance; 0: what the device's memory holds (CostModel)
    bool enable_prefix_caching = true;
    int64_t max_context = 0;  // 0: the model's max_position (else 8192)
    int64_t max_waiting_requests = 1 << 20;  // the simulator queues everything by default
    KvHandoffConfig handoff;
};

struct PoolUsage {
    std::string pool;
    std::string role;
    int64_t instances = 0;
    int64_t gpus = 0;
    int64_t steps = 0;
    double busy_fraction = 0;  // time its instances ran steps / (instances x duration)
};

struct SimulationResult {
    loadgen::BenchRun run;  // per request, as `kvshard bench` measures a server
    double simulated_seconds = 0;
    double wall_seconds = 0;
    int64_t num_steps = 0;
    int64_t num_preemptions = 0;
    int64_t num_handoffs = 0;
    int64_t handoff_bytes = 0;
    double kv_usage_mean = 0;  // time-weighted, over instances
    double kv_usage_max = 0;
    int64_t max_queued = 0;  // most requests waiting at once, all instances
    int64_t kv_blocks_per_instance = 0;
    int64_t gpus = 0;
    std::vector<PoolUsage> pools;
};

// REQUIRES valid pools (ValidatePools). Errors: the model does not fit the device at a pool's tp,
// tp does not divide the heads, a request cannot fit the context.
Result<SimulationResult> Simulate(const SimulationOptions& options,
                                  const std::vector<SimRequest>& requests, uint64_t seed = 0);

}  // namespace kvshard::sim
