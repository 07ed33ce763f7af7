// ModelFile over a GGUF file (llama.cpp's format): spec from llama.* metadata, tensors as stored.
#include <cmath>
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
    model->tokenizer_data_ = std::move(tokenizer).value();
    if (model->tokenizer_data_.source.empty()) model->tokenizer_data_.source = path;
    return std::unique_ptr<ModelFile>(std::move(model));
}

Status GgufModel::ReadSpec() {
    const GgufFile& g = *gguf_;
    KV_ASSIGN_OR_RETURN(std::string arch, g.GetString("general.architecture"));
    if (arch != "llama") {
        return Unimplemented(path_ + ": architecture '" + arch +
                             "' is not supported (kvshard runs 'llama')");
    }
    const std::string p = arch + ".";
    KV_ASSIGN_OR_RETURN(int64_t experts, IntOr(g, p + "expert_count", 0));
    if (experts > 0) {
        return Unimplemented(path_ + ": mixture-of-experts models (" + p + "expert_count " +
                             std::to_string(experts) + ") are not supported");
    }
    ModelSpec& s = spec_;
    s.architecture = arch;
    s.qk_layout = QkLayout::kInterleaved;
    KV_ASSIGN_OR_RETURN(s.num_layers, g.GetInt(p + "block_count"));
    KV_ASSIGN_OR_RETURN(s.hidden_size, g.GetInt(p + "embedding_length"));
    KV_ASSIGN_OR_RETURN(s.num_heads, g.GetInt(p + "attention.head_count"));
    KV_ASSIGN_OR_RETURN(s.num_kv_heads, IntOr(g, p + "attention.head_count_kv", s.num_heads));
    KV_ASSIGN_OR_RETURN(s.ffn_size, g.GetInt(p + "feed_forward_length"));
    const int64_t default_head_dim = s.num_heads > 0 ? s.hidden_size / s.num_heads : 0;
    KV_ASSIGN_OR_RETURN(int64_t rope_dim, IntOr(g, p + "rope.dimension_count", default_head_dim));
    KV_ASSIGN_OR_RETURN(s.head_dim, IntOr(g, p + "attention.key_length", rope_dim));
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
