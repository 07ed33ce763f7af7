// Reading and writing Hugging Face config.json files of Llama-family models (LlamaForCausalLM).
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "config/model_spec.h"

namespace kvshard {

// Reads `config_json_path` into a ModelSpec (qk_layout kHalfSplit, chat_template empty: it lives
// in tokenizer_config.json). A wrong type or a missing required field is InvalidArgument
// "<path>: field '<name>': <problem>"; another architecture, an unsupported rope_scaling type or
// biases are Unimplemented naming them. The spec is validated.
Result<ModelSpec> ReadHfConfig(const std::string& config_json_path);
// The same from the text of a config.json; `path` is used in error messages only.
Result<ModelSpec> ParseHfConfig(std::string_view json_text, const std::string& path);

// A config.json for `spec` (LlamaForCausalLM) that ReadHfConfig reads back to the same spec
// (but for qk_layout and chat_template). `torch_dtype` is "float32", "bfloat16" or "float16".
std::string HfConfigText(const ModelSpec& spec, std::string_view torch_dtype);

}  // namespace kvshard
