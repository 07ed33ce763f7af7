#include "model/synthetic_gguf.h"

#include <cstdio>
#include <vector>

#include "common/check.h"
#include "model/model_file.h"

namespace kvshard {
namespace {

// xorshift32: small, deterministic across platforms.
class Rng {
  public:
    explicit Rng(uint32_t seed) : state_(seed == 0 ? 0x9E3779B9u : seed) {}
    float Uniform() {  // [-0.5, 0.5)
        state_ ^= state_ << 13;
        state_ ^= state_ >> 17;
        state_ ^= state_ << 5;
        return static_cast<float>(state_ >> 8) / 16777216.0f - 0.5f;
    }

  private:
    uint32_t state_;
};

}  // namespace

GgufWriter SyntheticLlamaGguf(const ModelSpec& spec, const SyntheticGgufOptions& options) {
    KV_CHECK(spec.Validate().ok()) << spec.Validate().ToString();
    GgufWriter w;
    const std::string& arch = spec.architecture;
    const std::string p = arch + ".";
    w.AddString("general.architecture", arch);
    w.AddString("general.name", "synthetic");
    w.AddUInt32(p + "block_count", static_cast<uint32_t>(spec.num_layers));
    w.AddUInt32(p + "embedding_length", static_cast<uint32_t>(spec.hidden_size));
    w.AddUInt32(p + "attention.head_count", static_cast<uint32_t>(spec.num_heads));
    w.AddUInt32(p + "attention.head_count_kv", static_cast<uint32_t>(spec.num_kv_heads));
    w.AddUInt32(p + "rope.dimension_count", static_cast<uint32_t>(spec.head_dim));
    if (spec.head_dim * spec.num_heads != spec.hidden_size) {
        w.AddUInt32(p + "attention.key_length", static_cast<uint32_t>(spec.head_dim));
        w.AddUInt32(p + "attention.value_length", static_cast<uint32_t>(spec.head_dim));
    }
    w.AddUInt32(p + "feed_forward_length", static_cast<uint32_t>(spec.ffn_size));
    w.AddUInt32(p + "vocab_size", static_cast<uint32_t>(spec.vocab_size));
    if (spec.max_position > 0) {
        w.AddUInt32(p + "context_length", static_cast<uint32_t>(spec.max_position));
    }
    w.AddFloat32(p + "rope.freq_base", spec.rope_theta);
    w.AddFloat32(p + "attention.layer_norm_rms_epsilon", spec.norm_eps);
    if (spec.rope_scaling.type == RopeScalingType::kLinear) {
        w.AddString(p + "rope.scaling.type", "linear");
        w.AddFloat32(p + "rope.scaling.factor", spec.rope_scaling.factor);
    }
    if (spec.sliding_window > 0) {
        w.AddUInt32(p + "attention.sliding_window", static_cast<uint32_t>(spec.sliding_window));
        if (arch == "gemma3") {
            w.AddUInt32(p + "attention.sliding_window_pattern",
                        static_cast<uint32_t>(spec.sliding_window_pattern));
            w.AddFloat32(p + "rope.freq_base_swa", spec.rope_theta_local);
        }
    }

    std::vector<std::string> tokens = {"<unk>", "<s>", "</s>"};
    std::vector<int32_t> types = {2, 3, 3};  // unknown, control, control
    if (spec.vocab_size >= 3 + 256) {
        for (int b = 0; b < 256; ++b) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
            tokens.push_back(buf);
            types.push_back(6);  // byte
        }
    }
    const int64_t num_tokens = options.num_tokens > 0 ? options.num_tokens : spec.vocab_size;
    while (static_cast<int64_t>(tokens.size()) < num_tokens) {
        tokens.push_back("\xE2\x96\x81t" + std::to_string(tokens.size()));
        types.push_back(1);  // normal
    }
    tokens.resize(static_cast<size_t>(num_tokens));
    types.resize(tokens.size());
    std::vector<float> scores(tokens.size());
    for (size_t i = 0; i < scores.size(); ++i) scores[i] = -static_cast<float>(i);
    w.AddString("tokenizer.ggml.model", "llama");
    w.AddStringArray("tokenizer.ggml.tokens", tokens);
    w.AddFloat32Array("tokenizer.ggml.scores", scores);
    w.AddInt32Array("tokenizer.ggml.token_type", types);
    if (spec.bos_token_id >= 0) {
        w.AddUInt32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(spec.bos_token_id));
    }
    if (spec.eos_token_id >= 0) {
        w.AddUInt32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(spec.eos_token_id));
    }
    if (!spec.chat_template.empty()) w.AddString("tokenizer.chat_template", spec.chat_template);

    Rng rng(options.seed);
    for (const ExpectedTensor& e : ExpectedTensors(spec)) {
        TensorInfo shape_only;
        shape_only.shape = e.shape;
        std::vector<float> values(static_cast<size_t>(shape_only.NumElements()));
        const bool is_vector = e.shape.size() == 1;
        const bool is_norm = is_vector && !e.name.ends_with(".bias");
        for (float& v : values) {
            v = is_norm ? 1.0f + options.weight_scale * rng.Uniform()
                        : options.weight_scale * rng.Uniform();
        }
        const DType dtype =
            !is_vector && shape_only.NumCols() % BlockElements(options.weight_dtype) == 0
                ? options.weight_dtype
                : DType::kF32;
        w.AddTensorFromFloats(e.name, dtype, e.shape, values);
    }
    return w;
}

ModelSpec SyntheticArchSpec(const std::string& architecture) {
    ModelSpec s;
    s.architecture = architecture;
    s.num_layers = 2;
    s.hidden_size = 64;
    s.num_heads = 4;
    s.num_kv_heads = 2;
    s.head_dim = 16;
    s.ffn_size = 128;
    s.vocab_size = 256;  // below 3 + 256: no byte tokens (llama-server holds back the
                         // probabilities of tokens that end inside a UTF-8 character)
    s.max_position = 512;
    s.rope_theta = 10000.0f;
    s.norm_eps = 1e-5f;
    if (architecture == "llama") {
    } else if (architecture == "mistral") {
        s.sliding_window = 8;
    } else if (architecture == "qwen2") {
        s.qk_layout = QkLayout::kHalfSplit;
        s.attn_bias = true;
        s.rope_theta = 1000000.0f;
        s.norm_eps = 1e-6f;
        s.tied_embeddings = true;
    } else if (architecture == "qwen3") {
        s.qk_layout = QkLayout::kHalfSplit;
        s.qk_norm = true;
        s.head_dim = 32;
        s.rope_theta = 1000000.0f;
        s.norm_eps = 1e-6f;
    } else if (architecture == "gemma3") {
        s.qk_layout = QkLayout::kHalfSplit;
        s.num_layers = 3;
        s.num_kv_heads = 1;
        s.head_dim = 32;
        s.qk_norm = true;
        s.post_norms = true;
        s.activation = Activation::kGeluTanh;
        s.embedding_scale = 8.0f;  // sqrt(64)
        s.sliding_window = 6;
        s.sliding_window_pattern = 3;
        s.rope_theta = 1000000.0f;
        s.rope_theta_local = 10000.0f;
        s.norm_eps = 1e-6f;
        s.tied_embeddings = true;
    } else {
        KV_CHECK(false) << "no synthetic spec for architecture '" << architecture << "'";
    }
    return s;
}

GgufWriter SyntheticArchGguf(const std::string& architecture) {
    return SyntheticLlamaGguf(SyntheticArchSpec(architecture),
                              {.weight_dtype = DType::kF32, .seed = 7, .weight_scale = 0.5f});
}

}  // namespace kvshard
