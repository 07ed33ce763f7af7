#include "config/arch_config.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/mapped_file.h"
#include "config/json_fields.h"

namespace kvshard {
namespace {

using nlohmann::json;

std::string Str(int64_t v) { return std::to_string(v); }

using config_internal::Fields;

// Values transformers' config class uses when config.json leaves a field out. Only Gemma 3's
// multimodal checkpoints rely on this in practice: their text_config lists just what differs
// from Gemma3TextConfig's defaults (gemma-3-4b-it omits even num_attention_heads).
struct Defaults {
    std::optional<int64_t> hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
        head_dim, vocab_size, max_position, sliding_window;
    bool tied_embeddings = false;
};

Defaults DefaultsFor(std::string_view model_type) {
    Defaults d;
    if (model_type == "gemma3_text") {
        // transformers Gemma3TextConfig.__init__ defaults.
        d.vocab_size = 262208;
        d.hidden_size = 2304;
        d.intermediate_size = 9216;
        d.num_layers = 26;
        d.num_heads = 8;
        d.num_kv_heads = 4;
        d.head_dim = 256;
        d.max_position = 131072;
        d.sliding_window = 4096;
        d.tied_embeddings = true;
    } else if (model_type == "gemma2") {
        d.tied_embeddings = true;
    }
    return d;
}

bool IsOneOf(std::string_view s, std::initializer_list<std::string_view> names) {
    return std::find(names.begin(), names.end(), s) != names.end();
}

Status ReadCommon(const Fields& f, const Defaults& d, ArchConfig& c) {
    KV_ASSIGN_OR_RETURN(c.num_layers, f.Positive("num_hidden_layers", d.num_layers));
    KV_ASSIGN_OR_RETURN(c.hidden_size, f.Positive("hidden_size", d.hidden_size));
    KV_ASSIGN_OR_RETURN(c.num_heads, f.Positive("num_attention_heads", d.num_heads));
    KV_ASSIGN_OR_RETURN(c.num_kv_heads,
                        f.Positive("num_key_value_heads", d.num_kv_heads.value_or(c.num_heads)));
    std::optional<int64_t> head_dim_default = d.head_dim;
    if (!head_dim_default && c.hidden_size % c.num_heads == 0) {
        head_dim_default = c.hidden_size / c.num_heads;
    }
    if (f.Find("head_dim") == nullptr && !head_dim_default) {
        return f.Error("head_dim", "missing, and hidden_size " + Str(c.hidden_size) +
                                       " is not a multiple of num_attention_heads " +
                                       Str(c.num_heads));
    }
    KV_ASSIGN_OR_RETURN(c.head_dim, f.Positive("head_dim", head_dim_default));
    KV_ASSIGN_OR_RETURN(c.intermediate_size, f.Positive("intermediate_size", d.intermediate_size));
    KV_ASSIGN_OR_RETURN(c.vocab_size, f.Positive("vocab_size", d.vocab_size));
    KV_ASSIGN_OR_RETURN(c.max_position,
                        f.NonNegative("max_position_embeddings", d.max_position.value_or(0)));
    KV_ASSIGN_OR_RETURN(c.tied_embeddings, f.Bool("tie_word_embeddings", d.tied_embeddings));
    if (c.num_heads % c.num_kv_heads != 0) {
        return f.Error(
            "num_key_value_heads",
            Str(c.num_kv_heads) + " does not divide num_attention_heads " + Str(c.num_heads));
    }
    c.layer_attention.assign(static_cast<size_t>(c.num_layers), LayerAttention::kGlobal);
    c.moe_layers.assign(static_cast<size_t>(c.num_layers), false);
    return Status::Ok();
}

// Qwen2/3 (dense and MoE): sliding only when use_sliding_window, on layers >= max_window_layers.
Status ReadQwenWindows(const Fields& f, ArchConfig& c) {
    KV_ASSIGN_OR_RETURN(bool use, f.Bool("use_sliding_window", false));
    if (!use) return Status::Ok();
    KV_ASSIGN_OR_RETURN(c.sliding_window, f.Positive("sliding_window"));
    KV_ASSIGN_OR_RETURN(int64_t max_window_layers, f.NonNegative("max_window_layers", 0));
    for (int64_t i = max_window_layers; i < c.num_layers; ++i) {
        c.layer_attention[static_cast<size_t>(i)] = LayerAttention::kSliding;
    }
    return Status::Ok();
}

// Qwen2-MoE / Qwen3-MoE experts.
Status ReadQwenMoe(const Fields& f, ArchConfig& c) {
    KV_ASSIGN_OR_RETURN(c.moe.num_routed_experts, f.Positive("num_experts"));
    KV_ASSIGN_OR_RETURN(c.moe.expert_intermediate_size, f.Positive("moe_intermediate_size"));
    KV_ASSIGN_OR_RETURN(int64_t sparse_step, f.Positive("decoder_sparse_step", 1));
    KV_ASSIGN_OR_RETURN(std::vector<int64_t> mlp_only, f.IntList("mlp_only_layers"));
    for (int64_t i = 0; i < c.num_layers; ++i) {
        const bool dense = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end();
        c.moe_layers[static_cast<size_t>(i)] = !dense && (i + 1) % sparse_step == 0;
    }
    if (c.model_type == "qwen2_moe") {
        KV_ASSIGN_OR_RETURN(c.moe.shared_intermediate_size,
                            f.OptionalPositive("shared_expert_intermediate_size"));
        c.moe.shared_expert_gate = c.moe.shared_intermediate_size > 0;
    }
    return Status::Ok();
}

Status ReadDeepSeek(const Fields& f, ArchConfig& c) {
    if (f.Find("kv_lora_rank") != nullptr) {
        c.attention = AttentionKind::kMultiLatent;
        KV_ASSIGN_OR_RETURN(c.mla.kv_lora_rank, f.Positive("kv_lora_rank"));
        KV_ASSIGN_OR_RETURN(c.mla.q_lora_rank, f.OptionalPositive("q_lora_rank"));
        KV_ASSIGN_OR_RETURN(c.mla.qk_nope_head_dim, f.Positive("qk_nope_head_dim"));
        KV_ASSIGN_OR_RETURN(c.mla.qk_rope_head_dim, f.Positive("qk_rope_head_dim"));
        KV_ASSIGN_OR_RETURN(c.mla.v_head_dim, f.Positive("v_head_dim"));
        c.num_kv_heads = c.num_heads;
    }
    KV_ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("attention_bias", false));
    KV_ASSIGN_OR_RETURN(c.moe.num_routed_experts, f.OptionalPositive("n_routed_experts"));
    if (c.moe.num_routed_experts > 0) {
        KV_ASSIGN_OR_RETURN(c.moe.expert_intermediate_size, f.Positive("moe_intermediate_size"));
        KV_ASSIGN_OR_RETURN(int64_t shared, f.NonNegative("n_shared_experts", 0));
        c.moe.shared_intermediate_size = shared * c.moe.expert_intermediate_size;
        KV_ASSIGN_OR_RETURN(int64_t first_dense, f.NonNegative("first_k_dense_replace", 0));
        KV_ASSIGN_OR_RETURN(int64_t freq, f.Positive("moe_layer_freq", 1));
        for (int64_t i = 0; i < c.num_layers; ++i) {
            c.moe_layers[static_cast<size_t>(i)] = i >= first_dense && i % freq == 0;
        }
        KV_ASSIGN_OR_RETURN(std::string topk_method, f.String("topk_method", ""));
        c.moe.router_bias = topk_method == "noaux_tc";
    }
    KV_ASSIGN_OR_RETURN(int64_t mtp, f.NonNegative("num_nextn_predict_layers", 0));
    if (mtp > 0) {
        c.notes.push_back(Str(mtp) +
                          " multi-token-prediction layer(s) (num_nextn_predict_layers) are not "
                          "counted: they serve only speculative decoding");
    }
    return Status::Ok();
}

// "layer_types" (transformers >= 4.53 writes it for many models) overrides any pattern.
Status ReadLayerTypes(const Fields& f, ArchConfig& c) {
    const json* types = f.Find("layer_types");
    if (types == nullptr) return Status::Ok();
    if (!types->is_array() || static_cast<int64_t>(types->size()) != c.num_layers) {
        return f.Error("layer_types", "must be a list of " + Str(c.num_layers) +
                                          " strings (num_hidden_layers), got " + types->dump());
    }
    for (size_t i = 0; i < types->size(); ++i) {
        const json& t = (*types)[i];
        const std::string name = t.is_string() ? t.get<std::string>() : t.dump();
        if (name == "full_attention") {
            c.layer_attention[i] = LayerAttention::kGlobal;
        } else if (name == "sliding_attention") {
            c.layer_attention[i] = LayerAttention::kSliding;
        } else {
            return Unimplemented(f.Error("layer_types", "layer " + Str(static_cast<int64_t>(i)) +
                                                            " has type '" + name +
                                                            "'; the planner knows full_attention "
                                                            "and sliding_attention")
                                     .message());
        }
    }
    if (c.NumSlidingLayers() > 0 && c.sliding_window <= 0) {
        KV_ASSIGN_OR_RETURN(c.sliding_window, f.Positive("sliding_window"));
    }
    return Status::Ok();
}

bool IsKnownModelType(std::string_view t) {
    return IsOneOf(t, {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                       "gemma2", "gemma3_text", "deepseek_v2", "deepseek_v3"});
}

Status ReadText(const Fields& f, ArchConfig& c) {
    const std::string& t = c.model_type;
    if (!IsKnownModelType(t)) {
        return Unimplemented(c.path + ": model_type '" + t +
                             "' is not one the planner reads (llama, mistral, mixtral, qwen2, "
                             "qwen2_moe, qwen3, qwen3_moe, gemma2, gemma3, gemma3_text, "
                             "deepseek_v2, deepseek_v3)");
    }
    const Defaults d = DefaultsFor(t);
    KV_RETURN_IF_ERROR(ReadCommon(f, d, c));
    if (IsOneOf(t, {"llama", "mistral", "mixtral"})) {
        KV_ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("attention_bias", false));
        c.o_bias = c.qkv_bias;
        KV_ASSIGN_OR_RETURN(c.mlp_bias, f.Bool("mlp_bias", false));
        if (t != "llama") {
            KV_ASSIGN_OR_RETURN(c.sliding_window, f.OptionalPositive("sliding_window"));
            if (c.sliding_window > 0) {
                std::fill(c.layer_attention.begin(), c.layer_attention.end(),
                          LayerAttention::kSliding);
            }
        }
        if (t == "mixtral") {
            KV_ASSIGN_OR_RETURN(c.moe.num_routed_experts, f.Positive("num_local_experts"));
            c.moe.expert_intermediate_size = c.intermediate_size;
            std::fill(c.moe_layers.begin(), c.moe_layers.end(), true);
        }
    } else if (IsOneOf(t, {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})) {
        if (t.starts_with("qwen2")) {
            c.qkv_bias = true;  // Qwen2 always has q/k/v biases; its configs carry no flag
        } else {
            KV_ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("attention_bias", false));
            c.o_bias = c.qkv_bias;
            c.qk_norm = true;
        }
        KV_RETURN_IF_ERROR(ReadQwenWindows(f, c));
        if (t.ends_with("_moe")) KV_RETURN_IF_ERROR(ReadQwenMoe(f, c));
    } else if (t == "gemma2") {
        c.norms_per_layer = 4;
        KV_ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("attention_bias", false));
        c.o_bias = c.qkv_bias;
        KV_ASSIGN_OR_RETURN(c.sliding_window, f.Positive("sliding_window"));
        for (int64_t i = 0; i < c.num_layers; i += 2) {
            c.layer_attention[static_cast<size_t>(i)] = LayerAttention::kSliding;
        }
    } else if (t == "gemma3_text") {
        c.norms_per_layer = 4;
        c.qk_norm = true;
        KV_ASSIGN_OR_RETURN(c.qkv_bias, f.Bool("attention_bias", false));
        c.o_bias = c.qkv_bias;
        KV_ASSIGN_OR_RETURN(c.sliding_window, f.Positive("sliding_window", d.sliding_window));
        KV_ASSIGN_OR_RETURN(int64_t pattern, f.Positive("sliding_window_pattern", 6));
        for (int64_t i = 0; i < c.num_layers; ++i) {
            if ((i + 1) % pattern != 0) {
                c.layer_attention[static_cast<size_t>(i)] = LayerAttention::kSliding;
            }
        }
    } else {  // deepseek_v2, deepseek_v3
        KV_RETURN_IF_ERROR(ReadDeepSeek(f, c));
    }
    KV_RETURN_IF_ERROR(ReadLayerTypes(f, c));
    if (c.NumSlidingLayers() == 0) c.sliding_window = 0;
    return Status::Ok();
}

}  // namespace

int64_t ArchConfig::NumSlidingLayers() const {
    return std::count(layer_attention.begin(), layer_attention.end(), LayerAttention::kSliding);
}

int64_t ArchConfig::NumMoeLayers() const {
    return std::count(moe_layers.begin(), moe_layers.end(), true);
}

Result<ArchConfig> ParseArchConfig(std::string_view json_text, const std::string& path) {
    json root = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded()) return InvalidArgument(path + ": not valid JSON");
    if (!root.is_object()) return InvalidArgument(path + ": not a JSON object");
    ArchConfig c;
    c.path = path;
    Fields top(root, path, "");
    if (const json* archs = top.Find("architectures");
        archs != nullptr && archs->is_array() && !archs->empty() && (*archs)[0].is_string()) {
        c.architecture = (*archs)[0].get<std::string>();
    }
    KV_ASSIGN_OR_RETURN(c.model_type, top.String("model_type", std::nullopt));
    if (top.Find("quantization_config") != nullptr) {
        c.notes.push_back(
            "the file has a quantization_config: weight bytes follow --weight-dtype, not it");
    }
    if (c.model_type != "gemma3") {
        KV_RETURN_IF_ERROR(ReadText(top, c));
        return c;
    }
    // Gemma 3 multimodal (Gemma3ForConditionalGeneration): the language model is text_config.
    const json* text = top.Find("text_config");
    if (text == nullptr || !text->is_object()) {
        return top.Error("text_config", text == nullptr ? "missing" : "must be an object");
    }
    if (top.Find("vision_config") != nullptr) {
        c.notes.push_back("the vision tower (vision_config) is not counted");
    }
    Fields f(*text, path, "text_config.");
    KV_ASSIGN_OR_RETURN(c.model_type, f.String("model_type", "gemma3_text"));
    if (c.model_type != "gemma3_text") {
        return f.Error("model_type", "expected 'gemma3_text', got '" + c.model_type + "'");
    }
    KV_RETURN_IF_ERROR(ReadText(f, c));
    return c;
}

Result<ArchConfig> ReadArchConfig(const std::string& path) {
    KV_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
    return ParseArchConfig(text, path);
}

}  // namespace kvshard
