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
        KV_RETURN_IF_ERROR(b_->CopyToDevice(t_.query_starts, starts, sizeof(starts)));
        KV_RETURN_IF_ERROR(b_->CopyToDevice(t_.context_lens, &len, sizeof(len)));
        return b_->Synchronize();
    }

    // Queues one prefill step of the SetTokens prompt (the same K/V slots every step).
    void Step() {
        const int64_t n = tokens_;
        const PagedAttentionBatch attn = {.num_seqs = 1,
                                          .query_starts = t_.query_starts,
                                          .context_lens = t_.context_lens,
                                          .block_table_starts = t_.table_starts,
                                          .block_tables = t_.tables,
                                          .max_query_rows = n};
        t_.QueueLayers(*b_, s_, w_, n, attn);
        b_->MatMul(t_.xn + (n - 1) * s_.hidden, 1, w_.output(), t_.logits);
    }

    // The last step's logits (vocab floats of the last row; waits for the step).
    Result<std::vector<float>> Logits() {
        std::vector<float> out(static_cast<size_t>(s_.vocab));
        KV_RETURN_IF_ERROR(b_->CopyToHost(out.data(), t_.logits, out.size() * sizeof(float)));
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

    Status Init(uint32_t seed) {
        const DecodeShape& s = s_;
        const int64_t m = max_tokens_;
        std::mt19937 rng(seed + 1);
        // The pool: one sequence, consecutive blocks; position p at slot p.
        const int64_t blocks = (m + s.block_size - 1) / s.block_size;
        KV_RETURN_IF_ERROR(t_.AllocatePool(*b_, s, blocks));
        std::vector<int32_t> ids(m), positions(m), tables(blocks), table_starts = {0, int32_t(blocks)};
        std::vector<int64_t> slots(m);
        for (int64_t i = 0; i < m; ++i) {
            ids[i] = int32_t(rng() % uint32_t(s.vocab));
            positions[i] = int32_t(i);
            slots[i] = i;
        }
        for (int64_t j = 0; j < blocks; ++j) tables[j] = int32_t(j);
        KV_ASSIGN_OR_RETURN(t_.ids, bufs_.Put(ids));
        KV_ASSIGN_OR_RETURN(t_.positions, bufs_.Put(positions));
        KV_ASSIGN_OR_RETURN(t_.query_starts, bufs_.Put(std::vector<int32_t>{0, int32_t(m)}));
        KV_ASSIGN_OR_RETURN(t_.context_lens, bufs_.Put(std::vector<int32_t>{int32_t(m)}));
        KV_ASSIGN_OR_RETURN(t_.table_starts, bufs_.Put(table_starts));
        KV_ASSIGN_OR_RETURN(t_.tables, bufs_.Put(tables));
        KV_ASSIGN_OR_RETURN(t_.slots, bufs_.Put(slots));
        KV_RETURN_IF_ERROR(t_.AllocateScratch(bufs_, s, m, 1));
        return b_->Synchronize();
    }

    Backend* b_;
    DecodeShape s_;
    SyntheticWeights w_;
    SyntheticBuffers bufs_;
    int64_t max_tokens_, tokens_;
    SyntheticStep t_;
};

}  // namespace kvshard::cuda
