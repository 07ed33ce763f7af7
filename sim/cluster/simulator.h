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
// between nodes) to the prefill step that sends them. With a CPU profile whose f (seconds per
// request arriving during a step) is positive, each arrival lengthens every step in flight by f:
// on the CPU engine the front end's work for a request shares the cores with the steps.
//
// Serving policies run as `kvshard serve` runs them (docs/simulate.md, "Serving policies"):
// - the waiting-queue cap (scheduler.max_waiting_requests): a request that arrives when its
//   instance already holds max_num_seqs + max_waiting_requests requests is refused by the
//   engine's own Submit (ResourceExhausted, the server's HTTP 429); it is counted as refused
//   and as failed, never served;
// - prompt-cache pins (kv_cache.max_pinned_fraction, min_pinned_tokens): with cache_ttl_ms > 0,
//   every request of a prefix group carries one cache breakpoint at the end of its group's
//   shared prefix (as a client marks a shared system prompt with cache_control), and the engine
//   pins, refreshes, lapses and refuses pins in the BlockManager on the virtual clock;
// - the request timeout (server.request_timeout_s): a request still running that long after it
//   arrived is aborted through the router, as the HTTP session does, and counts as failed (504).
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
    // With a profile: each decode-only step's time is the profile's times a draw from the decode
    // kind's spread (CpuProfile::kind_spread), from a generator seeded by Simulate's seed; steps
    // with a prefill chunk keep the profile's time (their kinds' few points, of many sizes, spread
    // as much by the fit's error over sizes, small prefills 1.2x, as by noise: drawn, they added
    // 9-14% to the long prompts' TTFT in replays of runs S-W). false: every step of one shape
    // costs the same.
    bool profile_spread = false;
    // Each instance's scheduler, as `kvshard serve`'s scheduler: section sets it. max_model_len
    // 0: the model's max_position (else 8192), capped by what one instance's blocks hold.
    // max_waiting_requests (the queue beyond max_num_seqs before HTTP 429) defaults to no cap
    // here, where `kvshard serve`'s default is 256: offline benchmarks queue everything.
    SchedulerConfig scheduler{.max_waiting_requests = int64_t{1} << 40};
    // Each instance's BlockManager (block_size, prefix caching, the pin limits of
    // docs/prompt-caching.md), as the kv_cache: section sets it. num_blocks 0: what the
    // device's memory holds at memory_utilization (CostModel::NumKvBlocks); group_windows is
    // the model's (Simulate sets it from its sliding-window layers).
    BlockManagerConfig blocks;
    double memory_utilization = 0.9;
    // The TTL of the breakpoint each request of a prefix group carries at the end of its shared
    // prefix (0: no request carries a breakpoint).
    int64_t cache_ttl_ms = 0;
    double request_timeout_s = 0;  // 0: none (`kvshard serve`'s default is 600)
    KvTransferConfig handoff;
    // The serving front end's latency per request, in seconds: what a client's TTFT holds beyond
    // the engine's (the HTTP request, tokenization and chat template, the hop to the engine, the
    // first token's detokenization and SSE write). It is added to the TTFT and E2E latency of every
    // request that produced a token, not to ITL, and moves no engine event: the engine sees each
    // request at its arrival. 0 (the default): not modelled. kvshard's CPU engine measures it
    // (scripts/validate-simulate); for GPU kinds it is whatever the caller gives.
    double frontend_s = 0;
    // Its part that grows with the prompt (tokenization and chat templating), in seconds per
    // prompt token: a request's front end is frontend_s + this x its prompt tokens. 0: constant.
    double frontend_per_prompt_token_s = 0;
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
    int64_t num_refused = 0;    // refused at arrival: the instance's queue was full (HTTP 429)
    int64_t num_timed_out = 0;  // aborted at request_timeout_s (HTTP 504)
    // Prompt-cache pins, summed over instances: requests that read a pinned prefix, pins that
    // lapsed at their TTL, pins refused (or lapsed early) for lack of room, and the most blocks
    // pinned at once (all instances).
    int64_t pin_hits = 0;
    int64_t pins_expired = 0;
    int64_t pins_refused = 0;
    int64_t pinned_blocks_max = 0;
    int64_t kv_blocks_per_instance = 0;
    int64_t gpus = 0;
    std::vector<PoolUsage> pools;
};

// REQUIRES valid pools (ValidatePools). Errors: the model does not fit the device at a pool's tp,
// tp does not divide the heads, a request cannot fit the context, a pin or queue setting out of
// range, a negative frontend_s or frontend_per_prompt_token_s (InvalidArgument naming it). A request the engine refuses is an
// outcome, not an error.
Result<SimulationResult> Simulate(const SimulationOptions& options,
                                  const std::vector<SimRequest>& requests, uint64_t seed = 0);

}  // namespace kvshard::sim
