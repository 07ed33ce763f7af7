// Weights of one worker, dequantized to fp32 at load from the memory-mapped model file.
// Ownership: ModelWeights owns its buffers; it does not keep the ModelFile alive.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "config/model_spec.h"
#include "model/model_file.h"

namespace kvshard {

struct LayerWeights {
    std::vector<float> attn_norm;  // {hidden}
    std::vector<float> wq;         // {heads*head_dim, hidden}, RoPE pairs interleaved
    std::vector<float> wk;         // {kv_heads*head_dim, hidden}, RoPE pairs interleaved
    std::vector<float> wv;         // {kv_heads*head_dim, hidden}
    std::vector<float> wo;         // {hidden, heads*head_dim}
    std::vector<float> ffn_norm;   // {hidden}
    std::vector<float> w_gate;     // {ffn, hidden}
    std::vector<float> w_up;       // {ffn, hidden}
    std::vector<float> w_down;     // {hidden, ffn}
};

struct ModelWeights {
    std::vector<float> embedding;  // {vocab, hidden}
    std::vector<LayerWeights> layers;
    std::vector<float> output_norm;  // {hidden}
    std::vector<float> output;       // {vocab, hidden}; empty when tied to `embedding`

    const float* classifier() const { return output.empty() ? embedding.data() : output.data(); }
    size_t NumBytes() const;
};

// Reads and dequantizes every tensor named in model/model_file.h. Q/K rows stored in Hugging
// Face's half-split order are permuted into the interleaved order the RoPE kernel uses.
Result<ModelWeights> LoadWeights(const ModelFile& model);

// Permutes the rows of a {heads*head_dim, cols} Q or K weight from half-split order to
// interleaved order: interleaved row 2i+k of a head is half-split row k*head_dim/2 + i.
void HalfSplitToInterleaved(float* w, int64_t num_heads, int64_t head_dim, int64_t cols);

}  // namespace kvshard
