// A Llama-shaped prefill step on any Backend: one sequence's prompt of `tokens` positions from
// position 0, through the ops and order of the ModelRunner's forward pass (embedding, per layer
// RmsNorm → QKV → RoPE + KvWrite → PagedAttention (the prefill kernel: every row of the chunk,
// causal) → O → AddRmsNorm → gate|up → SiluMul → down → AddRmsNorm, then the classifier on the
// last row only, as a prefill that samples one token), with synthetic_decode.h's random bf16
// weights (kernels/cuda/synthetic_model.h; the same matrices for a seed). So a GPU machine that
// cannot carry real weights times an 8B prefill at 2k tokens (kernels/bench/
// cuda_prefill_step_bench.cc). Header-only. Not thread-safe.
#pragma once

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/cpu_ops.h"
#include "kernels/cuda/synthetic_model.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {

class SyntheticPrefill {
  public:
    // Allocates everything on `b` (which must outlive this): weights, a pool of one sequence of
    // max_tokens positions, the step's buffers for max_tokens rows. Errors: the backend's.
    // REQUIRES: max_tokens > 0.
    static Result<SyntheticPrefill> Create(Backend& b, const DecodeShape& s, int64_t max_tokens,
                                           uint32_t seed) {
        KV_ASSIGN_OR_RETURN(SyntheticWeights w, SyntheticWeights::Create(b, s, seed));
        SyntheticPrefill p(b, s, std::move(w), max_tokens);
        KV_RETURN_IF_ERROR(p.Init(seed));
        return p;
    }

    // Sets the prompt length of the next steps (copies two ints to the backend and waits; outside
    // a timed loop). REQUIRES: 0 < tokens <= max_tokens.
    Status SetTokens(int64_t tokens) {
        tokens_ = tokens;
        const int32_t starts[2] = {0, static_cast<int32_t>(tokens)};
        const int32_t len = static_cast<int32_t>(tokens);
        KV_RETURN_IF_ERROR(b_->CopyToDevice(query_starts_, starts, sizeof(starts)));
        KV_RETURN_IF_ERROR(b_->CopyToDevice(context_lens_, &len, sizeof(len)));
        return b_->Synchronize();
    }

    // Queues one prefill step of the SetTokens prompt (the same K/V slots every step).
    void Step() {
        const DecodeShape& s = s_;
        Backend& b = *b_;
        const int64_t n = tokens_, qkv = s.qkv_rows(), q_dim = s.heads * s.head_dim,
                      kv_dim = s.kv_heads * s.head_dim;
        const PagedAttentionBatch attn = {.num_seqs = 1,
                                          .query_starts = query_starts_,
                                          .context_lens = context_lens_,
                                          .block_table_starts = table_starts_,
                                          .block_tables = tables_,
                                          .max_query_rows = n};
        b.Embedding(w_.embedding(), 0, ids_, n, x_);
        b.RmsNorm(x_, ones_, xn_, n, s.hidden, 1e-5f);
        for (int64_t l = 0; l < s.layers; ++l) {
            const SyntheticWeights::Layer& w = w_.layer(l);
            b.MatMul(xn_, n, w.qkv, qkv_);
            const PagedKvLayer kv = Kv(l);
            if (auto* fused = dynamic_cast<RopeKvWriter*>(&b)) {
                fused->RopeKvWrite(qkv_, qkv_ + q_dim, qkv_ + q_dim + kv_dim, qkv, positions_,
                                   slots_, n, s.heads, inv_freq_, kv);
            } else {
                b.Rope(qkv_, qkv, positions_, n, s.heads + s.kv_heads, s.head_dim, inv_freq_);
                b.KvWrite(kv, qkv_ + q_dim, qkv_ + q_dim + kv_dim, qkv, slots_, n);
            }
            b.PagedAttention(qkv_, qkv, kv, attn, attn_, s.heads, nullptr);
            b.MatMul(attn_, n, w.wo, delta_);
            b.AddRmsNorm(x_, delta_, ones_, xn_, n, s.hidden, 1e-5f);
            b.MatMul(xn_, n, w.gate_up, gate_up_);
            b.SiluMul(gate_up_, n, s.ffn, h_);
            b.MatMul(h_, n, w.down, delta_);
            b.AddRmsNorm(x_, delta_, ones_, xn_, n, s.hidden, 1e-5f);
        }
        b.MatMul(xn_ + (n - 1) * s.hidden, 1, w_.output(), logits_);
    }

    // The last step's logits (vocab floats of the last row; waits for the step).
    Result<std::vector<float>> Logits() {
        std::vector<float> out(static_cast<size_t>(s_.vocab));
        KV_RETURN_IF_ERROR(b_->CopyToHost(out.data(), logits_, out.size() * sizeof(float)));
        KV_RETURN_IF_ERROR(b_->Synchronize());
        return out;
    }

    // FLOPs of a step's weight products at `tokens` rows (2 per multiply-add): every layer's four
    // matrices over all rows, the classifier over one.
    static double GemmFlops(const DecodeShape& s, int64_t tokens) {
        return 2.0 * double(tokens) * double(s.layers) * double(s.layer_weight_elements()) +
               2.0 * double(s.vocab) * double(s.hidden);
    }
    // FLOPs of a step's causal attention (Q·Kᵀ and P·V over the n(n+1)/2 visible pairs, every
    // head and layer).
    static double AttentionFlops(const DecodeShape& s, int64_t tokens) {
        return 4.0 * double(s.layers) * double(s.heads) * double(s.head_dim) * double(tokens) *
               double(tokens + 1) / 2.0;
    }

    const DecodeShape& shape() const { return s_; }
    int64_t max_tokens() const { return max_tokens_; }

  private:
    SyntheticPrefill(Backend& b, const DecodeShape& s, SyntheticWeights w, int64_t max_tokens)
        : b_(&b), s_(s), w_(std::move(w)), bufs_(b), max_tokens_(max_tokens), tokens_(max_tokens) {}

    PagedKvLayer Kv(int64_t layer) {
        return cpu::MakePagedKvLayer(pool_.As<uint8_t>(), block_bytes_, layer, s_.kv_dtype,
                                     s_.block_size, s_.kv_heads, s_.head_dim);
    }

    Status Init(uint32_t seed) {
        const DecodeShape& s = s_;
        const int64_t m = max_tokens_;
        std::mt19937 rng(seed + 1);
        // The pool: one sequence, consecutive blocks; position p at slot p.
        const int64_t blocks = (m + s.block_size - 1) / s.block_size;
        block_bytes_ =
            s.layers * cpu::PagedLayerBytes(s.kv_dtype, s.block_size, s.kv_heads, s.head_dim);
        KV_ASSIGN_OR_RETURN(pool_, b_->Allocate(size_t(blocks * block_bytes_)));
        std::vector<int32_t> ids(m), positions(m), tables(blocks), table_starts = {0, int32_t(blocks)};
        std::vector<int64_t> slots(m);
        for (int64_t i = 0; i < m; ++i) {
            ids[i] = int32_t(rng() % uint32_t(s.vocab));
            positions[i] = int32_t(i);
            slots[i] = i;
        }
        for (int64_t j = 0; j < blocks; ++j) tables[j] = int32_t(j);
        std::vector<float> ones(s.hidden, 1.0f), inv_freq(s.head_dim / 2);
        cpu::RopeInvFreq(s.head_dim, s.rope_theta, {}, inv_freq.data());
        KV_ASSIGN_OR_RETURN(ids_, bufs_.Put(ids));
        KV_ASSIGN_OR_RETURN(positions_, bufs_.Put(positions));
        KV_ASSIGN_OR_RETURN(query_starts_, bufs_.Put(std::vector<int32_t>{0, int32_t(m)}));
        KV_ASSIGN_OR_RETURN(context_lens_, bufs_.Put(std::vector<int32_t>{int32_t(m)}));
        KV_ASSIGN_OR_RETURN(table_starts_, bufs_.Put(table_starts));
        KV_ASSIGN_OR_RETURN(tables_, bufs_.Put(tables));
        KV_ASSIGN_OR_RETURN(slots_, bufs_.Put(slots));
        KV_ASSIGN_OR_RETURN(ones_, bufs_.Put(ones));
        KV_ASSIGN_OR_RETURN(inv_freq_, bufs_.Put(inv_freq));
        KV_ASSIGN_OR_RETURN(x_, bufs_.Scratch(m * s.hidden));
        KV_ASSIGN_OR_RETURN(xn_, bufs_.Scratch(m * s.hidden));
        KV_ASSIGN_OR_RETURN(delta_, bufs_.Scratch(m * s.hidden));
        KV_ASSIGN_OR_RETURN(qkv_, bufs_.Scratch(m * s.qkv_rows()));
        KV_ASSIGN_OR_RETURN(attn_, bufs_.Scratch(m * s.heads * s.head_dim));
        KV_ASSIGN_OR_RETURN(gate_up_, bufs_.Scratch(m * 2 * s.ffn));
        KV_ASSIGN_OR_RETURN(h_, bufs_.Scratch(m * s.ffn));
        KV_ASSIGN_OR_RETURN(logits_, bufs_.Scratch(s.vocab));
        return b_->Synchronize();
    }

    Backend* b_;
    DecodeShape s_;
    SyntheticWeights w_;
    SyntheticBuffers bufs_;
    int64_t max_tokens_, tokens_;
    BackendBuffer pool_;
    int64_t block_bytes_ = 0;
    int32_t *ids_ = nullptr, *positions_ = nullptr, *query_starts_ = nullptr,
            *context_lens_ = nullptr, *table_starts_ = nullptr, *tables_ = nullptr;
    int64_t* slots_ = nullptr;
    float *ones_ = nullptr, *inv_freq_ = nullptr, *x_ = nullptr, *xn_ = nullptr, *delta_ = nullptr,
          *qkv_ = nullptr, *attn_ = nullptr, *gate_up_ = nullptr, *h_ = nullptr, *logits_ = nullptr;
};

}  // namespace kvshard::cuda
