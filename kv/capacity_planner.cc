#include "kv/capacity_planner.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace kvshard::kv {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
std::string Str(int64_t v) { return std::to_string(v); }

Status ValidateInput(const PlannerInput& in, const ArchConfig& arch) {
    if (in.tp <= 0) return InvalidArgument("tp must be positive, got " + Str(in.tp));
    if (in.num_gpus < 0 || in.num_gpus % in.tp != 0) {
        return InvalidArgument("the number of GPUs (" + Str(in.num_gpus) +
                               ") must be a positive multiple of tp (" + Str(in.tp) + ")");
    }
    if (in.gpu_memory_bytes <= 0) {
        return InvalidArgument("GPU memory must be positive, got " + Str(in.gpu_memory_bytes) +
                               " bytes");
    }
    if (!(in.memory_utilization > 0 && in.memory_utilization <= 1)) {
        return InvalidArgument("memory utilization must be in (0, 1], got " +
                               std::to_string(in.memory_utilization));
    }
    if (in.overhead_bytes_per_gpu < 0) {
        return InvalidArgument("the overhead reserve must be >= 0, got " +
                               Str(in.overhead_bytes_per_gpu) + " bytes");
    }
    if (in.block_size <= 0 || in.block_size > (int64_t{1} << 20)) {
        return InvalidArgument("block size must be in [1, 2^20], got " + Str(in.block_size));
    }
    if (in.context_tokens < 0 || in.context_tokens > (int64_t{1} << 31)) {
        return InvalidArgument("context must be in [1, 2^31] tokens, got " +
                               Str(in.context_tokens));
    }
    if (in.context_tokens == 0 && arch.max_position <= 0) {
        return InvalidArgument(arch.path +
                               ": no max_position_embeddings to take the context from; give one");
    }
    return Status::Ok();
}

// KV bytes of one token in one layer: for the whole model, and for one GPU of a tp group.
struct LayerKv {
    int64_t whole = 0;
    int64_t per_gpu = 0;
    int64_t heads_per_gpu = 0;
    int64_t replication = 1;
};

Result<LayerKv> KvPerTokenPerLayer(const ArchConfig& a, const PlannerInput& in) {
    LayerKv kv;
    if (a.attention == AttentionKind::kMultiLatent) {
        // One latent (kv_lora_rank) and one RoPE key (qk_rope_head_dim) per token, shared by all
        // heads: every rank needs all of it.
        kv.whole = KvRowBytes(in.kv_dtype, a.mla.kv_lora_rank + a.mla.qk_rope_head_dim);
        kv.per_gpu = kv.whole;
        kv.heads_per_gpu = 1;
        kv.replication = in.tp;
        return kv;
    }
    Result<int64_t> local = LocalKvHeads(a.num_heads, a.num_kv_heads, in.tp);
    if (!local.ok()) return local.status().WithContext(a.path);
    // The worker's pool is sized by the same KvGeometry (worker/kv_pool.cc).
    KvGeometry layer{.num_layers = 1,
                     .num_kv_heads = a.num_kv_heads,
                     .head_dim = a.head_dim,
                     .dtype = in.kv_dtype,
                     .block_size = in.block_size};
    kv.whole = layer.BytesPerTokenPerLayer();
    layer.num_kv_heads = *local;
    kv.heads_per_gpu = *local;
    kv.per_gpu = layer.BytesPerTokenPerLayer();
    kv.replication = in.tp > a.num_kv_heads ? in.tp / a.num_kv_heads : 1;
    return kv;
}

}  // namespace

Result<CapacityPlan> PlanCapacity(const ArchConfig& arch, const PlannerInput& input) {
    PlannerInput in = input;
    if (in.num_gpus == 0) in.num_gpus = in.tp;
    KV_RETURN_IF_ERROR(ValidateInput(in, arch));
    if (in.context_tokens == 0) in.context_tokens = arch.max_position;

    CapacityPlan p;
    p.config_path = arch.path;
    p.model_type = arch.model_type;
    p.attention = arch.attention;
    p.num_layers = arch.num_layers;
    p.num_sliding_layers = arch.NumSlidingLayers();
    p.sliding_window = arch.sliding_window;
    p.num_instances = in.num_gpus / in.tp;
    p.notes = arch.notes;
    const int64_t ctx = in.context_tokens;

    KV_ASSIGN_OR_RETURN(LayerKv layer, KvPerTokenPerLayer(arch, in));
    p.kv_bytes_per_token = arch.num_layers * layer.whole;
    p.kv_heads_per_gpu = layer.heads_per_gpu;
    p.kv_head_replication = layer.replication;
    p.kv_bytes_per_token_per_gpu = arch.num_layers * layer.per_gpu;
    p.kv_bytes_per_block_per_gpu = p.kv_bytes_per_token_per_gpu * in.block_size;
    p.kv_bytes_per_sequence = p.kv_bytes_per_token * ctx;
    int64_t held_tokens = 0;  // sum over layers of the tokens each layer keeps at this context
    for (LayerAttention t : arch.layer_attention) {
        held_tokens += t == LayerAttention::kSliding ? std::min(arch.sliding_window, ctx) : ctx;
    }
    p.kv_bytes_per_sequence_real = held_tokens * layer.whole;
    p.kv_bytes_per_sequence_real_per_gpu = held_tokens * layer.per_gpu;
    p.kv_bytes_per_token_real =
        static_cast<double>(p.kv_bytes_per_sequence_real) / static_cast<double>(ctx);

    KV_ASSIGN_OR_RETURN(p.weights, ComputeWeightFootprint(arch, in.tp, in.weight_dtype));

    p.usable_bytes_per_gpu = static_cast<int64_t>(
        std::floor(static_cast<double>(in.gpu_memory_bytes) * in.memory_utilization));
    const int64_t budget =
        p.usable_bytes_per_gpu - p.weights.bytes_per_gpu - in.overhead_bytes_per_gpu;
    p.weights_fit = budget > 0;
    p.kv_budget_bytes_per_gpu = std::max<int64_t>(budget, 0);
    p.kv_budget_bytes_total = p.kv_budget_bytes_per_gpu * in.num_gpus;
    p.kv_blocks_per_gpu = p.kv_budget_bytes_per_gpu / p.kv_bytes_per_block_per_gpu;
    p.kv_tokens_per_instance = p.kv_blocks_per_gpu * in.block_size;
    p.kv_tokens_capacity = p.kv_tokens_per_instance * p.num_instances;
    p.blocks_per_sequence = CeilDiv(ctx, in.block_size);
    p.max_sequences_per_instance = p.kv_blocks_per_gpu / p.blocks_per_sequence;
    p.max_concurrent_sequences = p.max_sequences_per_instance * p.num_instances;
    p.sequences_per_instance_exact = static_cast<double>(p.kv_budget_bytes_per_gpu) /
                                     static_cast<double>(p.kv_bytes_per_token_per_gpu * ctx);
    p.max_concurrent_sequences_real =
        p.kv_budget_bytes_per_gpu / p.kv_bytes_per_sequence_real_per_gpu * p.num_instances;
    if (arch.max_position > 0 && ctx > arch.max_position) {
        p.notes.push_back("the context (" + Str(ctx) +
                          ") is longer than max_position_embeddings (" + Str(arch.max_position) +
                          ")");
    }
    p.input = in;
    return p;
}

}  // namespace kvshard::kv
