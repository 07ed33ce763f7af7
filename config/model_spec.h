// ModelSpec: the architecture hyperparameters of a Llama-family model, the same whichever file
// format they were read from (GGUF metadata, HF config.json, llama2.c header). The architectures
// kvshard runs are Llama plus the variations below (qwen2: Q/K/V biases; qwen3: q/k norms;
// mistral: a sliding window; gemma3: all of the Gemma 3 block), each a field of its own so the
// forward pass reads features, not names.
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

// The MLP's gate activation: SwiGLU (silu) or GeGLU with tanh-approximated GELU (Gemma).
enum class Activation { kSilu, kGeluTanh };

// The architectures kvshard runs: "llama", "mistral", "qwen2", "qwen3", "gemma3".
bool IsSupportedArchitecture(const std::string& architecture);

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

    // Architecture features (all off for Llama).
    bool attn_bias = false;       // biases on Q, K and V (qwen2)
    bool qk_norm = false;         // RMSNorm of each q and k head before RoPE (qwen3, gemma3)
    bool post_norms = false;      // RMSNorm of the attention and MLP outputs before each residual
                                  // add (gemma3)
    float embedding_scale = 1.0f;  // token embeddings are multiplied by it (gemma3: sqrt(hidden))
    Activation activation = Activation::kSilu;
    // Sliding-window attention: a windowed layer's query at position p attends to positions
    // p - sliding_window + 1 .. p (llama.cpp's "standard" window). 0: every layer is global.
    int64_t sliding_window = 0;
    // Which layers are windowed (llama.cpp's sliding_window_pattern): 0, every layer; N, layer l
    // unless l % N == N - 1 (gemma3: 6, five local layers then a global one).
    int64_t sliding_window_pattern = 0;
    // RoPE base of the windowed layers, which take no rope_scaling (gemma3: 10000); 0: the
    // windowed layers use rope_theta and rope_scaling as the global ones do.
    float rope_theta_local = 0.0f;

    bool IsWindowed(int64_t layer) const {
        if (sliding_window <= 0) return false;
        return sliding_window_pattern <= 0 ||
               layer % sliding_window_pattern < sliding_window_pattern - 1;
    }

    // Checks that the numbers describe a model kvshard can run (positive sizes, heads divisible by
    // KV heads, head_dim even, ...). The message names the field and its value.
    Status Validate() const;
    std::string ToString() const;
};

}  // namespace kvshard
