// Weights of one worker, dequantized to fp32 at load from the memory-mapped model file: the whole
// model at tp 1, else the rank's slices (worker/shard.h). Shapes below are per rank: heads_r,
// kv_heads_r, ffn_r, vocab_r are the sizes of the rank's ranges in `layout`.
// Ownership: ModelWeights owns its buffers; it does not keep the ModelFile alive.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "config/model_spec.h"
#include "model/model_file.h"
#include "worker/shard.h"

namespace kvshard {

struct LayerWeights {
    std::vector<float> attn_norm;  // {hidden}
    std::vector<float> wq;         // {heads_r*head_dim, hidden}, RoPE pairs interleaved
    std::vector<float> wk;         // {kv_heads_r*head_dim, hidden}, RoPE pairs interleaved
    std::vector<float> wv;         // {kv_heads_r*head_dim, hidden}
    std::vector<float> wo;         // {hidden, heads_r*head_dim}: the rank's columns
    std::vector<float> ffn_norm;   // {hidden}
    std::vector<float> w_gate;     // {ffn_r, hidden}
    std::vector<float> w_up;       // {ffn_r, hidden}
    std::vector<float> w_down;     // {hidden, ffn_r}: the rank's columns
};

struct ModelWeights {
    ShardLayout layout;            // the slices held (tp 1: everything)
    std::vector<float> embedding;  // {vocab_r, hidden}: rows of token ids layout.vocab
    std::vector<LayerWeights> layers;
    std::vector<float> output_norm;  // {hidden}
    std::vector<float> output;       // {vocab_r, hidden}; empty when tied to `embedding`

    const float* classifier() const { return output.empty() ? embedding.data() : output.data(); }
    size_t NumBytes() const;
};

// Reads and dequantizes the slices of rank `shard` of every tensor named in model/model_file.h,
// touching only those bytes of the mapped file: row slices (Q, K, V, gate, up, embedding,
// classifier) as row ranges, column slices (attention output, down projection) row by row from
// the block holding the first column. Q/K rows stored in Hugging Face's half-split order are
// permuted, head by head, into the interleaved order the RoPE kernel uses.
// Errors: those of MakeShardLayout; InvalidArgument when a column slice of a quantized tensor
// does not start and end on a block boundary; the file's errors for missing or misshapen tensors.
Result<ModelWeights> LoadWeights(const ModelFile& model, const ShardSpec& shard = {});

// Permutes the rows of a {heads*head_dim, cols} Q or K weight from half-split order to
// interleaved order: interleaved row 2i+k of a head is half-split row k*head_dim/2 + i.
void HalfSplitToInterleaved(float* w, int64_t num_heads, int64_t head_dim, int64_t cols);

}  // namespace kvshard
