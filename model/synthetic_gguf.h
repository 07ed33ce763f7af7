// Synthetic Llama models as GGUF files: random weights of a chosen shape and type with a small
// SentencePiece-style vocabulary, for tests that need a model of a shape no fixture has.
#pragma once

#include <cstdint>
#include <string>

#include "config/model_spec.h"
#include "model/gguf_writer.h"
#include "model/tensor.h"

namespace kvshard {

struct SyntheticGgufOptions {
    // Type of the 2-D weights whose rows are a multiple of 32 wide (others and norms are F32).
    DType weight_dtype = DType::kF32;
    uint32_t seed = 1;
    // Scale of the uniform random weights (norm weights are 1 + scale * noise).
    float weight_scale = 0.1f;
    // Tokens in the vocabulary; 0: spec.vocab_size. Another number builds a model whose
    // tokenizer does not match its embedding (for tests of that check).
    int64_t num_tokens = 0;
};

// A writer holding a complete model for `spec` (REQUIRES: spec.Validate() is OK): llama.*
// metadata, a vocabulary of spec.vocab_size tokens ("<unk>", "<s>", "</s>", then the byte tokens
// "<0x00>".. "<0xFF>" when they fit, then "▁t<N>" pieces; scores and token types), and every
// tensor ExpectedTensors(spec) lists, Q/K rows interleaved. Callers may add or override keys
// and tensors before writing (GgufFile rejects duplicates, so overriding means building anew).
GgufWriter SyntheticLlamaGguf(const ModelSpec& spec, const SyntheticGgufOptions& options = {});

}  // namespace kvshard
