#include "worker/weights.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <string>
#include <utility>

#include "common/mapped_file.h"

namespace kvshard {
namespace {

// A slice of one file tensor that becomes consecutive rows of a backend matrix: either the rows
// `rows` (all columns) or, for a column slice, every row's columns `cols`.
struct Part {
    const TensorInfo* tensor = nullptr;
    IndexRange rows;
    IndexRange cols;
    // Q/K rows in half-split order, permuted into interleaved order head by head on the way.
    int64_t permute_head_dim = 0;

    int64_t NumRows() const { return rows.size(); }
    int64_t NumCols() const { return cols.size(); }
};

// One matrix of the arena and where its view goes.
struct Matrix {
    std::vector<Part> parts;
    std::vector<float> host;  // a vector built on the host (no parts): F32, one row
    WeightView* view = nullptr;
    DType dtype = DType::kF32;
    size_t offset = 0;
    size_t bytes = 0;
};

constexpr size_t kAlign = 64;

class ArenaPlan {
  public:
    ArenaPlan(const ModelFile& model, WeightFormat format, BackendKind formats_of)
        : model_(model), format_(format), formats_of_(formats_of) {}

    // Rows `rows` of tensor `name` (expected shape `shape`) as the next part of `*m`.
    Status AddRows(Matrix* m, const std::string& name, const std::vector<int64_t>& shape,
                   IndexRange rows, int64_t permute_head_dim = 0) {
        KV_ASSIGN_OR_RETURN(const TensorInfo* t, Checked(name, shape));
        m->parts.push_back({.tensor = t,
                            .rows = rows,
                            .cols = {0, t->NumCols()},
                            .permute_head_dim = permute_head_dim});
        return Status::Ok();
    }

    // Columns `cols` of every row of the 2-D tensor `name`.
    Status AddColumns(Matrix* m, const std::string& name, const std::vector<int64_t>& shape,
                      IndexRange cols) {
        KV_ASSIGN_OR_RETURN(const TensorInfo* t, Checked(name, shape));
        const int64_t block = BlockElements(t->dtype);
        if (cols.begin % block != 0 || cols.size() % block != 0) {
            return InvalidArgument(model_.path() + ": " + name + " (" +
                                   std::string(DTypeName(t->dtype)) + ", blocks of " +
                                   std::to_string(block) + "): columns [" +
                                   std::to_string(cols.begin) + ", " + std::to_string(cols.end) +
                                   ") do not start and end on a block boundary");
        }
        m->parts.push_back({.tensor = t, .rows = {0, t->NumRows()}, .cols = cols});
        return Status::Ok();
    }

    // A vector (norm weight): always F32.
    Status AddVector(Matrix* m, const std::string& name, int64_t size) {
        KV_RETURN_IF_ERROR(AddRows(m, name, {size}, {0, 1}));
        m->dtype = DType::kF32;
        return Status::Ok();
    }

    // A vector of `values` built on the host (sliced, permuted biases and q/k norms), as F32.
    void FinishHost(std::vector<float> values, WeightView* view) {
        Matrix m;
        m.host = std::move(values);
        m.dtype = DType::kF32;
        m.bytes = m.host.size() * sizeof(float);
        m.offset = total_;
        total_ += (m.bytes + kAlign - 1) / kAlign * kAlign;
        m.view = view;
        view->dtype = DType::kF32;
        view->rows = 1;
        view->cols = static_cast<int64_t>(m.host.size());
        matrices_.push_back(std::move(m));
    }

    // The floats of the 1-D tensor `name` of `size` elements.
    Result<std::vector<float>> ReadVector(const std::string& name, int64_t size) {
        KV_ASSIGN_OR_RETURN(const TensorInfo* t, Checked(name, {size}));
        std::vector<float> out(static_cast<size_t>(size));
        DequantizeRows(*t, 0, 1, out.data());
        return out;
    }

    // Places `m` in the arena: its dtype is the parts' common stored format, or F32, in the form
    // the backend reads for `use` (ResidentWeightFormat).
    void Finish(Matrix m, WeightView* view, WeightUse use, bool force_f32 = false) {
        DType dtype = m.parts.front().tensor->dtype;
        bool mixed = false;
        for (const Part& p : m.parts) mixed |= p.tensor->dtype != dtype;
        if (mixed) {
            spdlog::info("{}: {} and its fused parts are stored in different formats; kept as F32",
                         model_.path(), m.parts.front().tensor->name);
        }
        if (mixed || force_f32 || format_ == WeightFormat::kF32) dtype = DType::kF32;
        dtype = ResidentWeightFormat(formats_of_, dtype, use);
        if (dtype != m.parts.front().tensor->dtype && !mixed && !force_f32 &&
            format_ == WeightFormat::kStored) {
            converted_[dtype == DType::kBF16 ? 0 : 1] += 1;
        }
        m.dtype = dtype;
        int64_t rows = 0;
        for (const Part& p : m.parts) rows += p.NumRows();
        const int64_t cols = m.parts.front().NumCols();
        m.bytes = static_cast<size_t>(rows) * RowBytes(dtype, cols);
        m.offset = total_;
        total_ += (m.bytes + kAlign - 1) / kAlign * kAlign;
        m.view = view;
        view->dtype = dtype;
        view->rows = rows;
        view->cols = cols;
        matrices_.push_back(std::move(m));
    }

    size_t total_bytes() const { return total_; }
    // Matrices converted from their stored format for the backend: to BF16, to F32.
    int converted_bf16() const { return converted_[0]; }
    int converted_f32() const { return converted_[1]; }

    // Copies every matrix into `arena` (through a host staging buffer, one matrix at a time).
    Status Fill(Backend& backend, BackendBuffer& arena,
                const std::function<void(int64_t)>& on_bytes_loaded) {
        std::vector<uint8_t> staging;
        std::vector<float> row;
        auto* base = static_cast<uint8_t*>(arena.data());
        for (Matrix& m : matrices_) {
            if (m.parts.empty()) {
                KV_RETURN_IF_ERROR(backend.CopyToDevice(base + m.offset, m.host.data(), m.bytes));
                KV_RETURN_IF_ERROR(backend.Synchronize());
                m.view->data = base + m.offset;
                if (on_bytes_loaded) on_bytes_loaded(static_cast<int64_t>(m.bytes));
                continue;
            }
            staging.resize(m.bytes);
            uint8_t* dst = staging.data();
            const size_t out_row = RowBytes(m.dtype, m.view->cols);
            for (const Part& p : m.parts) {
                const TensorInfo& t = *p.tensor;
                const size_t src_row = RowBytes(t.dtype, t.NumCols());
                const size_t skip = RowBytes(t.dtype, p.cols.begin);
                for (int64_t j = 0; j < p.NumRows(); ++j, dst += out_row) {
                    int64_t r = p.rows.begin + j;
                    if (p.permute_head_dim > 0) {
                        // Interleaved row 2i+k of a head is half-split row k*head_dim/2 + i.
                        const int64_t hd = p.permute_head_dim;
                        const int64_t within = j % hd;
                        r = p.rows.begin + (j - within) + (within % 2) * (hd / 2) + within / 2;
                    }
                    const uint8_t* src = t.data + static_cast<size_t>(r) * src_row + skip;
                    if (m.dtype == t.dtype) {
                        std::memcpy(dst, src, out_row);
                    } else if (m.dtype == DType::kF32) {
                        DequantizeRow(t.dtype, src, p.NumCols(), reinterpret_cast<float*>(dst));
                    } else {
                        KV_CHECK(m.dtype == DType::kBF16) << DTypeName(m.dtype);
                        row.resize(static_cast<size_t>(p.NumCols()));
                        DequantizeRow(t.dtype, src, p.NumCols(), row.data());
                        auto* out = reinterpret_cast<uint16_t*>(dst);
                        for (size_t c = 0; c < row.size(); ++c) out[c] = FloatToBF16(row[c]);
                    }
                }
            }
            KV_RETURN_IF_ERROR(backend.CopyToDevice(base + m.offset, staging.data(), m.bytes));
            // The copy is queued: the staging buffer must live until it ran.
            KV_RETURN_IF_ERROR(backend.Synchronize());
            m.view->data = base + m.offset;
            // The file's pages of these tensors are not read again: give them back.
            for (const Part& p : m.parts) ReleaseMappedPages(p.tensor->data, p.tensor->num_bytes);
            if (on_bytes_loaded) on_bytes_loaded(static_cast<int64_t>(m.bytes));
        }
        // Once more over every tensor read: a read fault maps the file's pages around the one
        // touched (the kernel's fault-around, 64 KiB), so reading one tensor maps the edges of
        // its neighbours again after they were released: ~5 MB of the default model's file
        // stayed resident for the life of the process.
        for (const Matrix& m : matrices_) {
            for (const Part& p : m.parts) ReleaseMappedPages(p.tensor->data, p.tensor->num_bytes);
        }
        return Status::Ok();
    }

  private:
    Result<const TensorInfo*> Checked(const std::string& name, const std::vector<int64_t>& shape) {
        KV_ASSIGN_OR_RETURN(const TensorInfo* t, model_.GetTensor(name, shape));
        if (t->NumCols() % BlockElements(t->dtype) != 0 ||
            RowBytes(t->dtype, t->NumCols()) * static_cast<size_t>(t->NumRows()) > t->num_bytes) {
            return InvalidArgument(
                model_.path() + ": tensor " + name + " (" + std::string(DTypeName(t->dtype)) +
                "): " + std::to_string(t->num_bytes) + " bytes do not hold its shape");
        }
        return t;
    }

    const ModelFile& model_;
    WeightFormat format_;
    BackendKind formats_of_;
    std::vector<Matrix> matrices_;
    size_t total_ = 0;
    int converted_[2] = {0, 0};
};

IndexRange Scaled(IndexRange heads, int64_t head_dim) {
    return {heads.begin * head_dim, heads.end * head_dim};
}

// Elements [range) of `v`, each head of `permute_head_dim` (when positive) taken from half-split
// order into interleaved order, as the Q/K rows are.
void AppendSlice(const std::vector<float>& v, IndexRange range, int64_t permute_head_dim,
                 std::vector<float>* out) {
    for (int64_t j = 0; j < range.size(); ++j) {
        int64_t i = range.begin + j;
        if (permute_head_dim > 0) {
            const int64_t hd = permute_head_dim;
            const int64_t within = j % hd;
            i = range.begin + (j - within) + (within % 2) * (hd / 2) + within / 2;
        }
        out->push_back(v[static_cast<size_t>(i)]);
    }
}

}  // namespace

std::string_view WeightFormatName(WeightFormat format) {
    switch (format) {
        case WeightFormat::kStored:
            return "stored";
        case WeightFormat::kF32:
            return "f32";
    }
    return "?";
}

Result<WeightFormat> ParseWeightFormat(std::string_view name) {
    if (name == "stored") return WeightFormat::kStored;
    if (name == "f32") return WeightFormat::kF32;
    return InvalidArgument("weight format '" + std::string(name) +
                           "': expected 'stored' (as the file stores them) or 'f32'");
}

namespace {

// Every tensor of rank options.shard placed in `plan` (in the resident formats of the plan's
// backend kind), its views in `w` given their shapes; nothing copied yet.
Status PlanWeights(const ModelFile& model, const WeightLoadOptions& options, ModelWeights& w,
                   ArenaPlan& plan) {
    const ModelSpec& s = model.spec();
    const int64_t q_dim = s.num_heads * s.head_dim;
    const int64_t kv_dim = s.num_kv_heads * s.head_dim;
    w.format = options.format;
    KV_ASSIGN_OR_RETURN(w.layout, MakeShardLayout(s, options.shard));
    const ShardLayout& sl = w.layout;
    const IndexRange q_rows = Scaled(sl.q_heads, s.head_dim);
    const IndexRange kv_rows = Scaled(sl.kv_heads, s.head_dim);
    const int64_t permute = s.qk_layout == QkLayout::kHalfSplit ? s.head_dim : 0;
    const std::vector<int64_t> embd_shape = {s.vocab_size, s.hidden_size};
    {
        Matrix m;
        KV_RETURN_IF_ERROR(plan.AddRows(&m, "token_embd.weight", embd_shape, sl.vocab));
        plan.Finish(std::move(m), &w.embedding,
                    s.tied_embeddings ? WeightUse::kEmbeddingAndMatMul : WeightUse::kEmbedding);
    }
    {
        Matrix m;
        KV_RETURN_IF_ERROR(plan.AddVector(&m, "output_norm.weight", s.hidden_size));
        plan.Finish(std::move(m), &w.output_norm, WeightUse::kMatMul, /*force_f32=*/true);
    }
    if (!s.tied_embeddings) {
        Matrix m;
        KV_RETURN_IF_ERROR(plan.AddRows(&m, "output.weight", embd_shape, sl.vocab));
        plan.Finish(std::move(m), &w.output, WeightUse::kMatMul);
    }
    w.layers.resize(static_cast<size_t>(s.num_layers));
    for (int64_t i = 0; i < s.num_layers; ++i) {
        LayerWeights& l = w.layers[static_cast<size_t>(i)];
        auto name = [&](const char* suffix) { return LayerTensorName(i, suffix); };
        Matrix attn_norm, qkv, wo, ffn_norm, gate_up, down;
        KV_RETURN_IF_ERROR(plan.AddVector(&attn_norm, name("attn_norm"), s.hidden_size));
        KV_RETURN_IF_ERROR(
            plan.AddRows(&qkv, name("attn_q"), {q_dim, s.hidden_size}, q_rows, permute));
        KV_RETURN_IF_ERROR(
            plan.AddRows(&qkv, name("attn_k"), {kv_dim, s.hidden_size}, kv_rows, permute));
        KV_RETURN_IF_ERROR(plan.AddRows(&qkv, name("attn_v"), {kv_dim, s.hidden_size}, kv_rows));
        KV_RETURN_IF_ERROR(
            plan.AddColumns(&wo, name("attn_output"), {s.hidden_size, q_dim}, q_rows));
        KV_RETURN_IF_ERROR(plan.AddVector(&ffn_norm, name("ffn_norm"), s.hidden_size));
        KV_RETURN_IF_ERROR(
            plan.AddRows(&gate_up, name("ffn_gate"), {s.ffn_size, s.hidden_size}, sl.ffn));
        KV_RETURN_IF_ERROR(
            plan.AddRows(&gate_up, name("ffn_up"), {s.ffn_size, s.hidden_size}, sl.ffn));
        KV_RETURN_IF_ERROR(
            plan.AddColumns(&down, name("ffn_down"), {s.hidden_size, s.ffn_size}, sl.ffn));
        constexpr WeightUse kMat = WeightUse::kMatMul;
        plan.Finish(std::move(attn_norm), &l.attn_norm, kMat, true);
        plan.Finish(std::move(qkv), &l.qkv, kMat);
        plan.Finish(std::move(wo), &l.wo, kMat);
        plan.Finish(std::move(ffn_norm), &l.ffn_norm, kMat, true);
        plan.Finish(std::move(gate_up), &l.gate_up, kMat);
        plan.Finish(std::move(down), &l.down, kMat);
        if (s.attn_bias) {
            // One bias row for the fused QKV product: the rank's Q, K and V parts.
            const std::string blk = "blk." + std::to_string(i) + ".";
            KV_ASSIGN_OR_RETURN(std::vector<float> bq, plan.ReadVector(blk + "attn_q.bias", q_dim));
            KV_ASSIGN_OR_RETURN(std::vector<float> bk,
                                plan.ReadVector(blk + "attn_k.bias", kv_dim));
            KV_ASSIGN_OR_RETURN(std::vector<float> bv,
                                plan.ReadVector(blk + "attn_v.bias", kv_dim));
            std::vector<float> bias;
            AppendSlice(bq, q_rows, permute, &bias);
            AppendSlice(bk, kv_rows, permute, &bias);
            AppendSlice(bv, kv_rows, 0, &bias);
            plan.FinishHost(std::move(bias), &l.qkv_bias);
        }
        if (s.qk_norm) {
            const IndexRange head = {0, s.head_dim};
            for (auto [suffix, view] :
                 {std::pair{"attn_q_norm", &l.q_norm}, std::pair{"attn_k_norm", &l.k_norm}}) {
                KV_ASSIGN_OR_RETURN(std::vector<float> v,
                                    plan.ReadVector(name(suffix), s.head_dim));
                std::vector<float> permuted;
                AppendSlice(v, head, permute, &permuted);
                plan.FinishHost(std::move(permuted), view);
            }
        }
        if (s.post_norms) {
            Matrix post_attn, post_ffn;
            KV_RETURN_IF_ERROR(
                plan.AddVector(&post_attn, name("post_attention_norm"), s.hidden_size));
            KV_RETURN_IF_ERROR(plan.AddVector(&post_ffn, name("post_ffw_norm"), s.hidden_size));
            plan.Finish(std::move(post_attn), &l.post_attn_norm, kMat, true);
            plan.Finish(std::move(post_ffn), &l.post_ffn_norm, kMat, true);
        }
    }
    return Status::Ok();
}

}  // namespace

Result<int64_t> ResidentWeightBytes(const ModelFile& model, BackendKind kind,
                                    const WeightLoadOptions& options) {
    ModelWeights w;
    ArenaPlan plan(model, options.format, options.formats_of.value_or(kind));
    KV_RETURN_IF_ERROR(PlanWeights(model, options, w, plan));
    return static_cast<int64_t>(plan.total_bytes());
}

Result<ModelWeights> LoadWeights(const ModelFile& model, Backend& backend,
                                 const WeightLoadOptions& options) {
    ModelWeights w;
    ArenaPlan plan(model, options.format, options.formats_of.value_or(backend.kind()));
    KV_RETURN_IF_ERROR(PlanWeights(model, options, w, plan));
    if (plan.converted_bf16() + plan.converted_f32() > 0) {
        spdlog::info(
            "{}: {} matrices converted to BF16 and {} to F32 at load for the {} backend "
            "({} bytes resident, no stored-format copy kept)",
            model.path(), plan.converted_bf16(), plan.converted_f32(),
            BackendKindName(options.formats_of.value_or(backend.kind())), plan.total_bytes());
    }
    KV_ASSIGN_OR_RETURN(w.arena,
                        backend.Allocate(plan.total_bytes(), Backend::BufferUse::kResident));
    KV_RETURN_IF_ERROR(plan.Fill(backend, w.arena, options.on_bytes_loaded));
    return w;
}

std::vector<float> ReadWeightRows(Backend& backend, const WeightView& w) {
    const size_t row_bytes = RowBytes(w.dtype, w.cols);
    std::vector<uint8_t> bytes(row_bytes * static_cast<size_t>(w.rows));
    KV_CHECK(backend.CopyToHost(bytes.data(), w.data, bytes.size()).ok());
    KV_CHECK(backend.Synchronize().ok());
    std::vector<float> out(static_cast<size_t>(w.rows * w.cols));
    for (int64_t r = 0; r < w.rows; ++r) {
        DequantizeRow(w.dtype, bytes.data() + static_cast<size_t>(r) * row_bytes, w.cols,
                      out.data() + r * w.cols);
    }
    return out;
}

}  // namespace kvshard
