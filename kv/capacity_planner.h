// The capacity planner: from a model's config.json shape (ArchConfig) and a cluster (GPUs, memory,
// tensor parallelism, dtypes), how much KV cache each GPU holds and how many tokens and sequences
// fit. `kvshard plan` prints it; docs/kv.md derives every formula and the figures the tests check.
//
//   KV bytes per token (whole model)   MHA/GQA: sum over layers 2 x kv_heads x (head_dim x dtype
//                                      + scale); MLA: sum over layers (kv_lora_rank +
//                                      qk_rope_head_dim) x dtype + scale
//   ... per GPU                        MHA/GQA: with kv_heads / tp heads, or 1 replicated head when
//                                      tp > kv_heads; MLA: the whole latent (replicated)
//   KV budget per GPU                  floor(gpu_memory x utilization) - weight bytes per GPU -
//                                      overhead reserve
//   blocks per GPU                     floor(budget / (KV bytes per token per GPU x block_size))
//   tokens                             blocks x block_size, per instance of tp GPUs
//   concurrent sequences               floor(blocks / ceil(context / block_size)) per instance
// The token and sequence figures count every layer as global, as kvshard's paged pool stores every
// layer of a token in one block. The "real" figures count a sliding-window layer as holding
// min(window, context) tokens: what a window-aware cache could hold at that context.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/arch_config.h"
#include "kv/kv_geometry.h"
#include "kv/weight_footprint.h"

namespace kvshard::kv {

inline constexpr int64_t kGiB = int64_t{1} << 30;

struct PlannerInput {
    int64_t tp = 1;
    int64_t num_gpus = 0;  // all GPUs, a multiple of tp; 0: tp (one instance)
    KvDtype kv_dtype = KvDtype::kBf16;
    WeightDtype weight_dtype = WeightDtype::kBf16;
    int64_t gpu_memory_bytes = 80 * kGiB;
    double memory_utilization = 0.9;  // (0, 1]: the share of each GPU's memory kvshard may use
    // Activations, workspaces, communication buffers, allocator slack: kept out of the KV budget
    // on top of what utilization < 1 leaves.
    int64_t overhead_bytes_per_gpu = 1 * kGiB;
    int64_t context_tokens = 0;  // 0: the config's max_position_embeddings
    int64_t block_size = 16;
};

struct CapacityPlan {
    PlannerInput input;  // with num_gpus and context_tokens resolved
    std::string config_path;
    std::string model_type;
    AttentionKind attention = AttentionKind::kMultiHead;
    int64_t num_layers = 0;
    int64_t num_sliding_layers = 0;
    int64_t sliding_window = 0;
    int64_t num_instances = 0;

    // KV
    int64_t kv_bytes_per_token = 0;   // whole model, every layer global
    int64_t kv_heads_per_gpu = 0;     // MLA: 1 (the latent)
    int64_t kv_head_replication = 1;  // GPUs holding each KV head (MLA latent: tp)
    int64_t kv_bytes_per_token_per_gpu = 0;
    int64_t kv_bytes_per_block_per_gpu = 0;
    int64_t kv_bytes_per_sequence = 0;       // whole model at context_tokens, every layer global
    int64_t kv_bytes_per_sequence_real = 0;  // sliding layers hold min(window, context)
    int64_t kv_bytes_per_sequence_real_per_gpu = 0;
    double kv_bytes_per_token_real = 0;  // kv_bytes_per_sequence_real / context_tokens

    // Weights
    WeightFootprint weights;

    // Budget and capacity
    int64_t usable_bytes_per_gpu = 0;     // floor(gpu_memory_bytes x memory_utilization)
    int64_t kv_budget_bytes_per_gpu = 0;  // >= 0; 0 when the weights do not fit
    int64_t kv_budget_bytes_total = 0;    // x num_gpus
    bool weights_fit = true;
    int64_t kv_blocks_per_gpu = 0;
    int64_t kv_tokens_per_instance = 0;
    int64_t kv_tokens_capacity = 0;  // over all instances
    int64_t blocks_per_sequence = 0;
    int64_t max_sequences_per_instance = 0;
    int64_t max_concurrent_sequences = 0;       // over all instances, whole blocks
    double sequences_per_instance_exact = 0;    // budget / per-sequence bytes, unrounded
    int64_t max_concurrent_sequences_real = 0;  // over all instances, sliding windows honoured
    std::vector<std::string> notes;
};

// InvalidArgument naming the value for bad inputs (tp, GPUs not a multiple of tp, utilization,
// context, block size) and for head counts tp cannot split; errors about the model start with the
// config's path.
Result<CapacityPlan> PlanCapacity(const ArchConfig& arch, const PlannerInput& input);

}  // namespace kvshard::kv
