// ModelRunner: the Llama forward pass of one worker over a batch of sequences, each bringing a
// chunk of new tokens (a prefill of many tokens or a decode of one) at consecutive positions.
//
// The KV of earlier positions lives either in the runner's paged pool (worker/kv_pool.h), located
// by each chunk's block table and slot mapping as the coordinator's BlockManager assigned them, or
// — for chunks without a block table — in a contiguous region per sequence kept by the runner (the
// reference the paged path is checked against). fp32 activations and weights; matrix products
// through BLAS (kernels/cpu_ops.h).
//
// Tensor parallelism (DESIGN.md "Tensor-parallel rules", worker/shard.h): a runner holds the
// weights of one rank and computes its query and KV heads and MLP columns. The attention output
// and down projections give partial sums that are all-reduced over the instance's Collective and
// then added to the residual; tp 1 takes the same path without the reduction, so tp 1 and tp N
// differ only in the order the partial sums are added. The embedding is vocabulary-split (each
// rank fills the rows of its tokens, zeros elsewhere, then all-reduce) and so is the classifier
// (each rank computes its slice of the logits, AllGather hands every rank all of them): every rank
// ends a step with the same logits, bit for bit, so every rank samples the same tokens.
// Every rank of an instance must call Forward with the same batch (the collectives pair up).
// The KV pool and contiguous cache hold only the rank's KV heads; block ids mean the same slots
// on every rank.
// Thread-safety: not thread-safe; one owner thread drives a runner.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comm/collective.h"
#include "common/status.h"
#include "config/model_spec.h"
#include "kernels/paged_attention.h"
#include "worker/kv_pool.h"
#include "worker/shard.h"
#include "worker/weights.h"

namespace kvshard {

struct SequenceChunk {
    int64_t seq_id = 0;
    std::span<const int32_t> tokens;  // new tokens, at positions start_pos, start_pos + 1, ...
    int64_t start_pos = 0;
    // Paged: the blocks holding positions 0 .. start_pos + tokens - 1, and the slot of each new
    // token. Empty block_table: the contiguous cache, where start_pos must equal the number of
    // positions already cached for seq_id.
    std::span<const int32_t> block_table;
    std::span<const int64_t> slot_mapping;
};

struct RunnerOptions {
    // Longest sequence the cache accepts; 0 means the model's max_position (or 4096 if unknown).
    int64_t max_context = 0;
    // The paged pool; 0 blocks: none (only contiguous chunks are accepted); kOneSequence: enough
    // blocks for one sequence of max_context (memory is committed only as blocks are written).
    static constexpr int64_t kOneSequence = -1;
    int64_t num_kv_blocks = 0;
    int64_t block_size = 16;
    cpu::KvStorage kv_storage = cpu::KvStorage::kF32;
};

// What this rank handed to collectives since construction (payload bytes, count × 4; zero
// without a Collective).
struct CommStats {
    // The two all-reduces of every layer: 2 × layers × hidden × tokens × 4 per step.
    int64_t layer_all_reduce_bytes = 0;
    // The embedding's all-reduce: hidden × tokens × 4 per step.
    int64_t embedding_all_reduce_bytes = 0;
    // The logits received by AllGather: tp × outputs × ceil(vocab / tp) × 4 per step.
    int64_t logits_all_gather_bytes = 0;
    // Wall time inside the collective calls, waiting for the slowest rank included.
    double seconds = 0;
};

class ModelRunner {
  public:
    // `weights` holds the slices of rank weights.layout.shard. `collective` (not owned; must
    // outlive the runner) connects the ranks of the instance; nullptr at tp 1.
    // REQUIRES: a collective of size tp and this rank when tp > 1.
    ModelRunner(const ModelSpec& spec, ModelWeights weights, const RunnerOptions& options = {},
                Collective* collective = nullptr);

    // Computes the chunks and returns, row by row, the logits (vocab floats) at the last token of
    // each chunk. The new tokens' K/V are appended to each sequence's cache.
    // Errors (nothing is changed; found before any communication, so every rank of an instance
    // returns the same one): InvalidArgument for an empty chunk, a token outside the vocabulary,
    // a start_pos that is not the cached length, a sequence twice in one batch; OutOfRange when a
    // sequence would pass max_context. A failed collective returns its error; the step's KV is
    // then undefined (the instance is broken, see comm/collective.h).
    //
    // `after_layer_kv`, when given, is called with each layer index as soon as that layer's K/V of
    // the batch are written to the pool (before the layer's output projection): the hook of
    // layer-by-layer KV streaming. An error it returns is recorded by the caller, not here.
    Status Forward(std::span<const SequenceChunk> batch, std::vector<float>* logits,
                   const std::function<void(int64_t layer)>& after_layer_kv = {});

    // Copies pool blocks (copy-on-write), before a step's KV writes. InvalidArgument for a block
    // outside the pool.
    Status CopyBlocks(std::span<const std::pair<int32_t, int32_t>> src_dst);

    // Drops the contiguous cache of `seq_id` (no-op if unknown).
    void Release(int64_t seq_id);
    int64_t CachedLength(int64_t seq_id) const;
    // Total token positions pushed through the network since construction.
    int64_t tokens_processed() const { return tokens_processed_; }

    const ModelSpec& spec() const { return spec_; }
    const ShardLayout& layout() const { return weights_.layout; }
    int64_t max_context() const { return max_context_; }
    KvPool* pool() { return pool_.get(); }
    const KvPool* pool() const { return pool_.get(); }
    // Bytes of the fp32 weights this rank holds.
    size_t weight_bytes() const { return weight_bytes_; }
    const CommStats& comm_stats() const { return comm_stats_; }
    // The instance's collective (nullptr at tp 1).
    Collective* collective() const { return collective_; }

  private:
    struct SequenceKv {
        int64_t length = 0;
        // Per layer: positions × kv_heads × head_dim.
        std::vector<std::vector<float>> k;
        std::vector<std::vector<float>> v;
    };

    Status Validate(std::span<const SequenceChunk> batch) const;
    Status ValidatePaged(const SequenceChunk& chunk) const;
    // x_ = the embeddings of the batch's tokens; positions_ and the contiguous caches set up.
    Status Embed(std::span<const SequenceChunk> batch);
    // Writes the new K/V of layer l and attends (q_ -> att_).
    void Attend(std::span<const SequenceChunk> batch, int64_t l);
    // x_ += all-reduce(in · w^T): in is rows × k, w is {hidden, k} (a row-parallel slice).
    Status AddRowParallel(const float* in, const std::vector<float>& w, int64_t rows, int64_t k);
    // The logits of the last row of each chunk (xn_ holds the normed rows).
    Status Classify(int64_t num_out, std::vector<float>* logits);

    ModelSpec spec_;
    ModelWeights weights_;
    Collective* collective_;
    int64_t max_context_;
    int64_t q_dim_;    // this rank's query heads × head_dim
    int64_t kv_dim_;   // this rank's KV heads × head_dim
    int64_t ffn_dim_;  // this rank's MLP columns
    size_t weight_bytes_;
    CommStats comm_stats_;
    std::vector<float> inv_freq_;
    std::unordered_map<int64_t, SequenceKv> cache_;
    std::unique_ptr<KvPool> pool_;
    int64_t tokens_processed_ = 0;

    // Scratch, resized per step: rows = tokens in the batch.
    std::vector<float> x_, xn_, q_, k_, v_, att_, gate_, up_, partial_;
    std::vector<float> local_logits_, gathered_logits_;
    std::vector<int32_t> positions_;
};

}  // namespace kvshard
