// The settings of an instance's engine, one type per concept: the config file's scheduler:,
// kv_cache: and kv_transfer: sections are these structs, and the engine, its scheduler and its
// block manager take them as they are (coordinator/engine.h InstanceEngineConfig,
// coordinator/scheduler.h, kv/block_manager.h). A new setting is a field here (and, when the file
// sets it, its key in config/server_config.cc); nothing copies them field by field.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "common/kv_dtype.h"
#include "common/status.h"

namespace kvshard {

// The scheduler: section (coordinator/scheduler.h).
struct SchedulerConfig {
    int64_t max_num_seqs = 64;             // running sequences at once (in one step at most)
    int64_t max_num_batched_tokens = 512;  // tokens computed per step (prefill chunks + decodes)
    // Requests an instance holds beyond max_num_seqs before Submit refuses more
    // (ResourceExhausted: HTTP 429).
    int64_t max_waiting_requests = 256;
    // The context length; 0: the model's. `kvshard serve` resolves it into
    // InstanceEngineConfig::max_context.
    int64_t max_model_len = 0;

    // max_num_seqs > 0, max_num_batched_tokens >= max_num_seqs (every running decode fits each
    // step) and max_waiting_requests >= 0; InvalidArgument naming the keys and values otherwise.
    Status Validate() const;
};

// The block manager's settings (kv/block_manager.h takes this type as kv::BlockManagerConfig).
struct BlockManagerConfig {
    int64_t num_blocks = 0;
    int64_t block_size = 16;  // token slots per block
    // Fraction of all blocks that admission of a new prompt leaves available, so running sequences
    // can grow for a while before anyone must be preempted. [0, 1).
    double watermark = 0.01;
    bool enable_prefix_caching = true;
    // Pins: the most of the pool that pinned blocks may cover, [0, 1] (0: no pins), and the
    // shortest prefix (in tokens) that is pinned.
    double max_pinned_fraction = 0.5;
    int64_t min_pinned_tokens = 1024;
    // KV cache groups: the attention window of each group in tokens (0: full attention), group 0
    // first. Empty: one full-attention group (a model without windows). At most kMaxKvCacheGroups.
    std::vector<int64_t> group_windows = {};

    // Names the bad field and its value.
    Status Validate() const;
};

// The kv_cache: section: the block manager's settings as the file gives them, and how the
// workers' pools are sized and stored. In the file num_blocks may be 0 (as many as memory_mib
// or gpu_memory_utilization holds) and group_windows is not a key (the model's layers say it);
// `kvshard serve` resolves both before the block manager sees them.
struct KvCacheConfig : BlockManagerConfig {
    int64_t memory_mib = 512;  // per worker, when num_blocks is 0 (CPU workers)
    // GPU workers: the fraction of the device's free memory (at start) the rank's weights,
    // buffers and KV pool may take; the KV pool is what is left after the weights and buffers.
    double gpu_memory_utilization = 0.9;
    // How K and V are stored; empty is "auto", the model's compute dtype (fp32 on the CPU
    // backend). Any KvDtype parses (the planner sizes them all); serve refuses one the backend's
    // pools cannot store, naming kv_cache.dtype.
    std::optional<KvDtype> dtype;
};

// How the KV of a handoff travels from the sending instance's pools to the receiving one's
// (docs/disaggregation.md "Transports", docs/cuda.md "Prefill and decode pools on GPUs"):
//   kHostStaged  packed into host memory, over the instances' KV transport (in-process or TCP),
//                unpacked into the receiving pool: every backend, every placement;
//   kPeerCopy    pool to pool inside one process (PeerCopy, kernels/backend.h:
//                cudaMemcpyPeerAsync between two GPUs), no host buffer;
//   kNccl        the KV pair path: one pair per (prefill rank, decode rank) exchanging heads
//                (worker/kv_handoff_pairs.h), ncclSend/ncclRecv between GPU worker processes
//                of one node on distinct GPUs (wired, never run on a GPU), or over TCP sockets
//                between CPU worker processes with the test knob KVSHARD_KV_PAIR_LINK=socket.
enum class KvHandoffPath { kHostStaged, kPeerCopy, kNccl };
std::string_view KvHandoffPathName(KvHandoffPath path);  // "host-staged", "peer", "nccl"
// The path a name (KvHandoffPathName's) names; InvalidArgument listing the names otherwise.
Result<KvHandoffPath> ParseKvHandoffPath(std::string_view name);

// The kv_transfer: section: KV handoff from prefill to decode instances
// (docs/disaggregation.md).
struct KvTransferConfig {
    // Send each layer's KV as soon as the prefill step wrote it (true: mode layerwise), or all
    // layers after the step (false, mode blockwise, the default: see docs/disaggregation.md for
    // the measurements).
    bool layerwise = false;
    int64_t timeout_ms = 10'000;  // per transfer, sending and receiving
    // kv_transfer.path; empty is "auto" (serve chooses: worker/kv_handoff_path.h).
    std::optional<KvHandoffPath> path;
};

// What an instance does (the pools: list's role): prefill and decode (mixed), or one of them.
enum class PoolRole { kMixed, kPrefill, kDecode };
std::string_view PoolRoleName(PoolRole role);  // "mixed", "prefill", "decode"

}  // namespace kvshard
