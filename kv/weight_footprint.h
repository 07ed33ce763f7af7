// WeightFootprint: parameters of a model counted from its ArchConfig, and the bytes of weights one
// GPU holds when the model runs tensor-parallel over tp GPUs. The capacity planner subtracts this
// from each GPU's memory before it sizes the KV cache.
//
// What is split and what is replicated over tp ranks (DESIGN.md "Tensor-parallel rules"):
//   split by vocabulary  embedding, LM head (ceil(vocab / tp) rows each)
//   split by heads       q, o projections; k, v projections while tp <= KV heads (else each rank
//                        holds its one replicated KV head); MLA q_b, kv_b, o
//   split by columns     dense MLPs, routed experts (tensor-parallel experts, no expert
//                        parallelism), shared experts
//   replicated           norms (incl. q/k norms), o-projection bias, MoE routers, the MLA
//                        down-projections q_a and kv_a (every head needs the whole latent)
// Bytes: linear weights take the weight dtype (int4: 4 bits + one fp16 scale per group of 128 =
// 4.125 bits; fp8: per-tensor or per-block scales ignored); embedding, LM head, norms and routers
// stay 16-bit unless the dtype is fp32, as in the AWQ/GPTQ and FP8 checkpoints they model.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"
#include "config/arch_config.h"

namespace kvshard::kv {

enum class WeightDtype { kFp32, kFp16, kBf16, kFp8, kInt4 };

std::string_view WeightDtypeName(WeightDtype dtype);
// Accepts fp32|float32, fp16|float16, bf16|bfloat16, fp8, int4.
Result<WeightDtype> ParseWeightDtype(std::string_view name);

// Parameters by how they are stored and split. All counts are whole-model.
struct ParameterCounts {
    int64_t embedding = 0;  // vocab x hidden
    int64_t lm_head = 0;    // vocab x hidden; 0 when tied to the embedding
    int64_t attention = 0;  // split linear attention weights and biases, excluding kv_proj
    int64_t kv_proj = 0;    // MHA/GQA k and v projections (and biases)
    int64_t attention_replicated = 0;  // MLA q_a, kv_a and their norms
    int64_t mlp = 0;                   // dense MLPs
    int64_t experts = 0;               // routed experts
    int64_t shared_experts = 0;        // shared expert MLPs and their gates
    int64_t router = 0;                // MoE gates (+ score correction biases)
    int64_t norms = 0;                 // every norm, q/k norms, o-projection biases

    int64_t Total() const;
};

ParameterCounts CountParameters(const ArchConfig& arch);

struct WeightFootprint {
    ParameterCounts params;
    int64_t parameter_count = 0;
    int64_t bytes_total = 0;
    int64_t params_per_gpu = 0;
    int64_t bytes_per_gpu = 0;
};

// REQUIRES nothing; InvalidArgument naming the numbers when tp does not divide the attention heads
// or the KV heads cannot be split or replicated evenly.
Result<WeightFootprint> ComputeWeightFootprint(const ArchConfig& arch, int64_t tp,
                                               WeightDtype dtype);

}  // namespace kvshard::kv
