#include "config/hf_config.h"

#include <charconv>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "common/mapped_file.h"
#include "config/json_fields.h"

namespace kvshard {
namespace {

using nlohmann::json;

using config_internal::Fields;

Status CheckArchitecture(const json& root, const Fields& f, const std::string& path) {
    const json* archs = f.Find("architectures");
    const json* model_type = f.Find("model_type");
    if (archs == nullptr && model_type == nullptr) {
        return f.Error("architectures", "missing (and no 'model_type' either)");
    }
    if (model_type != nullptr) {
        if (!model_type->is_string()) {
            return f.Error("model_type", "must be a string, got " + model_type->dump());
        }
        if (model_type->get<std::string>() != "llama") {
            return Unimplemented(path + ": model_type '" + model_type->get<std::string>() +
                                 "' is not supported (kvshard runs 'llama')");
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
            if (a.get<std::string>() != "LlamaForCausalLM") {
                return Unimplemented(path + ": architecture '" + a.get<std::string>() +
                                     "' is not supported (kvshard runs LlamaForCausalLM)");
            }
        }
    }
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
    KV_RETURN_IF_ERROR(CheckArchitecture(root, f, path));
    if (const json* act = f.Find("hidden_act")) {
        if (!act->is_string()) return f.Error("hidden_act", "must be a string, got " + act->dump());
        if (act->get<std::string>() != "silu") {
            return Unimplemented(path + ": hidden_act '" + act->get<std::string>() +
                                 "' is not supported (kvshard runs silu)");
        }
    }
    for (const char* bias : {"attention_bias", "mlp_bias"}) {
        KV_ASSIGN_OR_RETURN(bool has_bias, f.Bool(bias, false));
        if (has_bias) return Unimplemented(path + ": " + bias + " is not supported");
    }

    ModelSpec spec;
    spec.architecture = "llama";
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
    KV_ASSIGN_OR_RETURN(spec.head_dim,
                        f.PositiveInt("head_dim", spec.hidden_size / spec.num_heads));
    KV_ASSIGN_OR_RETURN(spec.ffn_size, f.PositiveInt("intermediate_size"));
    KV_ASSIGN_OR_RETURN(spec.vocab_size, f.PositiveInt("vocab_size"));
    KV_ASSIGN_OR_RETURN(spec.max_position, f.Int("max_position_embeddings", 0));
    if (spec.max_position < 0) {
        return f.Error("max_position_embeddings",
                       "must not be negative, got " + std::to_string(spec.max_position));
    }
    KV_ASSIGN_OR_RETURN(double theta, f.PositiveNumber("rope_theta", 10000.0));
    spec.rope_theta = static_cast<float>(theta);
    KV_RETURN_IF_ERROR(ReadRopeScaling(f, path, &spec.rope_scaling));
    KV_ASSIGN_OR_RETURN(double eps, f.PositiveNumber("rms_norm_eps", 1e-6));
    spec.norm_eps = static_cast<float>(eps);
    KV_ASSIGN_OR_RETURN(spec.tied_embeddings, f.Bool("tie_word_embeddings", false));
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
    nlohmann::ordered_json j;
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
    j["hidden_size"] = spec.hidden_size;
    j["intermediate_size"] = spec.ffn_size;
    j["num_hidden_layers"] = spec.num_layers;
    j["num_attention_heads"] = spec.num_heads;
    j["num_key_value_heads"] = spec.num_kv_heads;
    j["head_dim"] = spec.head_dim;
    j["vocab_size"] = spec.vocab_size;
    if (spec.max_position > 0) j["max_position_embeddings"] = spec.max_position;
    j["hidden_act"] = "silu";
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
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
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
