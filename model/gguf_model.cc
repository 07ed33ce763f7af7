// ModelFile over a GGUF file (llama.cpp's format): spec from llama.* metadata, tensors as stored.
#include <cmath>
#include <cstdio>
#include <vector>

#include "model/gguf.h"
#include "model/model_file_internal.h"
#include "model/tokenizer_data.h"

namespace kvshard::internal {
namespace {

class GgufModel : public ModelFile {
  public:
    static Result<std::unique_ptr<ModelFile>> Open(const std::string& path);

    ModelFormat format() const override { return ModelFormat::kGguf; }
    const TensorInfo* FindTensor(std::string_view name) const override {
        return gguf_->FindTensor(name);
    }
    std::vector<std::string> TensorNames() const override {
        std::vector<std::string> names;
        for (const TensorInfo& t : gguf_->tensors()) names.push_back(t.name);
        return names;
    }

  private:
    Status ReadSpec();
    Status ReadRopeScaling();

    std::unique_ptr<GgufFile> gguf_;
};

Result<int64_t> IntOr(const GgufFile& g, const std::string& key, int64_t default_value) {
    if (!g.Has(key)) return default_value;
    return g.GetInt(key);
}

Result<double> FloatOr(const GgufFile& g, const std::string& key, double default_value) {
    if (!g.Has(key)) return default_value;
    return g.GetFloat(key);
}

Result<int32_t> TokenIdOr(const GgufFile& g, const std::string& key) {
    KV_ASSIGN_OR_RETURN(int64_t id, IntOr(g, key, -1));
    if (id < -1 || id > INT32_MAX) {
        return InvalidArgument(g.path() + ": key '" + key + "': token id " + std::to_string(id));
    }
    return static_cast<int32_t>(id);
}

// Llama 3.1 RoPE scaling: llama.cpp's converter stores the per-frequency factors as the tensor
// rope_freqs.weight instead of the parameters. The factors of Meta's parameters (low 1, high 4,
// original context 8192, factor = the largest factor) are recomputed and compared.
bool MatchesLlama3Factors(const std::vector<float>& factors, const ModelSpec& spec,
                          RopeScaling* out) {
    RopeScaling rs;
    rs.type = RopeScalingType::kLlama3;
    rs.factor = 1.0f;
    for (float f : factors) rs.factor = std::max(rs.factor, f);
    rs.low_freq_factor = 1.0f;
    rs.high_freq_factor = 4.0f;
    rs.original_max_position = 8192;
    const double low_wavelen = rs.original_max_position / rs.low_freq_factor;
    const double high_wavelen = rs.original_max_position / rs.high_freq_factor;
    for (size_t i = 0; i < factors.size(); ++i) {
        const double freq =
            1.0 / std::pow(static_cast<double>(spec.rope_theta),
                           static_cast<double>(2 * i) / static_cast<double>(spec.head_dim));
        const double wavelen = 2 * M_PI / freq;
        double expected;
        if (wavelen < high_wavelen) {
            expected = 1;
        } else if (wavelen > low_wavelen) {
            expected = rs.factor;
        } else {
            const double smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) /
                                  (rs.high_freq_factor - rs.low_freq_factor);
            expected = 1 / ((1 - smooth) / rs.factor + smooth);
        }
        if (std::fabs(factors[i] - expected) > 1e-3 * expected) return false;
    }
    *out = rs;
    return true;
}

Result<std::unique_ptr<ModelFile>> GgufModel::Open(const std::string& path) {
    std::unique_ptr<GgufModel> model(new GgufModel());
    KV_ASSIGN_OR_RETURN(model->gguf_, GgufFile::Open(path));
    model->path_ = path;
    KV_RETURN_IF_ERROR(model->ReadSpec());
    Result<TokenizerData> tokenizer = TokenizerDataFromGguf(*model->gguf_);
    if (!tokenizer.ok()) return NameFile(tokenizer.status(), path);
    *model->tokenizer_data_ = std::move(tokenizer).value();
    if (model->tokenizer_data_->source.empty()) model->tokenizer_data_->source = path;
    // The spec and the tokenizer's data hold all this model reads of the metadata.
    model->gguf_->DropMetadata();
    return std::unique_ptr<ModelFile>(std::move(model));
}

// Keys of features kvshard does not implement: present (and not zero) means the file is refused,
// never run without them.
Status RefuseUnsupportedKeys(const GgufFile& g, const std::string& path, const std::string& p) {
    struct Refused {
        const char* key;
        const char* what;
    };
    static constexpr Refused kRefused[] = {
        {"expert_count", "mixture-of-experts models"},
        {"attention.kv_lora_rank", "multi-head latent attention (MLA)"},
        {"attention.q_lora_rank", "multi-head latent attention (MLA)"},
        {"attn_logit_softcapping", "attention logit soft-capping"},
        {"final_logit_softcapping", "final logit soft-capping"},
    };
    for (const Refused& r : kRefused) {
        const std::string key = p + r.key;
        if (!g.Has(key)) continue;
        KV_ASSIGN_OR_RETURN(double value, g.GetFloat(key));
        if (value == 0) continue;
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%g", value);
        return Unimplemented(path + ": " + key + " = " + buf + ": " + r.what +
                             " are not supported");
    }
    return Status::Ok();
}

Status GgufModel::ReadSpec() {
    const GgufFile& g = *gguf_;
    KV_ASSIGN_OR_RETURN(std::string arch, g.GetString("general.architecture"));
    if (!IsSupportedArchitecture(arch)) {
        return Unimplemented(path_ + ": general.architecture = '" + arch +
                             "' is not supported (kvshard runs llama, mistral, qwen2, qwen3, "
                             "gemma3)");
    }
    const std::string p = arch + ".";
    KV_RETURN_IF_ERROR(RefuseUnsupportedKeys(g, path_, p));
    ModelSpec& s = spec_;
    s.architecture = arch;
    // llama.cpp's converters permute Llama's (and Mistral's) Q/K rows into interleaved RoPE pairs
    // and leave the others in Hugging Face's order (llama.cpp's NEOX RoPE).
    const bool neox = arch == "qwen2" || arch == "qwen3" || arch == "gemma3";
    s.qk_layout = neox ? QkLayout::kHalfSplit : QkLayout::kInterleaved;
    s.attn_bias = g.FindTensor("blk.0.attn_q.bias") != nullptr;
    s.qk_norm = arch == "qwen3" || arch == "gemma3";
    if (arch == "llama" || arch == "mistral" || arch == "gemma3") {
        KV_ASSIGN_OR_RETURN(s.sliding_window, IntOr(g, p + "attention.sliding_window", 0));
    }
    if (arch == "gemma3") {
        s.post_norms = true;
        s.activation = Activation::kGeluTanh;
        if (s.sliding_window > 0) {
            const std::string key = p + "attention.sliding_window_pattern";
            if (g.Has(key) && !g.GetInt(key).ok()) {
                return Unimplemented(path_ + ": " + key +
                                     " as a per-layer list is not supported (a period is)");
            }
            KV_ASSIGN_OR_RETURN(s.sliding_window_pattern, IntOr(g, key, 6));
            KV_ASSIGN_OR_RETURN(double local_theta, FloatOr(g, p + "rope.freq_base_swa", 10000.0));
            s.rope_theta_local = static_cast<float>(local_theta);
        }
    }
    KV_ASSIGN_OR_RETURN(s.num_layers, g.GetInt(p + "block_count"));
    KV_ASSIGN_OR_RETURN(s.hidden_size, g.GetInt(p + "embedding_length"));
    KV_ASSIGN_OR_RETURN(s.num_heads, g.GetInt(p + "attention.head_count"));
    KV_ASSIGN_OR_RETURN(s.num_kv_heads, IntOr(g, p + "attention.head_count_kv", s.num_heads));
    KV_ASSIGN_OR_RETURN(s.ffn_size, g.GetInt(p + "feed_forward_length"));
    const int64_t default_head_dim = s.num_heads > 0 ? s.hidden_size / s.num_heads : 0;
    KV_ASSIGN_OR_RETURN(int64_t rope_dim_or_default,
                        IntOr(g, p + "rope.dimension_count", default_head_dim));
    // An explicit head width (qwen3, gemma3) need not be hidden / heads; RoPE then covers it.
    KV_ASSIGN_OR_RETURN(s.head_dim, IntOr(g, p + "attention.key_length", rope_dim_or_default));
    KV_ASSIGN_OR_RETURN(int64_t rope_dim, IntOr(g, p + "rope.dimension_count", s.head_dim));
    KV_ASSIGN_OR_RETURN(int64_t value_dim, IntOr(g, p + "attention.value_length", s.head_dim));
    if (rope_dim != s.head_dim || value_dim != s.head_dim) {
        return Unimplemented(path_ + ": head_dim " + std::to_string(s.head_dim) +
                             " with rope dimension " + std::to_string(rope_dim) +
                             " and value length " + std::to_string(value_dim) +
                             " (kvshard needs all three equal)");
    }
    if (g.Has(p + "vocab_size")) {
        KV_ASSIGN_OR_RETURN(s.vocab_size, g.GetInt(p + "vocab_size"));
    } else if (g.Has("tokenizer.ggml.tokens")) {
        KV_ASSIGN_OR_RETURN(std::vector<std::string> tokens,
                            g.GetStringArray("tokenizer.ggml.tokens"));
        s.vocab_size = static_cast<int64_t>(tokens.size());
    } else {
        return InvalidArgument(path_ + ": neither " + p +
                               "vocab_size nor tokenizer.ggml.tokens gives the vocabulary size");
    }
    KV_ASSIGN_OR_RETURN(s.max_position, IntOr(g, p + "context_length", 0));
    KV_ASSIGN_OR_RETURN(double theta, FloatOr(g, p + "rope.freq_base", 10000.0));
    s.rope_theta = static_cast<float>(theta);
    KV_ASSIGN_OR_RETURN(double eps, FloatOr(g, p + "attention.layer_norm_rms_epsilon", 1e-5));
    s.norm_eps = static_cast<float>(eps);
    if (arch == "gemma3") {
        s.embedding_scale = std::sqrt(static_cast<float>(s.hidden_size));
        // llama.cpp scales Gemma 3 27B's queries by 1/sqrt(hidden / heads), not 1/sqrt(head_dim).
        if (s.num_layers == 62 && s.num_heads > 0 && s.hidden_size / s.num_heads != s.head_dim) {
            return Unimplemented(path_ + ": " + p +
                                 "block_count = 62 (Gemma 3 27B): its attention scale "
                                 "1/sqrt(hidden / heads) is not supported");
        }
    }
    s.tied_embeddings = g.FindTensor("output.weight") == nullptr;
    KV_ASSIGN_OR_RETURN(s.bos_token_id, TokenIdOr(g, "tokenizer.ggml.bos_token_id"));
    KV_ASSIGN_OR_RETURN(s.eos_token_id, TokenIdOr(g, "tokenizer.ggml.eos_token_id"));
    if (g.Has("tokenizer.chat_template")) {
        KV_ASSIGN_OR_RETURN(s.chat_template, g.GetString("tokenizer.chat_template"));
    }
    return ReadRopeScaling();
}

Status GgufModel::ReadRopeScaling() {
    const GgufFile& g = *gguf_;
    const std::string p = spec_.architecture + ".";
    std::string type = "none";
    if (g.Has(p + "rope.scaling.type")) {
        KV_ASSIGN_OR_RETURN(type, g.GetString(p + "rope.scaling.type"));
    }
    if (type == "linear") {
        KV_ASSIGN_OR_RETURN(double factor, g.GetFloat(p + "rope.scaling.factor"));
        if (!(factor > 0)) {
            return InvalidArgument(path_ + ": " + p + "rope.scaling.factor must be positive");
        }
        spec_.rope_scaling.type = RopeScalingType::kLinear;
        spec_.rope_scaling.factor = static_cast<float>(factor);
    } else if (type != "none") {
        return Unimplemented(path_ + ": rope scaling type '" + type +
                             "' is not supported (linear is)");
    }
    const TensorInfo* freqs = g.FindTensor("rope_freqs.weight");
    if (freqs == nullptr) return Status::Ok();
    if (spec_.rope_scaling.type != RopeScalingType::kNone || spec_.head_dim <= 0 ||
        freqs->shape != std::vector<int64_t>{spec_.head_dim / 2}) {
        return Unimplemented(path_ + ": rope_freqs.weight " + ShapeString(freqs->shape) +
                             " with this rope configuration is not supported");
    }
    std::vector<float> factors(static_cast<size_t>(freqs->NumElements()));
    DequantizeRows(*freqs, 0, 1, factors.data());
    if (!MatchesLlama3Factors(factors, spec_, &spec_.rope_scaling)) {
        return Unimplemented(path_ +
                             ": rope_freqs.weight does not match Llama 3 rope scaling (low 1, "
                             "high 4, original context 8192)");
    }
    return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ModelFile>> OpenGgufModel(const std::string& path) {
    return GgufModel::Open(path);
}

}  // namespace kvshard::internal
