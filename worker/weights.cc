#include "worker/weights.h"

#include <cstring>
#include <string>

namespace kvshard {
namespace {

// Rows `rows` of tensor `name` (all rows when rows is empty and the tensor 1-D).
Status LoadRows(const ModelFile& model, const std::string& name, const std::vector<int64_t>& shape,
                IndexRange rows, std::vector<float>* out) {
    KV_ASSIGN_OR_RETURN(const TensorInfo* t, model.GetTensor(name, shape));
    out->resize(static_cast<size_t>(rows.size() * t->NumCols()));
    DequantizeRows(*t, rows.begin, rows.size(), out->data());
    return Status::Ok();
}

Status LoadAll(const ModelFile& model, const std::string& name, const std::vector<int64_t>& shape,
               std::vector<float>* out) {
    KV_ASSIGN_OR_RETURN(const TensorInfo* t, model.GetTensor(name, shape));
    return LoadRows(model, name, shape, {0, t->NumRows()}, out);
}

// Columns `cols` of every row of the 2-D tensor `name`: each row's slice is read through a
// one-row view starting at the block that holds column cols.begin.
Status LoadColumns(const ModelFile& model, const std::string& name,
                   const std::vector<int64_t>& shape, IndexRange cols, std::vector<float>* out) {
    KV_ASSIGN_OR_RETURN(const TensorInfo* t, model.GetTensor(name, shape));
    const int64_t block = BlockElements(t->dtype);
    if (cols.begin % block != 0 || cols.size() % block != 0) {
        return InvalidArgument(
            model.path() + ": " + name + " (" + std::string(DTypeName(t->dtype)) + ", blocks of " +
            std::to_string(block) + "): columns [" + std::to_string(cols.begin) + ", " +
            std::to_string(cols.end) + ") do not start and end on a block boundary");
    }
    const int64_t rows = t->NumRows();
    out->resize(static_cast<size_t>(rows * cols.size()));
    if (cols.size() == 0) return Status::Ok();
    const size_t row_bytes = RowBytes(t->dtype, t->NumCols());
    const size_t skip_bytes = RowBytes(t->dtype, cols.begin);
    TensorInfo view;
    view.name = t->name;
    view.dtype = t->dtype;
    view.shape = {cols.size()};
    view.num_bytes = RowBytes(t->dtype, cols.size());
    for (int64_t r = 0; r < rows; ++r) {
        view.data = t->data + static_cast<size_t>(r) * row_bytes + skip_bytes;
        DequantizeRows(view, 0, 1, out->data() + r * cols.size());
    }
    return Status::Ok();
}

IndexRange Scaled(IndexRange heads, int64_t head_dim) {
    return {heads.begin * head_dim, heads.end * head_dim};
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

Result<ModelWeights> LoadWeights(const ModelFile& model, const ShardSpec& shard) {
    const ModelSpec& s = model.spec();
    const int64_t q_dim = s.num_heads * s.head_dim;
    const int64_t kv_dim = s.num_kv_heads * s.head_dim;
    ModelWeights w;
    KV_ASSIGN_OR_RETURN(w.layout, MakeShardLayout(s, shard));
    const ShardLayout& sl = w.layout;
    const IndexRange q_rows = Scaled(sl.q_heads, s.head_dim);
    const IndexRange kv_rows = Scaled(sl.kv_heads, s.head_dim);
    KV_RETURN_IF_ERROR(LoadRows(model, "token_embd.weight", {s.vocab_size, s.hidden_size}, sl.vocab,
                                &w.embedding));
    KV_RETURN_IF_ERROR(LoadAll(model, "output_norm.weight", {s.hidden_size}, &w.output_norm));
    if (!s.tied_embeddings) {
        KV_RETURN_IF_ERROR(
            LoadRows(model, "output.weight", {s.vocab_size, s.hidden_size}, sl.vocab, &w.output));
    }
    w.layers.resize(static_cast<size_t>(s.num_layers));
    for (int64_t i = 0; i < s.num_layers; ++i) {
        LayerWeights& l = w.layers[static_cast<size_t>(i)];
        auto name = [&](const char* suffix) { return LayerTensorName(i, suffix); };
        const std::vector<int64_t> hidden = {s.hidden_size};
        KV_RETURN_IF_ERROR(LoadAll(model, name("attn_norm"), hidden, &l.attn_norm));
        KV_RETURN_IF_ERROR(LoadRows(model, name("attn_q"), {q_dim, s.hidden_size}, q_rows, &l.wq));
        KV_RETURN_IF_ERROR(
            LoadRows(model, name("attn_k"), {kv_dim, s.hidden_size}, kv_rows, &l.wk));
        KV_RETURN_IF_ERROR(
            LoadRows(model, name("attn_v"), {kv_dim, s.hidden_size}, kv_rows, &l.wv));
        KV_RETURN_IF_ERROR(
            LoadColumns(model, name("attn_output"), {s.hidden_size, q_dim}, q_rows, &l.wo));
        KV_RETURN_IF_ERROR(LoadAll(model, name("ffn_norm"), hidden, &l.ffn_norm));
        KV_RETURN_IF_ERROR(
            LoadRows(model, name("ffn_gate"), {s.ffn_size, s.hidden_size}, sl.ffn, &l.w_gate));
        KV_RETURN_IF_ERROR(
            LoadRows(model, name("ffn_up"), {s.ffn_size, s.hidden_size}, sl.ffn, &l.w_up));
        KV_RETURN_IF_ERROR(
            LoadColumns(model, name("ffn_down"), {s.hidden_size, s.ffn_size}, sl.ffn, &l.w_down));
        if (s.qk_layout == QkLayout::kHalfSplit) {
            // The permutation stays inside a head, and slices are whole heads.
            HalfSplitToInterleaved(l.wq.data(), sl.num_q_heads(), s.head_dim, s.hidden_size);
            HalfSplitToInterleaved(l.wk.data(), sl.num_kv_heads(), s.head_dim, s.hidden_size);
        }
    }
    return w;
}

}  // namespace kvshard
