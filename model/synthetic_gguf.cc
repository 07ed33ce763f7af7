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
    w.AddString("general.architecture", "llama");
    w.AddString("general.name", "synthetic");
    w.AddUInt32("llama.block_count", static_cast<uint32_t>(spec.num_layers));
    w.AddUInt32("llama.embedding_length", static_cast<uint32_t>(spec.hidden_size));
    w.AddUInt32("llama.attention.head_count", static_cast<uint32_t>(spec.num_heads));
    w.AddUInt32("llama.attention.head_count_kv", static_cast<uint32_t>(spec.num_kv_heads));
    w.AddUInt32("llama.rope.dimension_count", static_cast<uint32_t>(spec.head_dim));
    w.AddUInt32("llama.feed_forward_length", static_cast<uint32_t>(spec.ffn_size));
    w.AddUInt32("llama.vocab_size", static_cast<uint32_t>(spec.vocab_size));
    if (spec.max_position > 0) {
        w.AddUInt32("llama.context_length", static_cast<uint32_t>(spec.max_position));
    }
    w.AddFloat32("llama.rope.freq_base", spec.rope_theta);
    w.AddFloat32("llama.attention.layer_norm_rms_epsilon", spec.norm_eps);
    if (spec.rope_scaling.type == RopeScalingType::kLinear) {
        w.AddString("llama.rope.scaling.type", "linear");
        w.AddFloat32("llama.rope.scaling.factor", spec.rope_scaling.factor);
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
        const bool is_norm = e.shape.size() == 1;
        for (float& v : values) {
            v = is_norm ? 1.0f + options.weight_scale * rng.Uniform()
                        : options.weight_scale * rng.Uniform();
        }
        const DType dtype =
            !is_norm && shape_only.NumCols() % BlockElements(options.weight_dtype) == 0
                ? options.weight_dtype
                : DType::kF32;
        w.AddTensorFromFloats(e.name, dtype, e.shape, values);
    }
    return w;
}

}  // namespace kvshard
