// Reading and writing Hugging Face config.json files of the architectures kvshard runs:
// LlamaForCausalLM (llama), MistralForCausalLM (mistral), Qwen2ForCausalLM (qwen2),
// Qwen3ForCausalLM (qwen3) and Gemma3ForCausalLM (gemma3_text).
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "config/model_spec.h"

namespace kvshard {

// Reads `config_json_path` into a ModelSpec (qk_layout kHalfSplit, chat_template empty: it lives
// in tokenizer_config.json) with its architecture's features: qwen2's Q/K/V biases, qwen3's q/k
// norms, mistral's sliding_window, and gemma3's block (q/k and post norms, GeGLU, the embedding
// scale, local layers from sliding_window with layer_types or sliding_window_pattern and
// rope_local_base_freq). A wrong type or a missing required field is InvalidArgument
// "<path>: field '<name>': <problem>"; another architecture (Gemma 3's multimodal model_type
// gemma3 included), an unsupported rope_scaling type, biases on llama/mistral/qwen3,
// use_sliding_window on qwen2/qwen3, logit soft-capping, a query_pre_attn_scalar other than
// head_dim or local layers that are not periodic are Unimplemented naming the field. The spec is
// validated.
Result<ModelSpec> ReadHfConfig(const std::string& config_json_path);
// The same from the text of a config.json; `path` is used in error messages only.
Result<ModelSpec> ParseHfConfig(std::string_view json_text, const std::string& path);

// A config.json for `spec` (of its architecture's class) that ReadHfConfig reads back to the same
// spec (but for qk_layout and chat_template). `torch_dtype` is "float32", "bfloat16" or "float16".
std::string HfConfigText(const ModelSpec& spec, std::string_view torch_dtype);

}  // namespace kvshard
