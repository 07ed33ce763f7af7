// ModelRunner: the Llama forward pass of one worker over a batch of sequences, each bringing a
// chunk of new tokens (a prefill of many tokens or a decode of one) at consecutive positions.
//
// The KV of earlier positions lives either in the runner's paged pool (worker/kv_pool.h), located
// by each chunk's block table and slot mapping as the coordinator's BlockManager assigned them, or
// — for chunks without a block table — in a contiguous region per sequence kept by the runner (the
// reference the paged path is checked against). fp32 activations and weights; matrix products
// through BLAS (kernels/cpu_ops.h).
// Thread-safety: not thread-safe; one owner thread drives a runner.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "config/model_spec.h"
#include "kernels/paged_attention.h"
#include "worker/kv_pool.h"
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

class ModelRunner {
public:
    ModelRunner(const ModelSpec& spec, ModelWeights weights, const RunnerOptions& options = {});

    // Computes the chunks and returns, row by row, the logits (vocab floats) at the last token of
    // each chunk. The new tokens' K/V are appended to each sequence's cache.
    // Errors (nothing is changed): InvalidArgument for an empty chunk, a token outside the
    // vocabulary, a start_pos that is not the cached length, a sequence twice in one batch;
    // OutOfRange when a sequence would pass max_context.
    Status Forward(std::span<const SequenceChunk> batch, std::vector<float>* logits);

    // Copies pool blocks (copy-on-write), before a step's KV writes. InvalidArgument for a block
    // outside the pool.
    Status CopyBlocks(std::span<const std::pair<int32_t, int32_t>> src_dst);

    // Drops the contiguous cache of `seq_id` (no-op if unknown).
    void Release(int64_t seq_id);
    int64_t CachedLength(int64_t seq_id) const;
    // Total token positions pushed through the network since construction.
    int64_t tokens_processed() const { return tokens_processed_; }

    const ModelSpec& spec() const { return spec_; }
    int64_t max_context() const { return max_context_; }
    KvPool* pool() { return pool_.get(); }

private:
    struct SequenceKv {
        int64_t length = 0;
        // Per layer: positions × kv_heads × head_dim.
        std::vector<std::vector<float>> k;
        std::vector<std::vector<float>> v;
    };

    Status Validate(std::span<const SequenceChunk> batch) const;
    Status ValidatePaged(const SequenceChunk& chunk) const;

    ModelSpec spec_;
    ModelWeights weights_;
    int64_t max_context_;
    int64_t q_dim_;
    int64_t kv_dim_;
    std::vector<float> inv_freq_;
    std::unordered_map<int64_t, SequenceKv> cache_;
    std::unique_ptr<KvPool> pool_;
    int64_t tokens_processed_ = 0;

    // Scratch, resized per step: rows = tokens in the batch.
    std::vector<float> x_, xn_, q_, k_, v_, att_, gate_, up_;
    std::vector<int32_t> positions_;
};

}  // namespace kvshard
