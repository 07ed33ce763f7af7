// ModelRunner: the forward pass of one worker over a batch of sequences, each bringing a chunk of
// new tokens (a prefill of many tokens or a decode of one) at consecutive positions: Llama and the
// features config/model_spec.h adds to it (Q/K/V biases, q/k norms, post norms, GeGLU, sliding
// windows with their own RoPE base), all of them ops of the Backend.
//
// It runs only on its Backend (kernels/backend.h): weights live in backend memory in their stored
// format (worker/weights.h), the KV of every position lives in the runner's paged pool
// (worker/kv_pool.h, allocated through the backend) located by each chunk's block table and slot
// mapping as the coordinator's BlockManager assigned them, and scratch is one workspace sized
// for the step's token budget. Each step packs its inputs (token ids, positions, slot mapping,
// block tables, query starts, context lengths) once, copies them to the backend in one copy,
// queues the ops of every layer (attention batched over the whole step: one call per layer) and
// copies the logits out. Callers without a coordinator place sequences with
// worker/sequence_slots.h.
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
// The KV pool holds only the rank's KV heads; block ids mean the same slots on every rank.
// Thread-safety: not thread-safe; one owner thread drives a runner.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "comm/collective.h"
#include "common/kv_types.h"
#include "common/status.h"
#include "config/model_spec.h"
#include "kernels/backend.h"
#include "kernels/paged_attention.h"
#include "kv/kv_cache_groups.h"
#include "worker/decode_graphs.h"
#include "worker/kv_pool.h"
#include "worker/rank_collective.h"
#include "worker/shard.h"
#include "worker/weights.h"

namespace kvshard {

struct SequenceChunk {
    int64_t seq_id = 0;
    std::span<const int32_t> tokens;  // new tokens, at positions start_pos, start_pos + 1, ...
    int64_t start_pos = 0;
    // The blocks holding positions 0 .. start_pos + tokens - 1, and the slot of each new token:
    // KV cache group 0's. A model with several groups (kv_groups()) brings group g's in
    // group_block_tables[g - 1] and group_slot_mappings[g - 1]; a windowed group's table may hold
    // kv::kNoBlock for blocks wholly before the window of the chunk's first token.
    std::span<const int32_t> block_table = {};
    std::span<const int64_t> slot_mapping = {};
    std::span<const std::vector<int32_t>> group_block_tables = {};
    std::span<const std::vector<int64_t>> group_slot_mappings = {};
    // Also classify every row of the chunk, not only the last (prompt logprobs): Forward hands
    // them to its `on_rows` in slices.
    bool all_logits = false;
};

// Receives the logits of every row of a chunk with all_logits, a slice at a time: `logits` holds
// num_rows × vocab floats, the rows at positions start_pos + first_row ... of batch[chunk]. The
// buffer is reused by the next slice.
using RowLogitsFn =
    std::function<void(size_t chunk, int64_t first_row, int64_t num_rows, const float* logits)>;

struct RunnerOptions {
    // Longest sequence the cache accepts; 0 means the model's max_position (or 4096 if unknown).
    int64_t max_context = 0;
    // The paged pool; kOneSequence: enough blocks for one sequence of max_context in every KV
    // cache group (on the CPU, memory is committed only as blocks are written). REQUIRES:
    // positive or kOneSequence.
    static constexpr int64_t kOneSequence = -1;
    int64_t num_kv_blocks = kOneSequence;
    int64_t block_size = 16;
    KvDtype kv_storage = KvDtype::kFp32;
    // The workspace is sized once for this many tokens (and sequences) per step; a larger step
    // grows it (logged), so pass the scheduler's token budget.
    int64_t max_step_tokens = 512;
    int64_t max_step_seqs = 64;
    // Weights as stored in the file (the fast path) or dequantized to F32 (the reference).
    WeightFormat weight_format = WeightFormat::kStored;
    // CUDA graphs of pure-decode steps, one per decode bucket (worker/decode_graphs.h, docs/cuda.md
    // "CUDA graphs"). Unset or false: never (opt-in until scripts/gpu-check has shown replay equal
    // to eager on a GPU). true: on where the backend captures graphs (kernels/backend.h
    // GraphCapture; the CUDA backend) and, at tp > 1, the collective is queued on its stream
    // (collective_path kNccl); required, and MakeModelRunner refuses it, naming cuda_graphs,
    // where it cannot be had (the CPU backend, a host or host-staged collective).
    std::optional<bool> cuda_graphs = {};
    // The path of the instance's collective at tp > 1 (worker/rank_collective.h), as the caller
    // chose it for every rank: what decides whether a decode step and its all-reduces can be
    // captured. kNccl queues them on the backend's stream, where a capture records them; kHost
    // and kStaged run them on the host (and the staged path copies through it), which a graph
    // cannot hold. Not read at tp 1.
    CollectivePath collective_path = CollectivePath::kHost;
    // Pads every pure-decode step to its decode bucket (worker/decode_buckets.h) without graphs
    // too: how the padding of graph steps is tested on the CPU. Graph steps are always padded.
    bool pad_decode_to_buckets = false;
    // Give the backend the products' weights (layers and classifier) to copy into its single-row
    // layout when it has one (kernels/backend.h, DecodeWeightPacker: on the CPU, Q4_1 and Q8_0
    // on AVX-512, 1.5-1.65x less compute per weight at batch-1 decode, for a second copy of
    // those weights in memory).
    bool pack_decode_weights = true;
    // RoPE of q and k and the KV write as one op (kernels/backend.h RopeKvWriter) where the
    // backend offers it: one kernel in place of two on CUDA, each row block rotated and written
    // while in cache on the CPU; the same results as the separate ops (Rope, KvWrite), which
    // false forces (tests compare the two; `kvshard bench-engine --rope-kv-write separate`).
    bool fuse_rope_kv_write = true;
    // The backend each runner builds (kind, device); CPU threads stay the calling thread's.
    BackendConfig backend = {};
    // MakeModelRunner: reports the weights' load (WeightLoadOptions::on_bytes_loaded); called on
    // the loading rank's thread. Not sent to worker processes.
    std::function<void(int64_t bytes)> on_weight_bytes_loaded = nullptr;
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
    // `weights` holds the slices of rank weights.layout.shard, loaded into `backend`'s memory
    // (which the runner now owns). `collective` (not owned; must outlive the runner) connects the
    // ranks of the instance; nullptr at tp 1.
    // REQUIRES: a collective of size tp and this rank when tp > 1.
    ModelRunner(const ModelSpec& spec, std::unique_ptr<Backend> backend, ModelWeights weights,
                const RunnerOptions& options = {}, Collective* collective = nullptr);

    // Computes the chunks and returns, row by row, the logits (vocab floats) at the last token of
    // each chunk. The new tokens' K/V are written to the pool at their slots.
    // Errors (nothing is changed; found before any communication, so every rank of an instance
    // returns the same one): InvalidArgument for an empty chunk, a token outside the vocabulary,
    // a chunk without a block table or whose blocks or slots do not match its positions, a
    // sequence twice in one batch; OutOfRange when a sequence would pass max_context. A failed
    // collective or backend returns its error; the step's KV is then undefined (the instance is
    // broken, see comm/collective.h).
    //
    // `after_layer_kv`, when given, is called with each layer index as soon as that layer's K/V of
    // the batch are written to the pool (before the layer's attention): the hook of
    // layer-by-layer KV streaming. An error it returns is recorded by the caller, not here.
    //
    // Chunks with all_logits are classified at every row after the last rows, in slices of at
    // most the workspace's sequence count (RunnerOptions.max_step_seqs), so host memory holds
    // one slice × vocab floats however long the chunk; each slice goes to `on_rows` (which may
    // be empty: every rank of an instance classifies the same rows, since the classifier's
    // AllGather pairs up, but only the ranks that want them need to look).
    Status Forward(std::span<const SequenceChunk> batch, std::vector<float>* logits,
                   const std::function<void(int64_t layer)>& after_layer_kv = {},
                   const RowLogitsFn& on_rows = {});

    // Copies pool blocks (copy-on-write), before a step's KV writes. InvalidArgument for a block
    // outside the pool.
    Status CopyBlocks(std::span<const std::pair<int32_t, int32_t>> src_dst);

    // Total token positions pushed through the network since construction.
    int64_t tokens_processed() const { return tokens_processed_; }

    const ModelSpec& spec() const { return spec_; }
    // How the model's layers share the pool's blocks (one group without sliding windows).
    const kv::KvCacheGroups& kv_groups() const { return kv_groups_; }
    const ShardLayout& layout() const { return weights_.layout; }
    int64_t max_context() const { return max_context_; }
    KvPool* pool() { return pool_.get(); }
    const KvPool* pool() const { return pool_.get(); }
    Backend& backend() { return *backend_; }
    const ModelWeights& weights() const { return weights_; }
    // Bytes of the weights this rank holds in backend memory.
    size_t weight_bytes() const { return weights_.NumBytes(); }
    const CommStats& comm_stats() const { return comm_stats_; }
    // The instance's collective (nullptr at tp 1).
    Collective* collective() const { return collective_; }
    // Whether pure-decode steps run as CUDA graphs (RunnerOptions::cuda_graphs), and what they
    // did; nullptr without graphs.
    const DecodeGraphs* decode_graphs() const { return graphs_.get(); }
    // The batch sizes pure-decode steps pad to (with graphs or pad_decode_to_buckets).
    const std::vector<int64_t>& decode_buckets() const { return buckets_; }

  private:
    Status Validate(std::span<const SequenceChunk> batch) const;
    Status ValidatePaged(const SequenceChunk& chunk) const;
    // One group's table and slots of `chunk` (ValidatePaged).
    Status ValidateGroup(const SequenceChunk& chunk, int64_t group, std::span<const int32_t> table,
                         std::span<const int64_t> slots) const;
    // Packs the step's inputs and copies them to the backend in one copy; sizes the workspace.
    // A step padded to step_rows rows and step_seqs sequences gets padding after its own
    // (worker/decode_buckets.h PadStepInputs).
    Status PackInputs(std::span<const SequenceChunk> batch, int64_t rows, int64_t step_rows,
                      int64_t step_seqs);
    // The bucket a step pads to: its decode bucket for a pure-decode step (one new token per
    // chunk, no all_logits, no per-layer hook) when graphs or pad_decode_to_buckets are on and a
    // bucket holds it; 0 (not padded) otherwise.
    int64_t PaddedBucket(std::span<const SequenceChunk> batch, bool has_layer_hook) const;
    // Queues the forward pass of the packed step up to the normed last rows (xn_), everything
    // but the classifier: what a graph of a decode step records.
    Status QueueStep(int64_t rows, int64_t num_seqs,
                     const std::function<void(int64_t layer)>& after_layer_kv);
    // Captures the packed step of `bucket` as a graph and replays it (the capture runs nothing);
    // runs it eagerly when the capture fails. At tp > 1 the ranks agree first (one all-reduce
    // of a vote): a graph is kept only where every rank captured, since a captured collective
    // must be launched as a graph on every rank or on none.
    Status CaptureStep(int64_t bucket, int64_t rows, int64_t num_seqs);
    // Counts the collectives a replayed graph ran, from the sizes its capture queued (the
    // capture's calls counted them once, for the replay that follows it), in CommStats and in
    // the RankCollective's bytes_all_reduced.
    void CountReplayedCollectives(const CapturedCollectives& collectives);
    Status EnsureWorkspace(int64_t rows, int64_t num_seqs, int64_t block_table_entries);
    // partial_ = all-reduce(in · w^T), normed by `post_norm` when it has data (Gemma), then
    // x_ += partial_ and (when `next_norm` is given) xn_ = RmsNorm(x_): the row-parallel
    // projection, its reduction, the residual and next norm.
    Status RowParallel(const float* in, const WeightView& w, int64_t rows, const float* next_norm,
                       const WeightView& post_norm);
    // The logits of the last row of each chunk (xn_ holds the normed rows).
    Status Classify(int64_t num_out, std::vector<float>* logits);
    // Classifies every row of the chunks with all_logits (x_ holds the final hidden rows).
    Status ClassifyAllRows(std::span<const SequenceChunk> batch, const RowLogitsFn& on_rows);

    ModelSpec spec_;
    kv::KvCacheGroups kv_groups_;
    std::unique_ptr<Backend> backend_;  // before every buffer: destroyed after them
    ModelWeights weights_;
    // The backend's single-row copies of weights_'s products (RunnerOptions.pack_decode_weights).
    std::vector<BackendBuffer> decode_copies_;
    Collective* collective_;
    // collective_ when it is a RankCollective (TpGroup, worker processes): told of the
    // all-reduces graph replays launch without calling it.
    RankCollective* rank_collective_;
    int64_t max_context_;
    int64_t q_dim_;    // this rank's query heads × head_dim
    int64_t kv_dim_;   // this rank's KV heads × head_dim
    int64_t qkv_dim_;  // q_dim_ + 2 kv_dim_: a row of the fused QKV product
    int64_t ffn_dim_;  // this rank's MLP columns
    CommStats comm_stats_;
    std::unique_ptr<KvPool> pool_;
    int64_t tokens_processed_ = 0;
    RunnerOptions options_;

    // Constant inputs in backend memory: RoPE inverse frequencies (global layers', windowed
    // layers') and the KV head of each query head.
    BackendBuffer constants_;
    const float* inv_freq_ = nullptr;
    const float* inv_freq_local_ = nullptr;  // the windowed layers' (spec.rope_theta_local)
    const int32_t* kv_head_of_q_ = nullptr;

    // The workspace (backend memory), sized for ws_rows_ tokens and ws_seqs_ sequences; the packed
    // slots and table starts repeat for each KV cache group (group g's at g × ws_rows_ and
    // g × (ws_seqs_ + 1)).
    int64_t ws_rows_ = 0;
    int64_t ws_seqs_ = 0;
    int64_t ws_table_entries_ = 0;
    BackendBuffer workspace_;
    float *x_ = nullptr, *xn_ = nullptr, *qkv_ = nullptr, *att_ = nullptr, *gate_up_ = nullptr,
          *act_ = nullptr, *partial_ = nullptr, *logits_ = nullptr, *gathered_ = nullptr;
    BackendBuffer inputs_;  // the step's packed inputs
    int32_t *ids_ = nullptr, *positions_ = nullptr, *query_starts_ = nullptr,
            *context_lens_ = nullptr, *table_starts_ = nullptr, *tables_ = nullptr,
            *last_rows_ = nullptr;
    int64_t* slots_ = nullptr;
    std::vector<uint8_t> host_inputs_;  // staging of the packed inputs
    std::vector<float> host_logits_;    // the gathered logits at tp > 1
    std::vector<int32_t> slice_rows_;   // ClassifyAllRows: the rows of one slice
    std::vector<float> slice_logits_;   // ClassifyAllRows: their logits
    // The backend's fused RoPE + KV write (RunnerOptions::fuse_rope_kv_write); nullptr: the
    // separate ops.
    RopeKvWriter* rope_kv_writer_ = nullptr;
    // The most new rows of one sequence in the packed step (PackInputs): 1 on a decode step,
    // which tells the backend no prefill chunk is there (PagedAttentionBatch::max_query_rows).
    int64_t step_max_query_rows_ = -1;

    // Decode buckets, and their graphs (with a backend that captures and cuda_graphs allowing).
    // The generation counts allocations of the buffers a graph points into (workspace, step
    // inputs, KV pool): graphs of an older generation are released before the next decode step.
    std::vector<int64_t> buckets_;
    GraphCapture* capture_ = nullptr;
    std::unique_ptr<DecodeGraphs> graphs_;
    int64_t buffers_generation_ = 0;
};

// Ok unless options.cuda_graphs is true where graphs cannot be had: a backend of `kind` that
// does not capture (`captures`), or tp > 1 with a collective that is not queued on the
// backend's stream (options.collective_path other than kNccl): InvalidArgument naming
// cuda_graphs and the path.
Status CheckCudaGraphs(const RunnerOptions& options, BackendKind kind, bool captures, int tp);

// Builds rank `shard`'s backend (options.backend), loads its weights from `model` into it
// (options.weight_format) and makes its runner. Errors: the backend's and LoadWeights', and
// CheckCudaGraphs'.
Result<std::unique_ptr<ModelRunner>> MakeModelRunner(const ModelFile& model, const ShardSpec& shard,
                                                     const RunnerOptions& options = {},
                                                     Collective* collective = nullptr);

}  // namespace kvshard
