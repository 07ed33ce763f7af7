// A Llama-shaped decode step on any Backend, with random bf16 weights and a KV pool already
// holding `context` random positions per sequence: the ops and order of the ModelRunner's forward
// pass (embedding, per layer RmsNorm → QKV → RoPE + KvWrite → PagedAttention → O → AddRmsNorm →
// gate|up → SiluMul → down → AddRmsNorm, then the classifier) without a model file, so a GPU
// machine that cannot carry real weights can time an 8B-shaped decode
// (kernels/bench/cuda_decode_bench.cc) and a test can check a whole step against the CPU backend
// (tests/kernels/cuda_backend_test.cc). Header-only; the weights are the same on every backend for
// a seed (kernels/cuda/synthetic_model.h's SyntheticWeights, which
// kernels/cuda/synthetic_prefill.h shares). Not thread-safe.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/cpu_ops.h"
#include "kernels/cuda/synthetic_model.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {

class SyntheticDecode {
  public:
    // Allocates everything on `b` (which must outlive this): weights, a pool of max_batch
    // sequences of context + 1 positions (the first `context` written with random K/V), the step's
    // buffers. Errors: the backend's (allocation, copies).
    static Result<SyntheticDecode> Create(Backend& b, const DecodeShape& s, int64_t max_batch,
                                          int64_t context, uint32_t seed) {
        KV_ASSIGN_OR_RETURN(SyntheticWeights w, SyntheticWeights::Create(b, s, seed));
        SyntheticDecode d(b, s, std::move(w), max_batch, context);
        KV_RETURN_IF_ERROR(d.Init(seed));
        return d;
    }

    // Queues one decode step of `batch` sequences (each at position `context`; the step's K/V go
    // to the same slots every step). REQUIRES: 0 < batch <= max_batch.
    void Step(int64_t batch) {
        t_.QueueLayers(*b_, s_, w_, batch, Attention(batch));
        b_->MatMul(t_.xn, batch, w_.output(), t_.logits);
    }

    // Milliseconds per call of each op of layer 0's step (and the classifier) at `batch`, each
    // timed alone: `reps` calls, then Synchronize, after one warm-up call. For finding where a
    // step's time goes; the ops' inputs are whatever the buffers hold.
    std::vector<std::pair<std::string, double>> OpTimes(int64_t batch, int reps) {
        const DecodeShape& s = s_;
        Backend& b = *b_;
        const int64_t qkv = s.qkv_rows(), q_dim = s.heads * s.head_dim, kv_dim = s.kv_heads * s.head_dim;
        const PagedAttentionBatch attn = Attention(batch);
        const SyntheticWeights::Layer& w = w_.layer(0);
        const PagedKvLayer kv = t_.Kv(s_, 0);
        std::vector<std::pair<std::string, std::function<void()>>> ops = {
            {"embedding", [&] { b.Embedding(w_.embedding(), 0, t_.ids, batch, t_.x); }},
            {"matmul_qkv", [&] { b.MatMul(t_.xn, batch, w.qkv, t_.qkv); }},
            {"rope", [&] { b.Rope(t_.qkv, qkv, t_.positions, batch, s.heads + s.kv_heads, s.head_dim, t_.inv_freq); }},
            {"kv_write", [&] { b.KvWrite(kv, t_.qkv + q_dim, t_.qkv + q_dim + kv_dim, qkv, t_.slots, batch); }},
            {"attention", [&] { b.PagedAttention(t_.qkv, qkv, kv, attn, t_.attn, s.heads, nullptr); }},
            {"matmul_o", [&] { b.MatMul(t_.attn, batch, w.wo, t_.delta); }},
            {"add_rmsnorm", [&] { b.AddRmsNorm(t_.x, t_.delta, t_.ones, t_.xn, batch, s.hidden, 1e-5f); }},
            {"matmul_gate_up", [&] { b.MatMul(t_.xn, batch, w.gate_up, t_.gate_up); }},
            {"silu_mul", [&] { b.SiluMul(t_.gate_up, batch, s.ffn, t_.h); }},
            {"matmul_down", [&] { b.MatMul(t_.h, batch, w.down, t_.delta); }},
            {"classifier", [&] { b.MatMul(t_.xn, batch, w_.output(), t_.logits); }},
        };
        // The fused RoPE + KV write where the backend has it, in place of rope and kv_write.
        if (auto* fused = dynamic_cast<RopeKvWriter*>(&b)) {
            ops.emplace_back("rope_kv_write", [&, fused] {
                fused->RopeKvWrite(t_.qkv, t_.qkv + q_dim, t_.qkv + q_dim + kv_dim, qkv,
                                   t_.positions, t_.slots, batch, s.heads, t_.inv_freq, kv);
            });
        }
        std::vector<std::pair<std::string, double>> out;
        for (const auto& [name, op] : ops) {
            op();
            if (!b.Synchronize().ok()) break;
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < reps; ++i) op();
            if (!b.Synchronize().ok()) break;
            out.emplace_back(name, std::chrono::duration<double, std::milli>(
                                       std::chrono::steady_clock::now() - t0).count() / reps);
        }
        return out;
    }

    // The logits of the last step's `batch` rows (waits for the step).
    Result<std::vector<float>> Logits(int64_t batch) {
        std::vector<float> out(static_cast<size_t>(batch * s_.vocab));
        KV_RETURN_IF_ERROR(b_->CopyToHost(out.data(), t_.logits, out.size() * sizeof(float)));
        KV_RETURN_IF_ERROR(b_->Synchronize());
        return out;
    }

    const DecodeShape& shape() const { return s_; }

  private:
    SyntheticDecode(Backend& b, const DecodeShape& s, SyntheticWeights w, int64_t max_batch,
                    int64_t context)
        : b_(&b), s_(s), w_(std::move(w)), bufs_(b), max_batch_(max_batch), context_(context) {}

    PagedAttentionBatch Attention(int64_t batch) const {
        return {.num_seqs = batch,
                .query_starts = t_.query_starts,
                .context_lens = t_.context_lens,
                .block_table_starts = t_.table_starts,
                .block_tables = t_.tables,
                .max_query_rows = 1};  // a decode step: no prefill launch, as in the runner
    }

    Status Init(uint32_t seed) {
        const DecodeShape& s = s_;
        std::mt19937 rng(seed);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);

        // The KV pool: max_batch sequences of context + 1 positions, consecutive blocks each.
        const int64_t per_seq = (context_ + 1 + s.block_size - 1) / s.block_size;
        KV_RETURN_IF_ERROR(t_.AllocatePool(*b_, s, max_batch_ * per_seq));

        // Step buffers and inputs.
        const int64_t m = max_batch_;
        std::vector<int32_t> ids(m), positions(m, int32_t(context_)), starts(m + 1), lens(m, int32_t(context_ + 1)),
            table_starts(m + 1), tables(m * per_seq);
        std::vector<int64_t> slots(m);
        for (int64_t i = 0; i < m; ++i) {
            ids[i] = int32_t(rng() % uint32_t(s.vocab));
            starts[i] = int32_t(i);
            table_starts[i] = int32_t(i * per_seq);
            for (int64_t j = 0; j < per_seq; ++j) tables[i * per_seq + j] = int32_t(i * per_seq + j);
            slots[i] = (i * per_seq + context_ / s.block_size) * s.block_size + context_ % s.block_size;
        }
        starts[m] = int32_t(m);
        table_starts[m] = int32_t(m * per_seq);
        KV_ASSIGN_OR_RETURN(t_.ids, Put(ids));
        KV_ASSIGN_OR_RETURN(t_.positions, Put(positions));
        KV_ASSIGN_OR_RETURN(t_.query_starts, Put(starts));
        KV_ASSIGN_OR_RETURN(t_.context_lens, Put(lens));
        KV_ASSIGN_OR_RETURN(t_.table_starts, Put(table_starts));
        KV_ASSIGN_OR_RETURN(t_.tables, Put(tables));
        KV_ASSIGN_OR_RETURN(t_.slots, Put(slots));
        KV_RETURN_IF_ERROR(t_.AllocateScratch(bufs_, s, m, m));

        // The first `context` positions of every sequence: random K/V rows, a chunk at a time.
        const int64_t kv_dim = s.kv_heads * s.head_dim;
        const int64_t chunk = std::min<int64_t>(std::max<int64_t>(1, m * context_), 4096);
        std::vector<float> rows(static_cast<size_t>(chunk * kv_dim));
        for (float& v : rows) v = u(rng);
        KV_ASSIGN_OR_RETURN(float* k_rows, Put(rows));
        for (float& v : rows) v = u(rng);
        KV_ASSIGN_OR_RETURN(float* v_rows, Put(rows));
        std::vector<int64_t> chunk_slots;
        chunk_slots.reserve(static_cast<size_t>(chunk));
        BackendBuffer slot_buf;
        KV_ASSIGN_OR_RETURN(slot_buf, b_->Allocate(size_t(chunk) * sizeof(int64_t)));
        auto flush = [&]() -> Status {
            if (chunk_slots.empty()) return Status::Ok();
            KV_RETURN_IF_ERROR(b_->CopyToDevice(slot_buf.data(), chunk_slots.data(),
                                                chunk_slots.size() * sizeof(int64_t)));
            for (int64_t l = 0; l < s.layers; ++l) {
                b_->KvWrite(t_.Kv(s_, l), k_rows, v_rows, kv_dim, slot_buf.As<int64_t>(),
                            int64_t(chunk_slots.size()));
            }
            KV_RETURN_IF_ERROR(b_->Synchronize());
            chunk_slots.clear();
            return Status::Ok();
        };
        for (int64_t i = 0; i < m; ++i) {
            for (int64_t p = 0; p < context_; ++p) {
                chunk_slots.push_back((i * per_seq + p / s.block_size) * s.block_size + p % s.block_size);
                if (int64_t(chunk_slots.size()) == chunk) KV_RETURN_IF_ERROR(flush());
            }
        }
        KV_RETURN_IF_ERROR(flush());
        return b_->Synchronize();
    }

    template <typename T>
    Result<T*> Put(const std::vector<T>& host) { return bufs_.Put(host); }
    Result<float*> Scratch(int64_t floats) { return bufs_.Scratch(floats); }

    Backend* b_;
    DecodeShape s_;
    SyntheticWeights w_;
    SyntheticBuffers bufs_;
    int64_t max_batch_, context_;
    SyntheticStep t_;
};

}  // namespace kvshard::cuda
