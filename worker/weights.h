// Weights of one worker in backend memory (kernels/backend.h), kept in the format the model file
// stores them in (F32, F16, BF16, Q8_0, Q4_0, Q4_1): the whole model at tp 1, else the rank's
// slices (worker/shard.h). Norm weights are F32 vectors. Q, K and V are fused into one matrix
// (rows of Q, then K, then V) and so are gate and up (gate rows, then up rows), so each is one
// matrix product. Shapes below are per rank: heads_r, kv_heads_r, ffn_r, vocab_r are the sizes of
// the rank's ranges in `layout`.
// Ownership: every WeightView points into `arena`, which returns its memory to the backend; the
// weights do not keep the ModelFile alive.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "config/model_spec.h"
#include "kernels/backend.h"
#include "model/model_file.h"
#include "worker/shard.h"

namespace kvshard {

// kStored keeps each matrix as the file stores it (the fast path); kF32 dequantizes every
// weight at load (the reference path of `--weight-format f32`).
enum class WeightFormat { kStored, kF32 };
std::string_view WeightFormatName(WeightFormat format);
Result<WeightFormat> ParseWeightFormat(std::string_view name);  // "stored" | "f32"

struct LayerWeights {
    WeightView attn_norm;  // F32 {1, hidden}
    WeightView qkv;        // {(heads_r + 2 kv_heads_r) * head_dim, hidden}, RoPE pairs interleaved
    WeightView wo;         // {hidden, heads_r * head_dim}: the rank's columns
    WeightView ffn_norm;   // F32 {1, hidden}
    WeightView gate_up;    // {2 ffn_r, hidden}
    WeightView down;       // {hidden, ffn_r}: the rank's columns
    // Present (data != nullptr) only where the spec asks for them:
    WeightView qkv_bias;        // F32 {1, (heads_r + 2 kv_heads_r) * head_dim}   (attn_bias)
    WeightView q_norm, k_norm;  // F32 {1, head_dim}, interleaved like Q/K          (qk_norm)
    WeightView post_attn_norm;  // F32 {1, hidden}                                  (post_norms)
    WeightView post_ffn_norm;   // F32 {1, hidden}
};

struct ModelWeights {
    ShardLayout layout;  // the slices held (tp 1: everything)
    WeightFormat format = WeightFormat::kStored;
    BackendBuffer arena;   // holds every tensor below
    WeightView embedding;  // {vocab_r, hidden}: rows of token ids layout.vocab
    std::vector<LayerWeights> layers;
    WeightView output_norm;  // F32 {1, hidden}
    WeightView output;       // {vocab_r, hidden}; data == nullptr when tied to `embedding`

    const WeightView& classifier() const { return output.data == nullptr ? embedding : output; }
    size_t NumBytes() const { return arena.bytes(); }
};

struct WeightLoadOptions {
    ShardSpec shard = {};
    WeightFormat format = WeightFormat::kStored;
    // The backend kind whose resident formats (ResidentWeightFormat) the weights are converted to
    // at load; unset: the backend's own. Tests load CUDA's formats onto the CPU backend.
    std::optional<BackendKind> formats_of = std::nullopt;
    // Called on the loading thread after each matrix is in the arena, with its bytes (their sum
    // is the arena's size, ResidentWeightBytes). Unset: nothing is reported.
    std::function<void(int64_t bytes)> on_bytes_loaded = nullptr;
};

// Each weight is kept in one form only: the format the backend's ops read it in
// (ResidentWeightFormat), converted on the host at load, so a device backend holds no stored-format
// copy beside its own and makes none at a weight's first use.
// Reads the slices of rank `options.shard` of every tensor named in model/model_file.h into one
// arena of `backend`, touching only those bytes of the mapped file: row slices (Q, K, V, gate,
// up, embedding, classifier) as row ranges, column slices (attention output, down projection) row
// by row from the block holding the first column. Q/K rows stored in Hugging Face's half-split
// order are permuted, head by head, into the interleaved order the RoPE kernel uses. When the
// parts of a fused matrix are stored in different formats, that matrix is dequantized to F32
// (logged).
// Errors: those of MakeShardLayout; InvalidArgument when a column slice of a quantized tensor
// does not start and end on a block boundary; the file's errors for missing or misshapen tensors;
// the backend's when the arena cannot be allocated.
Result<ModelWeights> LoadWeights(const ModelFile& model, Backend& backend,
                                 const WeightLoadOptions& options = {});

// The bytes LoadWeights would allocate for `options` on a backend of `kind` (its resident formats),
// from the file's tensor table (and its few bias and q/k-norm vectors) without reading the weights:
// what a device plan needs before loading. Errors: LoadWeights's, but none of the backend's.
Result<int64_t> ResidentWeightBytes(const ModelFile& model, BackendKind kind,
                                    const WeightLoadOptions& options = {});

// The rows of a weight as floats (copied out of backend memory and dequantized): for tests and
// tools, not for the forward pass.
std::vector<float> ReadWeightRows(Backend& backend, const WeightView& w);

}  // namespace kvshard
