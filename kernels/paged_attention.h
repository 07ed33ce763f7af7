// Attention through a paged KV pool (DESIGN.md "KV memory"): K/V of new tokens are written at
// their slots, and each query attends over the positions its block table holds.
//
// One block is one contiguous region holding every layer of `block_size` slots:
//   block b = base + b * block_stride
//   layer l region at l * layer_stride, inside it:
//     K data  [kv_head][slot][head_dim] elements, then V data likewise,
//     then (8-bit storage only) K scales [kv_head][slot] floats, then V scales likewise.
// Every KvDtype is stored: fp32; bf16 and fp16 (2-byte elements, no scale, written rounded to
// nearest even); int8 and fp8 e4m3 (1-byte elements with a per-token-per-head fp32 scale).
// Encodings in kernels/kv_quant.h. A layer's bytes per (head, slot) cell are
// 2 × KvRowBytes(storage, head_dim), the formula kv::KvGeometry and the planner use.
// The arithmetic of PagedAttention over fp32 storage is the arithmetic of cpu::Attention over a
// contiguous cache, operation for operation, so the two agree bit for bit; over the other
// storages both read the same decoded floats.
#pragma once

#include <cstdint>

#include "common/kv_dtype.h"

namespace kvshard::cpu {

// The K/V of one layer of a pool; the offsets locate that layer inside a block.
struct PagedKvLayer {
    uint8_t* base = nullptr;           // block 0
    int64_t block_stride = 0;          // bytes from one block to the next
    int64_t k_offset = 0;              // bytes from a block's start to this layer's K data
    int64_t v_offset = 0;              // ... V data
    int64_t k_scale_offset = 0;        // ... K scales (KvPoolHasScales only)
    int64_t v_scale_offset = 0;        // ... V scales (KvPoolHasScales only)
    KvDtype storage = KvDtype::kFp32;
    int64_t block_size = 16;
    int64_t num_kv_heads = 0;
    int64_t head_dim = 0;
};

// Bytes of one layer inside a block, and the layer's offsets, for a pool of `num_layers`.
int64_t PagedLayerBytes(KvDtype storage, int64_t block_size, int64_t num_kv_heads,
                        int64_t head_dim);
PagedKvLayer MakePagedKvLayer(uint8_t* base, int64_t block_stride, int64_t layer, KvDtype storage,
                              int64_t block_size, int64_t num_kv_heads, int64_t head_dim);

// Writes rows of K and V (n × num_kv_heads × head_dim floats, row stride `row_stride` floats) at
// slots[i] = block * block_size + offset. 16-bit storage rounds each element to nearest even; 8-bit
// storage quantizes each head of each row with its own scale.
void PagedKvWrite(const PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                  const int64_t* slots, int64_t n);

// Causal GQA attention of `num_q` query rows (q: num_q × num_heads × head_dim, row i at position
// q_pos0 + i) over positions 0 .. q_pos0 + num_q - 1 held by `block_table` (position p lives in
// block_table[p / block_size], slot p % block_size). out: num_q × num_heads × head_dim.
// kv_head_of_q: as for cpu::Attention (null: query head h uses KV head h / group).
// window > 0: a query at position p attends to positions p - window + 1 .. p only (sliding-window
// attention; positions before that are not read).
void PagedAttention(const float* q, const PagedKvLayer& kv, const int32_t* block_table, float* out,
                    int64_t num_q, int64_t q_pos0, int64_t num_heads,
                    const int32_t* kv_head_of_q = nullptr, int64_t window = 0);

// The attention of a whole step over a paged pool: one call per layer for every sequence of the
// batch (prefill chunks and decode tokens mixed). Sequence s owns query rows
// [query_starts[s], query_starts[s + 1]); its new tokens sit at the last positions of its context,
// so row query_starts[s] + i is at position context_lens[s] - n_s + i (n_s its row count) and
// attends causally to positions 0 .. that position. Its blocks are
// block_tables[block_table_starts[s] .. block_table_starts[s + 1]).
// All arrays are in the backend's memory (host memory on the CPU).
struct PagedAttentionBatch {
    int64_t num_seqs = 0;
    const int32_t* query_starts = nullptr;        // num_seqs + 1, query_starts[0] == 0
    const int32_t* context_lens = nullptr;        // num_seqs: positions after this step
    const int32_t* block_table_starts = nullptr;  // num_seqs + 1
    const int32_t* block_tables = nullptr;
    // Sliding-window attention (a windowed layer): > 0, each query attends to the last `window`
    // positions up to its own, p - window + 1 .. p, and blocks wholly before every query's window
    // are not read (their table entries may be stale). 0: causal over the whole context.
    int64_t window = 0;
    // The most new rows any one sequence brings to the step, when the caller knows it on the
    // host (the ModelRunner packs the step there): 1 on a pure-decode step, so a device backend
    // skips the prefill kernel (kernels/cuda/launch_math.h LaunchesPrefillAttention). -1:
    // unknown, every kernel that may have work is launched. The CPU reads the rows themselves.
    // REQUIRES: -1, or at least every sequence's query_starts[s + 1] - query_starts[s].
    int64_t max_query_rows = -1;
};

// q: rows × (num_heads × head_dim) floats at row stride q_stride (q may sit inside a fused QKV
// row); out: rows × num_heads × head_dim, dense. kv_head_of_q as for PagedAttention. The K/V of
// the step's new tokens must already be written (PagedKvWrite). Over fp32 storage the result
// equals PagedAttention's per sequence within float rounding (the order of the additions of the
// online softmax differs).
void PagedAttentionBatched(const float* q, int64_t q_stride, const PagedKvLayer& kv,
                           const PagedAttentionBatch& batch, float* out, int64_t num_heads,
                           const int32_t* kv_head_of_q = nullptr);

}  // namespace kvshard::cpu
