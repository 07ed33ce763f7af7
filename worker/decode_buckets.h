// Decode buckets: the batch sizes a pure-decode step (every sequence bringing one new token) is
// padded to, so that a step of b sequences runs with the fixed shapes of its bucket — the shapes
// a CUDA graph of that bucket was captured with (ModelRunner, docs/cuda.md "CUDA graphs").
//
// The sizes follow vLLM's capture sizes (vllm/worker/model_runner.py, _BATCH_SIZES_TO_CAPTURE:
// 1, 2, 4 and then every multiple of 8), cut at the runner's max_num_seqs, which is itself the
// last bucket: a batch pads by at most 7 rows once past 8 (at most 3 below), and a server with
// max_num_seqs 256 keeps 35 graphs.
//
// Padding is pure bookkeeping over the step's packed inputs: padded rows come after every real
// row, carry token 0 at position 0, write no KV (slot kPadSlot, which the backends' KvWrite
// skips) and belong to no sequence; padded sequences own no rows, no blocks and a context of 0
// (the attention kernels do nothing for them), and their "last row" is a padded row, so the
// logits of a padded step are those of the real step followed by rows the runner drops.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

namespace kvshard {

// The slot of a padded row: its K/V are not written (Backend::KvWrite skips negative slots).
inline constexpr int64_t kPadSlot = -1;

// The buckets for steps of at most `max_num_seqs` sequences, ascending: 1, 2, 4, 8, 16, 24, ...
// up to max_num_seqs, which is always the last. REQUIRES: max_num_seqs >= 1.
std::vector<int64_t> DecodeBuckets(int64_t max_num_seqs);

// The smallest bucket holding `num_seqs` sequences, or 0 when num_seqs is above the last (the
// step then runs as it is). REQUIRES: `buckets` ascending (DecodeBuckets), num_seqs >= 1.
int64_t BucketFor(const std::vector<int64_t>& buckets, int64_t num_seqs);

// Host views of a step's packed inputs, as ModelRunner lays them out: the slots and the block
// table starts repeat for each of `num_groups` KV cache groups, `slots_stride` and
// `table_starts_stride` elements apart.
struct StepInputsView {
    int32_t* ids = nullptr;           // per row
    int32_t* positions = nullptr;     // per row
    int64_t* slots = nullptr;         // per row, per group
    int64_t slots_stride = 0;         // elements from one group's slots to the next
    int32_t* query_starts = nullptr;  // per sequence + 1
    int32_t* context_lens = nullptr;  // per sequence
    int32_t* table_starts = nullptr;  // per sequence + 1, per group
    int64_t table_starts_stride = 0;  // elements from one group's table starts to the next
    int32_t* last_rows = nullptr;     // per sequence
    int64_t num_groups = 1;
};

// Fills rows [rows, padded_rows) and sequences [num_seqs, padded_seqs) of a step whose first
// `rows` rows and `num_seqs` sequences are packed, as padding (see above): padded sequence
// num_seqs + i has last row rows + i (or the last padded row when there are fewer padded rows).
// REQUIRES: padded_rows - rows >= 1 when padded_seqs > num_seqs; the views hold padded_rows rows
// and padded_seqs sequences.
void PadStepInputs(const StepInputsView& in, int64_t rows, int64_t num_seqs, int64_t padded_rows,
                   int64_t padded_seqs);

}  // namespace kvshard
