// Mapping between Hugging Face Llama tensor names and kvshard's canonical (GGUF) names.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kvshard {

// "model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight"; nullopt for names that are
// not Llama weights (rotary_emb.inv_freq buffers, unknown tensors).
std::optional<std::string> CanonicalNameFromHf(std::string_view hf_name);
// The inverse. REQUIRES: `canonical` is one of the names listed in model/model_file.h.
std::string HfNameFromCanonical(std::string_view canonical);

}  // namespace kvshard
