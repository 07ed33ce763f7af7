#include "model/hf_names.h"

#include <charconv>
#include <span>

#include "common/check.h"

namespace kvshard {
namespace {

struct NamePair {
    std::string_view hf;
    std::string_view canonical;
};

constexpr NamePair kGlobalNames[] = {
    {"model.embed_tokens.weight", "token_embd.weight"},
    {"model.norm.weight", "output_norm.weight"},
    {"lm_head.weight", "output.weight"},
};

// Per-layer names, without the "model.layers.N." / "blk.N." prefix.
constexpr NamePair kLayerNames[] = {
    {"input_layernorm.weight", "attn_norm.weight"},
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.k_proj.weight", "attn_k.weight"},
    {"self_attn.v_proj.weight", "attn_v.weight"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
    {"self_attn.q_proj.bias", "attn_q.bias"},
    {"self_attn.k_proj.bias", "attn_k.bias"},
    {"self_attn.v_proj.bias", "attn_v.bias"},
    {"self_attn.q_norm.weight", "attn_q_norm.weight"},
    {"self_attn.k_norm.weight", "attn_k_norm.weight"},
};

// Gemma 3's: norms before and after attention and the MLP.
constexpr NamePair kGemmaLayerNames[] = {
    {"input_layernorm.weight", "attn_norm.weight"},
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.k_proj.weight", "attn_k.weight"},
    {"self_attn.v_proj.weight", "attn_v.weight"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"post_attention_layernorm.weight", "post_attention_norm.weight"},
    {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
    {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
    {"self_attn.q_norm.weight", "attn_q_norm.weight"},
    {"self_attn.k_norm.weight", "attn_k_norm.weight"},
};

std::span<const NamePair> LayerNames(std::string_view architecture) {
    if (architecture == "gemma3") return kGemmaLayerNames;
    return kLayerNames;
}

// Splits "<prefix>N.<rest>" into N and rest.
bool SplitLayer(std::string_view name, std::string_view prefix, int64_t* layer,
                std::string_view* rest) {
    if (name.substr(0, prefix.size()) != prefix) return false;
    name.remove_prefix(prefix.size());
    const size_t dot = name.find('.');
    if (dot == std::string_view::npos || dot == 0) return false;
    auto [ptr, ec] = std::from_chars(name.data(), name.data() + dot, *layer);
    if (ec != std::errc() || ptr != name.data() + dot || *layer < 0) return false;
    *rest = name.substr(dot + 1);
    return true;
}

}  // namespace

std::optional<std::string> CanonicalNameFromHf(std::string_view hf_name,
                                               std::string_view architecture) {
    for (const NamePair& n : kGlobalNames) {
        if (hf_name == n.hf) return std::string(n.canonical);
    }
    int64_t layer = 0;
    std::string_view rest;
    if (!SplitLayer(hf_name, "model.layers.", &layer, &rest)) return std::nullopt;
    for (const NamePair& n : LayerNames(architecture)) {
        if (rest == n.hf) return "blk." + std::to_string(layer) + "." + std::string(n.canonical);
    }
    return std::nullopt;
}

std::string HfNameFromCanonical(std::string_view canonical, std::string_view architecture) {
    for (const NamePair& n : kGlobalNames) {
        if (canonical == n.canonical) return std::string(n.hf);
    }
    int64_t layer = 0;
    std::string_view rest;
    if (SplitLayer(canonical, "blk.", &layer, &rest)) {
        for (const NamePair& n : LayerNames(architecture)) {
            if (rest == n.canonical) {
                return "model.layers." + std::to_string(layer) + "." + std::string(n.hf);
            }
        }
    }
    KV_CHECK(false) << "not a canonical tensor name: " << canonical;
    return "";
}

}  // namespace kvshard
