#include "worker/weights.h"

#include <cstring>
#include <string>

namespace kvshard {
namespace {

Status LoadTensor(const ModelFile& model, const std::string& name,
                  const std::vector<int64_t>& shape, std::vector<float>* out) {
    KV_ASSIGN_OR_RETURN(const TensorInfo* t, model.GetTensor(name, shape));
    out->resize(static_cast<size_t>(t->NumElements()));
    DequantizeRows(*t, 0, t->NumRows(), out->data());
    return Status::Ok();
}

}  // namespace

size_t ModelWeights::NumBytes() const {
    size_t n = embedding.size() + output_norm.size() + output.size();
    for (const LayerWeights& l : layers) {
        n += l.attn_norm.size() + l.wq.size() + l.wk.size() + l.wv.size() + l.wo.size() +
             l.ffn_norm.size() + l.w_gate.size() + l.w_up.size() + l.w_down.size();
    }
    return n * sizeof(float);
}

void HalfSplitToInterleaved(float* w, int64_t num_heads, int64_t head_dim, int64_t cols) {
    const int64_t half = head_dim / 2;
    std::vector<float> head(static_cast<size_t>(head_dim * cols));
    for (int64_t h = 0; h < num_heads; ++h) {
        float* base = w + h * head_dim * cols;
        std::memcpy(head.data(), base, head.size() * sizeof(float));
        for (int64_t i = 0; i < half; ++i) {
            for (int64_t k = 0; k < 2; ++k) {
                std::memcpy(base + (2 * i + k) * cols, head.data() + (k * half + i) * cols,
                            static_cast<size_t>(cols) * sizeof(float));
            }
        }
    }
}

Result<ModelWeights> LoadWeights(const ModelFile& model) {
    const ModelSpec& s = model.spec();
    const int64_t q_dim = s.num_heads * s.head_dim;
    const int64_t kv_dim = s.num_kv_heads * s.head_dim;
    ModelWeights w;
    KV_RETURN_IF_ERROR(LoadTensor(model, "token_embd.weight", {s.vocab_size, s.hidden_size}, &w.embedding));
    KV_RETURN_IF_ERROR(LoadTensor(model, "output_norm.weight", {s.hidden_size}, &w.output_norm));
    if (!s.tied_embeddings) {
        KV_RETURN_IF_ERROR(LoadTensor(model, "output.weight", {s.vocab_size, s.hidden_size}, &w.output));
    }
    w.layers.resize(static_cast<size_t>(s.num_layers));
    for (int64_t i = 0; i < s.num_layers; ++i) {
        LayerWeights& l = w.layers[static_cast<size_t>(i)];
        auto name = [&](const char* suffix) { return LayerTensorName(i, suffix); };
        KV_RETURN_IF_ERROR(LoadTensor(model, name("attn_norm"), {s.hidden_size}, &l.attn_norm));
        KV_RETURN_IF_ERROR(LoadTensor(model, name("attn_q"), {q_dim, s.hidden_size}, &l.wq));
        KV_RETURN_IF_ERROR(LoadTensor(model, name("attn_k"), {kv_dim, s.hidden_size}, &l.wk));
        KV_RETURN_IF_ERROR(LoadTensor(model, name("attn_v"), {kv_dim, s.hidden_size}, &l.wv));
        KV_RETURN_IF_ERROR(LoadTensor(model, name("attn_output"), {s.hidden_size, q_dim}, &l.wo));
        KV_RETURN_IF_ERROR(LoadTensor(model, name("ffn_norm"), {s.hidden_size}, &l.ffn_norm));
        KV_RETURN_IF_ERROR(LoadTensor(model, name("ffn_gate"), {s.ffn_size, s.hidden_size}, &l.w_gate));
        KV_RETURN_IF_ERROR(LoadTensor(model, name("ffn_up"), {s.ffn_size, s.hidden_size}, &l.w_up));
        KV_RETURN_IF_ERROR(LoadTensor(model, name("ffn_down"), {s.hidden_size, s.ffn_size}, &l.w_down));
        if (s.qk_layout == QkLayout::kHalfSplit) {
            HalfSplitToInterleaved(l.wq.data(), s.num_heads, s.head_dim, s.hidden_size);
            HalfSplitToInterleaved(l.wk.data(), s.num_kv_heads, s.head_dim, s.hidden_size);
        }
    }
    return w;
}

}  // namespace kvshard
