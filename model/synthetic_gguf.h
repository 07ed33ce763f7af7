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

// A writer holding a complete model for `spec` (REQUIRES: spec.Validate() is OK): metadata under
// spec.architecture's prefix as llama.cpp names it (llama.*, qwen2.*, qwen3.*, gemma3.*, with the
// sliding-window keys when spec.sliding_window > 0), a vocabulary of spec.vocab_size tokens ("<unk>", "<s>", "</s>", then the byte tokens
// "<0x00>".. "<0xFF>" when they fit, then "▁t<N>" pieces; scores and token types), and every
// tensor ExpectedTensors(spec) lists (norm weights 1 + noise, biases noise). Q/K rows are random,
// so the file means the same model in either RoPE layout: its architecture's (spec.qk_layout is
// not written; a reader derives it from the architecture). Callers may add or override keys
// and tensors before writing (GgufFile rejects duplicates, so overriding means building anew).
GgufWriter SyntheticLlamaGguf(const ModelSpec& spec, const SyntheticGgufOptions& options = {});

// A small spec of `architecture` ("llama", "mistral", "qwen2", "qwen3", "gemma3") with every
// feature of it on: 2 or 3 layers, hidden 64, vocabulary 256 (no byte tokens), Q/K/V biases (qwen2), q/k norms and
// a head width that is not hidden / heads (qwen3, gemma3), a sliding window of 8 over every layer
// (mistral) or of 6 over two local layers of three with their own RoPE base, MQA, post norms,
// GeGLU and the embedding scale (gemma3). The tests of the architectures and the llama.cpp goldens
// of tests/golden/make_arch_llamacpp.py are made from these. REQUIRES: a name above.
ModelSpec SyntheticArchSpec(const std::string& architecture);

// SyntheticLlamaGguf of SyntheticArchSpec(architecture) with the weights of its tests: seed 7,
// uniform weights of scale 0.5 (large enough that greedy margins are not ties), F32.
GgufWriter SyntheticArchGguf(const std::string& architecture);

}  // namespace kvshard
