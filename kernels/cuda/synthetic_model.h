// What kernels/cuda/synthetic_decode.h and kernels/cuda/synthetic_prefill.h share: the
// Llama-shaped model (DecodeShape), its random bf16 weights generated on the backend
// (SyntheticWeights: the same matrices on every backend for a seed), the step buffers'
// allocator (SyntheticBuffers) and a step's inputs, scratch, KV pool and layer loop
// (SyntheticStep). Header-only. Not thread-safe.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/cpu_ops.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {

struct DecodeShape {
    int64_t layers = 32;
    int64_t hidden = 4096;
    int64_t heads = 32;
    int64_t kv_heads = 8;
    int64_t head_dim = 128;
    int64_t ffn = 14336;
    int64_t vocab = 128256;
    int64_t block_size = 16;
    float rope_theta = 500000.0f;
    KvDtype kv_dtype = KvDtype::kBf16;  // the KV pool's storage, as GPU engines keep it

    static DecodeShape Llama3_8B() { return {}; }
    int64_t qkv_rows() const { return (heads + 2 * kv_heads) * head_dim; }
    // Weight elements of one layer's four matrices (QKV, O, gate|up, down).
    int64_t layer_weight_elements() const {
        return qkv_rows() * hidden + hidden * heads * head_dim + 2 * ffn * hidden + hidden * ffn;
    }
    // bf16 weight bytes one step reads (every matrix once).
    int64_t weight_bytes() const { return 2 * (layers * layer_weight_elements() + 2 * vocab * hidden); }
};

// Device buffers owned together: host vectors copied up, fp32 scratch.
class SyntheticBuffers {
  public:
    explicit SyntheticBuffers(Backend& b) : b_(&b) {}

    template <typename T>
    Result<T*> Put(const std::vector<T>& host) {
        KV_ASSIGN_OR_RETURN(BackendBuffer buf, b_->Allocate(std::max<size_t>(64, host.size() * sizeof(T))));
        KV_RETURN_IF_ERROR(b_->CopyToDevice(buf.data(), host.data(), host.size() * sizeof(T)));
        KV_RETURN_IF_ERROR(b_->Synchronize());
        buffers_.push_back(std::move(buf));
        return buffers_.back().As<T>();
    }
    Result<float*> Scratch(int64_t floats) {
        KV_ASSIGN_OR_RETURN(BackendBuffer buf, b_->Allocate(size_t(floats) * sizeof(float)));
        buffers_.push_back(std::move(buf));
        return buffers_.back().As<float>();
    }

  private:
    Backend* b_;
    std::vector<BackendBuffer> buffers_;
};

// The model's bf16 matrices in one arena on the backend: embedding, classifier, and per layer
// QKV (fused), O, gate|up (fused) and down, each Uniform(-a, a) with a = sqrt(3 / hidden) so a
// product keeps its input's scale. Filled from a 2 MiB random table at varying offsets (so
// matrices differ) rather than generated element by element: 16 GB set up in seconds.
class SyntheticWeights {
  public:
    struct Layer {
        WeightView qkv, wo, gate_up, down;
    };

    // Errors: the backend's (allocation, copies).
    static Result<SyntheticWeights> Create(Backend& b, const DecodeShape& s, uint32_t seed) {
        SyntheticWeights w(b);
        KV_RETURN_IF_ERROR(w.Init(s, seed));
        return w;
    }

    const WeightView& embedding() const { return embedding_; }
    const WeightView& output() const { return output_; }
    const Layer& layer(int64_t l) const { return layers_[static_cast<size_t>(l)]; }

  private:
    explicit SyntheticWeights(Backend& b) : b_(&b) {}

    static size_t Aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

    // Fills `bytes` of backend memory at `dst` from the random table, starting at a varying
    // offset so matrices differ.
    Status FillRandom(const std::vector<uint16_t>& table_bf16, void* dst, size_t bytes,
                      size_t* cursor) {
        auto* out = static_cast<uint8_t*>(dst);
        const size_t table = table_bf16.size() * sizeof(uint16_t);
        const auto* src = reinterpret_cast<const uint8_t*>(table_bf16.data());
        while (bytes > 0) {
            const size_t at = (*cursor % (table / 2)) & ~size_t{1};
            const size_t n = std::min(bytes, table - at);
            KV_RETURN_IF_ERROR(b_->CopyToDevice(out, src + at, n));
            KV_RETURN_IF_ERROR(b_->Synchronize());
            out += n;
            bytes -= n;
            *cursor += 2 * n + 7919 * 2;
        }
        return Status::Ok();
    }

    Status Init(const DecodeShape& s, uint32_t seed) {
        std::mt19937 rng(seed);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        const float a = std::sqrt(3.0f / static_cast<float>(s.hidden));
        std::vector<uint16_t> table(size_t{1} << 20);
        for (uint16_t& v : table) v = FloatToBF16(a * u(rng));

        struct Planned {
            WeightView* view;
            int64_t rows, cols;
        };
        std::vector<Planned> plan;
        layers_.resize(static_cast<size_t>(s.layers));
        plan.push_back({&embedding_, s.vocab, s.hidden});
        plan.push_back({&output_, s.vocab, s.hidden});
        for (Layer& l : layers_) {
            plan.push_back({&l.qkv, s.qkv_rows(), s.hidden});
            plan.push_back({&l.wo, s.hidden, s.heads * s.head_dim});
            plan.push_back({&l.gate_up, 2 * s.ffn, s.hidden});
            plan.push_back({&l.down, s.hidden, s.ffn});
        }
        size_t total = 0;
        for (const Planned& p : plan) total += Aligned(size_t(p.rows * p.cols) * 2);
        KV_ASSIGN_OR_RETURN(arena_, b_->Allocate(total));
        size_t offset = 0, cursor = seed;
        for (const Planned& p : plan) {
            const size_t bytes = size_t(p.rows * p.cols) * 2;
            void* at = arena_.As<uint8_t>() + offset;
            KV_RETURN_IF_ERROR(FillRandom(table, at, bytes, &cursor));
            *p.view = {.dtype = DType::kBF16, .data = at, .rows = p.rows, .cols = p.cols};
            offset += Aligned(bytes);
        }
        return Status::Ok();
    }

    Backend* b_;
    BackendBuffer arena_;
    WeightView embedding_, output_;
    std::vector<Layer> layers_;
};

// One synthetic step's device inputs and fp32 scratch, its paged KV pool (the CPU layout, one
// contiguous region per block) and the layer loop that both synthetic models queue, as the
// ModelRunner does: QKV, RoPE + KV write (fused where the backend has it), paged attention, O,
// AddRmsNorm, gate|up, SiluMul, down, AddRmsNorm.
struct SyntheticStep {
    int32_t *ids = nullptr, *positions = nullptr, *query_starts = nullptr,
            *context_lens = nullptr, *table_starts = nullptr, *tables = nullptr;
    int64_t* slots = nullptr;
    float *ones = nullptr, *inv_freq = nullptr, *x = nullptr, *xn = nullptr, *delta = nullptr,
          *qkv = nullptr, *attn = nullptr, *gate_up = nullptr, *h = nullptr, *logits = nullptr;
    BackendBuffer pool;
    int64_t block_bytes = 0;

    // A pool of `blocks` blocks of every layer.
    Status AllocatePool(Backend& b, const DecodeShape& s, int64_t blocks) {
        block_bytes =
            s.layers * cpu::PagedLayerBytes(s.kv_dtype, s.block_size, s.kv_heads, s.head_dim);
        KV_ASSIGN_OR_RETURN(pool, b.Allocate(size_t(blocks * block_bytes)));
        return Status::Ok();
    }

    // The norm weights (ones), RoPE's inverse frequencies, the scratch of `rows` rows and
    // `logit_rows` rows of logits.
    Status AllocateScratch(SyntheticBuffers& bufs, const DecodeShape& s, int64_t rows,
                           int64_t logit_rows) {
        std::vector<float> ones_host(s.hidden, 1.0f), inv_freq_host(s.head_dim / 2);
        cpu::RopeInvFreq(s.head_dim, s.rope_theta, {}, inv_freq_host.data());
        KV_ASSIGN_OR_RETURN(ones, bufs.Put(ones_host));
        KV_ASSIGN_OR_RETURN(inv_freq, bufs.Put(inv_freq_host));
        KV_ASSIGN_OR_RETURN(x, bufs.Scratch(rows * s.hidden));
        KV_ASSIGN_OR_RETURN(xn, bufs.Scratch(rows * s.hidden));
        KV_ASSIGN_OR_RETURN(delta, bufs.Scratch(rows * s.hidden));
        KV_ASSIGN_OR_RETURN(qkv, bufs.Scratch(rows * s.qkv_rows()));
        KV_ASSIGN_OR_RETURN(attn, bufs.Scratch(rows * s.heads * s.head_dim));
        KV_ASSIGN_OR_RETURN(gate_up, bufs.Scratch(rows * 2 * s.ffn));
        KV_ASSIGN_OR_RETURN(h, bufs.Scratch(rows * s.ffn));
        KV_ASSIGN_OR_RETURN(logits, bufs.Scratch(logit_rows * s.vocab));
        return Status::Ok();
    }

    PagedKvLayer Kv(const DecodeShape& s, int64_t layer) const {
        return cpu::MakePagedKvLayer(pool.As<uint8_t>(), block_bytes, layer, s.kv_dtype,
                                     s.block_size, s.kv_heads, s.head_dim);
    }

    // Queues the embedding, the first RMSNorm and every layer over `rows` rows; the classifier
    // is the caller's (a prefill reads one row, a decode step all).
    void QueueLayers(Backend& b, const DecodeShape& s, const SyntheticWeights& w, int64_t rows,
                     const PagedAttentionBatch& batch) const {
        const int64_t qkv_dim = s.qkv_rows(), q_dim = s.heads * s.head_dim,
                      kv_dim = s.kv_heads * s.head_dim;
        b.Embedding(w.embedding(), 0, ids, rows, x);
        b.RmsNorm(x, ones, xn, rows, s.hidden, 1e-5f);
        for (int64_t l = 0; l < s.layers; ++l) {
            const SyntheticWeights::Layer& lw = w.layer(l);
            b.MatMul(xn, rows, lw.qkv, qkv);
            const PagedKvLayer kv = Kv(s, l);
            if (auto* fused = dynamic_cast<RopeKvWriter*>(&b)) {
                fused->RopeKvWrite(qkv, qkv + q_dim, qkv + q_dim + kv_dim, qkv_dim, positions,
                                   slots, rows, s.heads, inv_freq, kv);
            } else {
                b.Rope(qkv, qkv_dim, positions, rows, s.heads + s.kv_heads, s.head_dim, inv_freq);
                b.KvWrite(kv, qkv + q_dim, qkv + q_dim + kv_dim, qkv_dim, slots, rows);
            }
            b.PagedAttention(qkv, qkv_dim, kv, batch, attn, s.heads, nullptr);
            b.MatMul(attn, rows, lw.wo, delta);
            b.AddRmsNorm(x, delta, ones, xn, rows, s.hidden, 1e-5f);
            b.MatMul(xn, rows, lw.gate_up, gate_up);
            b.SiluMul(gate_up, rows, s.ffn, h);
            b.MatMul(h, rows, lw.down, delta);
            b.AddRmsNorm(x, delta, ones, xn, rows, s.hidden, 1e-5f);
        }
    }
};


}  // namespace kvshard::cuda
