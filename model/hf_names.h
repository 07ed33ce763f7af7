// Mapping between Hugging Face tensor names and kvshard's canonical (GGUF) names, per
// architecture: the Llama names, Q/K/V biases (qwen2), q/k norms (qwen3, gemma3), and Gemma 3's
// four norms a layer, where post_attention_layernorm is the attention output's norm
// (post_attention_norm) and pre_feedforward_layernorm the MLP's input norm (ffn_norm).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kvshard {

// "model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight"; nullopt for names that are
// not weights of `architecture` (ModelSpec::architecture; rotary_emb.inv_freq buffers, unknown
// tensors).
std::optional<std::string> CanonicalNameFromHf(std::string_view hf_name,
                                               std::string_view architecture = "llama");
// The inverse. REQUIRES: `canonical` is one of the names listed in model/model_file.h.
std::string HfNameFromCanonical(std::string_view canonical,
                                std::string_view architecture = "llama");

}  // namespace kvshard
