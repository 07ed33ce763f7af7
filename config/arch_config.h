// ArchConfig: the shape of a decoder-only transformer as far as memory planning needs it (layers,
// heads, KV layout, MLP and expert sizes, sliding-window layers), read from the config.json of
// many Hugging Face architectures. Unlike ModelSpec (what kvshard can run: Llama family), this
// covers models kvshard only plans for: the `kvshard plan` capacity planner reads it.
//
// Field names are those of the published config.json files and transformers' config classes:
//   llama, mistral, mixtral    num_hidden_layers, hidden_size, num_attention_heads,
//                              num_key_value_heads, head_dim (else hidden / heads),
//                              intermediate_size, vocab_size, tie_word_embeddings, attention_bias,
//                              mlp_bias, sliding_window (Mistral: every layer), num_local_experts
//   qwen2, qwen3 (+ _moe)      the above, q/k/v biases (qwen2), q/k norms (qwen3),
//                              use_sliding_window + max_window_layers, num_experts,
//                              moe_intermediate_size, shared_expert_intermediate_size,
//                              decoder_sparse_step, mlp_only_layers
//   gemma2                     sliding_window on even layers (0, 2, ...), four norms per layer
//   gemma3, gemma3_text        the text model under "text_config" for the multimodal checkpoints;
//                              sliding_window_pattern (every n-th layer global) or layer_types;
//                              absent fields take Gemma3TextConfig's defaults
//   deepseek_v2, deepseek_v3   MLA (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
//                              v_head_dim), n_routed_experts, n_shared_experts,
//                              moe_intermediate_size, first_k_dense_replace, moe_layer_freq
// and "layer_types" ("full_attention" / "sliding_attention") wherever it is present.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard {

enum class AttentionKind {
    kMultiHead,    // MHA, GQA, MQA: K and V of num_kv_heads heads are cached
    kMultiLatent,  // DeepSeek MLA: one compressed latent plus a shared RoPE key are cached
};

enum class LayerAttention { kGlobal, kSliding };

struct MlaConfig {
    int64_t q_lora_rank = 0;  // 0: queries are projected directly from the hidden state
    int64_t kv_lora_rank = 0;
    int64_t qk_nope_head_dim = 0;
    int64_t qk_rope_head_dim = 0;
    int64_t v_head_dim = 0;
};

struct MoeConfig {
    int64_t num_routed_experts = 0;  // 0: every MLP is dense
    int64_t expert_intermediate_size = 0;
    // Width of the always-active shared MLP of a MoE layer (DeepSeek: n_shared_experts x
    // moe_intermediate_size; Qwen2-MoE: shared_expert_intermediate_size); 0 when none.
    int64_t shared_intermediate_size = 0;
    bool shared_expert_gate = false;  // Qwen2-MoE: a hidden -> 1 gate on the shared MLP
    bool router_bias = false;         // DeepSeek-V3: a per-expert score correction bias
};

struct ArchConfig {
    std::string path;          // the file read, for messages
    std::string model_type;    // of the text model ("gemma3_text" inside a "gemma3" file)
    std::string architecture;  // architectures[0], "" when absent
    int64_t num_layers = 0;
    int64_t hidden_size = 0;
    int64_t num_heads = 0;
    int64_t num_kv_heads = 0;       // MLA: num_heads (every head reads the shared latent)
    int64_t head_dim = 0;           // MLA: unused (see mla)
    int64_t intermediate_size = 0;  // dense MLP width
    int64_t vocab_size = 0;
    int64_t max_position = 0;  // max_position_embeddings, 0 when absent
    bool tied_embeddings = false;
    bool qkv_bias = false;
    bool o_bias = false;
    bool mlp_bias = false;
    bool qk_norm = false;         // an RMSNorm of head_dim weights on q and on k (Qwen3, Gemma 3)
    int64_t norms_per_layer = 2;  // hidden-sized norms per layer (Gemma 2/3: 4)
    AttentionKind attention = AttentionKind::kMultiHead;
    MlaConfig mla;
    MoeConfig moe;
    std::vector<bool> moe_layers;                 // per layer: the MLP is the expert block
    std::vector<LayerAttention> layer_attention;  // per layer
    int64_t sliding_window = 0;                   // tokens a sliding layer keeps; 0: none slides
    // Parts of the file the planner does not count (vision tower, multi-token-prediction layers)
    // or settings it does not follow (quantization_config), one sentence each.
    std::vector<std::string> notes;

    int64_t NumSlidingLayers() const;
    int64_t NumMoeLayers() const;
};

// Reads a config.json. Errors: InvalidArgument "<path>: field '<name>': <problem>" for a missing
// or mistyped field (nested fields as "text_config.hidden_size"), NotFound for a missing file,
// Unimplemented naming a model_type or layer type the reader does not know.
Result<ArchConfig> ReadArchConfig(const std::string& path);
// The same from the text of a config.json; `path` is used in messages only.
Result<ArchConfig> ParseArchConfig(std::string_view json_text, const std::string& path);

}  // namespace kvshard
