// What kernels/cuda/synthetic_decode.h and kernels/cuda/synthetic_prefill.h share: the
// Llama-shaped model (DecodeShape), its random bf16 weights generated on the backend
// (SyntheticWeights: the same matrices on every backend for a seed) and the step buffers'
// allocator (SyntheticBuffers). Header-only. Not thread-safe.
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

}  // namespace kvshard::cuda
