// ModelSpec: the architecture hyperparameters of a Llama-family model, the same whichever file
// format they were read from (GGUF metadata, HF config.json, llama2.c header).
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace kvshard {

enum class RopeScalingType { kNone, kLinear, kLlama3 };

struct RopeScaling {
    RopeScalingType type = RopeScalingType::kNone;
    float factor = 1.0f;
    // Llama 3.1 "llama3" scaling only.
    float low_freq_factor = 1.0f;
    float high_freq_factor = 4.0f;
    int64_t original_max_position = 8192;
};

// How the rows of the Q and K projection weights are ordered within each head. kvshard computes
// RoPE on interleaved pairs (x[2i], x[2i+1]), as Meta's checkpoints, llama2.c and GGUF store them;
// Hugging Face checkpoints order each head as [first halves | second halves] ("rotate_half"), and
// their rows are permuted into interleaved order when weights are loaded.
enum class QkLayout { kInterleaved, kHalfSplit };

struct ModelSpec {
    std::string architecture = "llama";
    int64_t num_layers = 0;
    int64_t hidden_size = 0;
    int64_t num_heads = 0;
    int64_t num_kv_heads = 0;
    int64_t head_dim = 0;
    int64_t ffn_size = 0;  // intermediate size of the SwiGLU MLP
    int64_t vocab_size = 0;
    int64_t max_position = 0;  // context length the model was trained with (0: unknown)
    float rope_theta = 10000.0f;
    RopeScaling rope_scaling;
    float norm_eps = 1e-5f;
    bool tied_embeddings = false;
    int32_t bos_token_id = -1;
    int32_t eos_token_id = -1;
    std::string chat_template;  // Jinja source from the model file, empty if none
    QkLayout qk_layout = QkLayout::kInterleaved;

    // Checks that the numbers describe a model kvshard can run (positive sizes, heads divisible by
    // KV heads, head_dim even, ...). The message names the field and its value.
    Status Validate() const;
    std::string ToString() const;
};

}  // namespace kvshard
