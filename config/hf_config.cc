#include "config/hf_config.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "common/mapped_file.h"
#include "config/json_fields.h"

namespace kvshard {
namespace {

using nlohmann::json;

using config_internal::Fields;

// The Hugging Face model types kvshard runs: config.json's model_type, the class in its
// architectures list, and ModelSpec::architecture.
struct HfArchitecture {
    std::string_view model_type;
    std::string_view hf_class;
    std::string_view architecture;
};

constexpr HfArchitecture kHfArchitectures[] = {
    {"llama", "LlamaForCausalLM", "llama"},
    {"mistral", "MistralForCausalLM", "mistral"},
    {"qwen2", "Qwen2ForCausalLM", "qwen2"},
    {"qwen3", "Qwen3ForCausalLM", "qwen3"},
    {"gemma3_text", "Gemma3ForCausalLM", "gemma3"},
};

std::string KnownNames(bool classes) {
    std::string names;
    for (const HfArchitecture& a : kHfArchitectures) {
        if (!names.empty()) names += ", ";
        names += classes ? a.hf_class : a.model_type;
    }
    return names;
}

Result<const HfArchitecture*> CheckArchitecture(const Fields& f, const std::string& path) {
    const json* archs = f.Find("architectures");
    const json* model_type = f.Find("model_type");
    if (archs == nullptr && model_type == nullptr) {
        return f.Error("architectures", "missing (and no 'model_type' either)");
    }
    const HfArchitecture* found = nullptr;
    if (model_type != nullptr) {
        if (!model_type->is_string()) {
            return f.Error("model_type", "must be a string, got " + model_type->dump());
        }
        const std::string t = model_type->get<std::string>();
        for (const HfArchitecture& a : kHfArchitectures) {
            if (a.model_type == t) found = &a;
        }
        if (t == "gemma3") {
            return Unimplemented(path + ": model_type 'gemma3' (Gemma3ForConditionalGeneration, "
                                        "text and vision) is not supported; its text-only "
                                        "checkpoints (gemma3_text, Gemma3ForCausalLM) are");
        }
        if (found == nullptr) {
            return Unimplemented(path + ": model_type '" + t + "' is not supported (kvshard runs " +
                                 KnownNames(false) + ")");
        }
    }
    if (archs != nullptr) {
        if (!archs->is_array() || archs->empty()) {
            return f.Error("architectures", "must be a list of names, got " + archs->dump());
        }
        for (const json& a : *archs) {
            if (!a.is_string()) {
                return f.Error("architectures", "must be a list of names, got " + archs->dump());
            }
            const std::string name = a.get<std::string>();
            const HfArchitecture* known = nullptr;
            for (const HfArchitecture& k : kHfArchitectures) {
                if (k.hf_class == name) known = &k;
            }
            if (known == nullptr) {
                return Unimplemented(path + ": architecture '" + name +
                                     "' is not supported (kvshard runs " + KnownNames(true) + ")");
            }
            if (found != nullptr && known != found) {
                return f.Error("architectures", "'" + name + "' does not match model_type '" +
                                                    std::string(found->model_type) + "'");
            }
            found = known;
        }
    }
    return found;
}

// The MLP activation: silu, or Gemma's tanh-approximated GELU (Gemma3TextConfig names the field
// hidden_activation; older configs hidden_act).
Status CheckActivation(const Fields& f, const std::string& path, bool gemma) {
    const std::string_view want = gemma ? "gelu_pytorch_tanh" : "silu";
    for (const char* field : {"hidden_activation", "hidden_act"}) {
        const json* act = f.Find(field);
        if (act == nullptr) continue;
        if (!act->is_string()) return f.Error(field, "must be a string, got " + act->dump());
        if (act->get<std::string>() != want) {
            return Unimplemented(path + ": " + field + " '" + act->get<std::string>() +
                                 "' is not supported (kvshard runs " + std::string(want) +
                                 " for this architecture)");
        }
    }
    return Status::Ok();
}

// Fields that, when set, ask for what kvshard does not run: refused naming the field.
Status RefuseFlags(const Fields& f, const std::string& path,
                   std::initializer_list<const char*> flags) {
    for (const char* flag : flags) {
        KV_ASSIGN_OR_RETURN(bool set, f.Bool(flag, false));
        if (set) return Unimplemented(path + ": " + flag + " = true is not supported");
    }
    return Status::Ok();
}

// Gemma 3's local layers: sliding_window, and which layers have it (layer_types, or the period
// sliding_window_pattern: five local layers, then a global one), their RoPE base, and the fields
// whose non-default values kvshard does not run.
Status ReadGemma3(const Fields& f, const std::string& path, ModelSpec* s) {
    for (const char* cap : {"attn_logit_softcapping", "final_logit_softcapping"}) {
        if (f.Find(cap) != nullptr) {
            return Unimplemented(path + ": " + cap + " = " + f.Find(cap)->dump() +
                                 ": logit soft-capping is not supported");
        }
    }
    KV_ASSIGN_OR_RETURN(int64_t scalar, f.PositiveInt("query_pre_attn_scalar", 256));
    if (scalar != s->head_dim) {
        return Unimplemented(path + ": query_pre_attn_scalar = " + std::to_string(scalar) +
                             " differs from head_dim " + std::to_string(s->head_dim) +
                             " (kvshard scales queries by 1/sqrt(head_dim))");
    }
    s->post_norms = true;
    s->qk_norm = true;
    s->activation = Activation::kGeluTanh;
    s->embedding_scale = std::sqrt(static_cast<float>(s->hidden_size));
    KV_ASSIGN_OR_RETURN(s->sliding_window, f.PositiveInt("sliding_window", 4096));
    KV_ASSIGN_OR_RETURN(s->sliding_window_pattern, f.PositiveInt("sliding_window_pattern", 6));
    if (const json* types = f.Find("layer_types")) {
        if (!types->is_array() || static_cast<int64_t>(types->size()) != s->num_layers) {
            return f.Error("layer_types", "must be a list of " + std::to_string(s->num_layers) +
                                              " strings (num_hidden_layers), got " +
                                              types->dump());
        }
        // The period: the first global layer ends it.
        int64_t period = 0;
        for (size_t i = 0; i < types->size() && period == 0; ++i) {
            if ((*types)[i] == "full_attention") period = static_cast<int64_t>(i) + 1;
        }
        s->sliding_window_pattern = period;
        for (size_t i = 0; i < types->size(); ++i) {
            const json& t = (*types)[i];
            const std::string want = s->IsWindowed(static_cast<int64_t>(i)) ? "sliding_attention"
                                                                            : "full_attention";
            if (t != want) {
                return Unimplemented(path + ": layer_types: layer " + std::to_string(i) +
                                     " is " + t.dump() +
                                     ": kvshard runs sliding_attention layers with a "
                                     "full_attention layer every N (a period)");
            }
        }
    }
    KV_ASSIGN_OR_RETURN(double local_theta, f.PositiveNumber("rope_local_base_freq", 10000.0));
    s->rope_theta_local = static_cast<float>(local_theta);
    return Status::Ok();
}

Status ReadRopeScaling(const Fields& f, const std::string& path, RopeScaling* out) {
    const json* j = f.Find("rope_scaling");
    if (j == nullptr) return Status::Ok();
    if (!j->is_object()) return f.Error("rope_scaling", "must be an object, got " + j->dump());
    Fields rs(*j, path, "rope_scaling.");
    const json* type = rs.Find("rope_type");
    std::string_view type_field = "rope_type";
    if (type == nullptr) {
        type = rs.Find("type");
        type_field = "type";
    }
    if (type == nullptr) return rs.Error("rope_type", "missing");
    if (!type->is_string()) return rs.Error(type_field, "must be a string, got " + type->dump());
    const std::string name = type->get<std::string>();
    if (name == "default") return Status::Ok();
    if (name != "linear" && name != "llama3") {
        return Unimplemented(path + ": rope_scaling type '" + name +
                             "' is not supported (linear and llama3 are)");
    }
    KV_ASSIGN_OR_RETURN(double factor, rs.PositiveNumber("factor"));
    out->factor = static_cast<float>(factor);
    if (name == "linear") {
        out->type = RopeScalingType::kLinear;
        return Status::Ok();
    }
    out->type = RopeScalingType::kLlama3;
    KV_ASSIGN_OR_RETURN(double low, rs.PositiveNumber("low_freq_factor"));
    KV_ASSIGN_OR_RETURN(double high, rs.PositiveNumber("high_freq_factor"));
    KV_ASSIGN_OR_RETURN(out->original_max_position,
                        rs.PositiveInt("original_max_position_embeddings"));
    if (!(high > low)) {
        return rs.Error("high_freq_factor", "must be larger than low_freq_factor");
    }
    out->low_freq_factor = static_cast<float>(low);
    out->high_freq_factor = static_cast<float>(high);
    return Status::Ok();
}

// The shortest decimal that reads back as the same float (1e-05 rather than
// 9.999999747378752e-06), as a JSON number.
double FloatJson(float v) {
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof(buf) - 1, v);
    *end = '\0';
    return std::strtod(buf, nullptr);
}

}  // namespace

Result<ModelSpec> ParseHfConfig(std::string_view json_text, const std::string& path) {
    json root;
    try {
        root = json::parse(json_text);
    } catch (const json::exception& e) {
        return InvalidArgument(path + ": not valid JSON: " + e.what());
    }
    if (!root.is_object()) return InvalidArgument(path + ": not a JSON object");
    Fields f(root, path);
    KV_ASSIGN_OR_RETURN(const HfArchitecture* arch, CheckArchitecture(f, path));
    ModelSpec spec;
    spec.architecture = std::string(arch->architecture);
    const bool gemma = spec.architecture == "gemma3";
    KV_RETURN_IF_ERROR(CheckActivation(f, path, gemma));
    if (spec.architecture == "llama" || spec.architecture == "mistral") {
        KV_RETURN_IF_ERROR(RefuseFlags(f, path, {"attention_bias", "mlp_bias"}));
    } else if (spec.architecture == "qwen2") {
        spec.attn_bias = true;  // Qwen 2 always has Q/K/V biases; its configs carry no flag
        KV_RETURN_IF_ERROR(RefuseFlags(f, path, {"use_sliding_window"}));
    } else if (spec.architecture == "qwen3") {
        spec.qk_norm = true;
        KV_RETURN_IF_ERROR(RefuseFlags(f, path, {"attention_bias", "use_sliding_window"}));
    } else {
        KV_RETURN_IF_ERROR(RefuseFlags(f, path, {"attention_bias", "use_bidirectional_attention"}));
    }
    spec.qk_layout = QkLayout::kHalfSplit;
    KV_ASSIGN_OR_RETURN(spec.num_layers, f.PositiveInt("num_hidden_layers"));
    KV_ASSIGN_OR_RETURN(spec.hidden_size, f.PositiveInt("hidden_size"));
    KV_ASSIGN_OR_RETURN(spec.num_heads, f.PositiveInt("num_attention_heads"));
    KV_ASSIGN_OR_RETURN(spec.num_kv_heads, f.PositiveInt("num_key_value_heads", spec.num_heads));
    if (f.Find("head_dim") == nullptr && spec.hidden_size % spec.num_heads != 0) {
        return f.Error("hidden_size", std::to_string(spec.hidden_size) +
                                          " is not a multiple of num_attention_heads (" +
                                          std::to_string(spec.num_heads) + ") and no head_dim");
    }
    KV_ASSIGN_OR_RETURN(spec.head_dim, f.PositiveInt("head_dim", gemma ? int64_t{256}
                                                                      : spec.hidden_size /
                                                                            spec.num_heads));
    KV_ASSIGN_OR_RETURN(spec.ffn_size, f.PositiveInt("intermediate_size"));
    KV_ASSIGN_OR_RETURN(spec.vocab_size, f.PositiveInt("vocab_size"));
    KV_ASSIGN_OR_RETURN(spec.max_position, f.Int("max_position_embeddings", 0));
    if (spec.max_position < 0) {
        return f.Error("max_position_embeddings",
                       "must not be negative, got " + std::to_string(spec.max_position));
    }
    KV_ASSIGN_OR_RETURN(double theta, f.PositiveNumber("rope_theta", gemma ? 1e6 : 10000.0));
    spec.rope_theta = static_cast<float>(theta);
    KV_RETURN_IF_ERROR(ReadRopeScaling(f, path, &spec.rope_scaling));
    KV_ASSIGN_OR_RETURN(double eps, f.PositiveNumber("rms_norm_eps", 1e-6));
    spec.norm_eps = static_cast<float>(eps);
    KV_ASSIGN_OR_RETURN(spec.tied_embeddings, f.Bool("tie_word_embeddings", gemma));
    if (spec.architecture == "mistral") {
        KV_ASSIGN_OR_RETURN(spec.sliding_window, f.OptionalPositive("sliding_window"));
    } else if (gemma) {
        KV_RETURN_IF_ERROR(ReadGemma3(f, path, &spec));
    }
    KV_ASSIGN_OR_RETURN(spec.bos_token_id, f.TokenId("bos_token_id"));
    KV_ASSIGN_OR_RETURN(spec.eos_token_id, f.TokenId("eos_token_id"));
    Status valid = spec.Validate();
    if (!valid.ok()) return valid.WithContext(path);
    return spec;
}

Result<ModelSpec> ReadHfConfig(const std::string& config_json_path) {
    KV_ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_json_path));
    return ParseHfConfig(text, config_json_path);
}

std::string HfConfigText(const ModelSpec& spec, std::string_view torch_dtype) {
    const HfArchitecture* arch = &kHfArchitectures[0];
    for (const HfArchitecture& a : kHfArchitectures) {
        if (a.architecture == spec.architecture) arch = &a;
    }
    const bool gemma = spec.architecture == "gemma3";
    nlohmann::ordered_json j;
    j["architectures"] = {std::string(arch->hf_class)};
    j["model_type"] = std::string(arch->model_type);
    j["hidden_size"] = spec.hidden_size;
    j["intermediate_size"] = spec.ffn_size;
    j["num_hidden_layers"] = spec.num_layers;
    j["num_attention_heads"] = spec.num_heads;
    j["num_key_value_heads"] = spec.num_kv_heads;
    j["head_dim"] = spec.head_dim;
    j["vocab_size"] = spec.vocab_size;
    if (spec.max_position > 0) j["max_position_embeddings"] = spec.max_position;
    j[gemma ? "hidden_activation" : "hidden_act"] = gemma ? "gelu_pytorch_tanh" : "silu";
    j["rms_norm_eps"] = FloatJson(spec.norm_eps);
    j["rope_theta"] = FloatJson(spec.rope_theta);
    switch (spec.rope_scaling.type) {
        case RopeScalingType::kNone:
            j["rope_scaling"] = nullptr;
            break;
        case RopeScalingType::kLinear:
            j["rope_scaling"] = {{"rope_type", "linear"},
                                 {"factor", FloatJson(spec.rope_scaling.factor)}};
            break;
        case RopeScalingType::kLlama3:
            j["rope_scaling"] = {
                {"rope_type", "llama3"},
                {"factor", FloatJson(spec.rope_scaling.factor)},
                {"low_freq_factor", FloatJson(spec.rope_scaling.low_freq_factor)},
                {"high_freq_factor", FloatJson(spec.rope_scaling.high_freq_factor)},
                {"original_max_position_embeddings", spec.rope_scaling.original_max_position}};
            break;
    }
    if (spec.architecture == "llama" || spec.architecture == "mistral") {
        j["attention_bias"] = false;
        j["mlp_bias"] = false;
    } else if (spec.architecture != "qwen2") {
        j["attention_bias"] = false;
    }
    if (spec.architecture == "qwen2" || spec.architecture == "qwen3") {
        j["use_sliding_window"] = false;
    }
    if (spec.architecture == "mistral") {
        if (spec.sliding_window > 0) {
            j["sliding_window"] = spec.sliding_window;
        } else {
            j["sliding_window"] = nullptr;
        }
    }
    if (gemma) {
        j["sliding_window"] = spec.sliding_window;
        j["sliding_window_pattern"] = spec.sliding_window_pattern;
        std::vector<std::string> layer_types;
        for (int64_t l = 0; l < spec.num_layers; ++l) {
            layer_types.push_back(spec.IsWindowed(l) ? "sliding_attention" : "full_attention");
        }
        j["layer_types"] = layer_types;
        j["rope_local_base_freq"] = FloatJson(spec.rope_theta_local);
        j["query_pre_attn_scalar"] = spec.head_dim;
        j["attn_logit_softcapping"] = nullptr;
        j["final_logit_softcapping"] = nullptr;
    }
    j["tie_word_embeddings"] = spec.tied_embeddings;
    for (auto [key, id] : {std::pair{"bos_token_id", spec.bos_token_id},
                           std::pair{"eos_token_id", spec.eos_token_id}}) {
        if (id >= 0) {
            j[key] = id;
        } else {
            j[key] = nullptr;
        }
    }
    j["torch_dtype"] = std::string(torch_dtype);
    return j.dump(2) + "\n";
}

}  // namespace kvshard
