#include "kv/weight_footprint.h"

#include <string>

#include "kv/kv_geometry.h"

namespace kvshard::kv {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Bytes per parameter as a fraction num / den.
struct BytesPerParam {
    int64_t num = 2;
    int64_t den = 1;
    int64_t Of(int64_t params) const { return CeilDiv(params * num, den); }
};

BytesPerParam LinearBytes(WeightDtype dtype) {
    switch (dtype) {
        case WeightDtype::kFp32:
            return {4, 1};
        case WeightDtype::kFp16:
            return {2, 1};
        case WeightDtype::kBf16:
            return {2, 1};
        case WeightDtype::kFp8:
            return {1, 1};
        case WeightDtype::kInt4:
            return {66, 128};  // 4 bits + 16 bits per 128 weights
    }
    return {2, 1};
}

BytesPerParam OtherBytes(WeightDtype dtype) {
    return dtype == WeightDtype::kFp32 ? BytesPerParam{4, 1} : BytesPerParam{2, 1};
}

}  // namespace

std::string_view WeightDtypeName(WeightDtype dtype) {
    switch (dtype) {
        case WeightDtype::kFp32:
            return "fp32";
        case WeightDtype::kFp16:
            return "fp16";
        case WeightDtype::kBf16:
            return "bf16";
        case WeightDtype::kFp8:
            return "fp8";
        case WeightDtype::kInt4:
            return "int4";
    }
    return "?";
}

Result<WeightDtype> ParseWeightDtype(std::string_view name) {
    if (name == "fp32" || name == "float32") return WeightDtype::kFp32;
    if (name == "fp16" || name == "float16") return WeightDtype::kFp16;
    if (name == "bf16" || name == "bfloat16") return WeightDtype::kBf16;
    if (name == "fp8") return WeightDtype::kFp8;
    if (name == "int4") return WeightDtype::kInt4;
    return InvalidArgument("unknown weight dtype '" + std::string(name) +
                           "' (expected fp32, fp16, bf16, fp8 or int4)");
}

int64_t ParameterCounts::Total() const {
    return embedding + lm_head + attention + kv_proj + attention_replicated + mlp + experts +
           shared_experts + router + norms;
}

ParameterCounts CountParameters(const ArchConfig& a) {
    ParameterCounts p;
    const int64_t h = a.hidden_size;
    const int64_t layers = a.num_layers;
    p.embedding = a.vocab_size * h;
    p.lm_head = a.tied_embeddings ? 0 : a.vocab_size * h;
    p.norms = layers * a.norms_per_layer * h + h;  // + the final norm

    if (a.attention == AttentionKind::kMultiLatent) {
        const MlaConfig& m = a.mla;
        const int64_t qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim;
        int64_t split = a.num_heads * m.v_head_dim * h;                                   // o_proj
        split += m.kv_lora_rank * a.num_heads * (m.qk_nope_head_dim + m.v_head_dim);      // kv_b
        int64_t replicated = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank;  // kv_a
        if (m.q_lora_rank > 0) {
            replicated += h * m.q_lora_rank + m.q_lora_rank;  // q_a + its norm
            split += m.q_lora_rank * a.num_heads * qk_dim;    // q_b
        } else {
            split += h * a.num_heads * qk_dim;  // q_proj
        }
        p.attention = layers * split;
        p.attention_replicated = layers * replicated;
    } else {
        const int64_t q_dim = a.num_heads * a.head_dim;
        const int64_t kv_dim = a.num_kv_heads * a.head_dim;
        int64_t split = 2 * h * q_dim;  // q, o
        int64_t kv = 2 * h * kv_dim;
        if (a.qkv_bias) {
            split += q_dim;
            kv += 2 * kv_dim;
        }
        p.attention = layers * split;
        p.kv_proj = layers * kv;
        if (a.o_bias) p.norms += layers * h;
        if (a.qk_norm) p.norms += layers * 2 * a.head_dim;
    }

    const int64_t moe_layers = a.NumMoeLayers();
    const int64_t dense_layers = layers - moe_layers;
    int64_t dense_mlp = 3 * h * a.intermediate_size;
    if (a.mlp_bias) dense_mlp += 2 * a.intermediate_size + h;
    p.mlp = dense_layers * dense_mlp;
    if (moe_layers > 0) {
        const MoeConfig& e = a.moe;
        p.experts = moe_layers * e.num_routed_experts * 3 * h * e.expert_intermediate_size;
        p.shared_experts =
            moe_layers * (3 * h * e.shared_intermediate_size + (e.shared_expert_gate ? h : 0));
        p.router =
            moe_layers * (e.num_routed_experts * h + (e.router_bias ? e.num_routed_experts : 0));
    }
    return p;
}

Result<WeightFootprint> ComputeWeightFootprint(const ArchConfig& a, int64_t tp, WeightDtype dtype) {
    if (tp <= 0) return InvalidArgument("tp must be positive, got " + std::to_string(tp));
    if (a.num_heads % tp != 0) {
        return InvalidArgument(a.path + ": num_attention_heads " + std::to_string(a.num_heads) +
                               " cannot be split evenly over tp " + std::to_string(tp));
    }
    WeightFootprint w;
    w.params = CountParameters(a);
    const ParameterCounts& p = w.params;
    w.parameter_count = p.Total();

    const BytesPerParam linear = LinearBytes(dtype);
    const BytesPerParam other = OtherBytes(dtype);
    const int64_t linear_total =
        p.attention + p.kv_proj + p.attention_replicated + p.mlp + p.experts + p.shared_experts;
    const int64_t other_total = p.embedding + p.lm_head + p.router + p.norms;
    w.bytes_total = linear.Of(linear_total) + other.Of(other_total);

    // One rank's share.
    int64_t kv_proj_per_gpu = 0;
    if (p.kv_proj > 0) {
        Result<int64_t> local = LocalKvHeads(a.num_heads, a.num_kv_heads, tp);
        if (!local.ok()) return local.status().WithContext(a.path);
        kv_proj_per_gpu = p.kv_proj / a.num_kv_heads * *local;
    }
    const int64_t vocab_rows = CeilDiv(a.vocab_size, tp);
    const int64_t embed_per_gpu =
        vocab_rows * a.hidden_size * ((p.embedding > 0) + (p.lm_head > 0));
    const int64_t linear_per_gpu = CeilDiv(p.attention + p.mlp + p.experts + p.shared_experts, tp) +
                                   kv_proj_per_gpu + p.attention_replicated;
    const int64_t other_per_gpu = embed_per_gpu + p.router + p.norms;
    w.params_per_gpu = linear_per_gpu + other_per_gpu;
    w.bytes_per_gpu = linear.Of(linear_per_gpu) + other.Of(other_per_gpu);
    return w;
}

}  // namespace kvshard::kv
