// Writes any opened model as a Hugging Face folder of its architecture (LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM): config.json,
// safetensors weights (one file or shards with model.safetensors.index.json), tokenizer.json,
// tokenizer_config.json and generation_config.json. Quantized tensors are dequantized; Q/K rows
// are permuted into Hugging Face's half-split order; Gemma 3's norm weights are stored as the w
// of its x * (1 + w). OpenModel(out_dir) reads back the same model.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "model/model_file.h"
#include "model/tensor.h"

namespace kvshard {

struct HfExportOptions {
    DType dtype = DType::kF32;  // F32 (exact for dequantized GGUF), BF16 or F16
    // 0: a single model.safetensors. Otherwise tensors are packed in order into shards
    // model-0000i-of-0000n.safetensors of at most this many data bytes (a larger tensor gets a
    // shard of its own) and listed in model.safetensors.index.json.
    uint64_t max_shard_bytes = 0;
};

// Creates `out_dir` if needed and writes the files into it, replacing files of the same names
// (and a stale single-file or sharded variant of the weights). Errors name the file.
Status ExportHuggingFace(const ModelFile& model, const std::string& out_dir,
                         const HfExportOptions& opts = {});

// A model's tokenizer as Hugging Face keeps it: tokenizer.json, and tokenizer_config.json (bos,
// eos, add_bos_token, and the model's chat template, which GGUF keeps beside the tokenizer keys).
// The same text ExportHuggingFace writes; `kvshard serve` answers GET /v1/models/{id}/tokenizer
// and /tokenizer_config with it.
struct HfTokenizerFiles {
    std::string tokenizer_json;
    std::string tokenizer_config_json;
};
HfTokenizerFiles HfTokenizerFilesOf(const ModelFile& model);

// Creates `out_dir` if needed and writes only tokenizer.json and tokenizer_config.json into it
// (`kvshard convert --tokenizer-only`): enough for transformers' AutoTokenizer.from_pretrained.
// Errors name the file.
Status ExportHfTokenizer(const ModelFile& model, const std::string& out_dir);

// Reorders the rows of a {num_heads*head_dim, cols} Q or K weight from interleaved RoPE pairs
// to half-split order: within each head, half-split row k*head_dim/2 + i is interleaved row
// 2i + k (k in {0, 1}).
void InterleavedToHalfSplit(const float* in, int64_t num_heads, int64_t head_dim, int64_t cols,
                            float* out);

}  // namespace kvshard
