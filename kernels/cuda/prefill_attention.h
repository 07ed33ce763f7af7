// The FA2-style attention of prefill chunks on the CUDA backend (kernels/cuda/prefill_attention.cu),
// seen from host code. A plain header: no CUDA types or includes.
//
// Every sequence of the step with more than one new row is cut into query tiles (up to 64 query
// vectors: rows × heads of one KV head's GQA group, kernels/cuda/launch_math.h PlanPrefill); one
// block takes one tile at a time and walks the tile's keys — from its first row's window start
// to its last row's position — through the block table in 32-key K/V tiles, each read from the
// pool into shared memory once for all the tile's queries and decoded to fp32 (every KvDtype the
// pool stores). Scores and the online softmax are fp32 FMA tiles (no tensor cores); the causal
// mask and the sliding window are by absolute position (KeyVisible). Decode rows (one new row)
// are left to the split-KV kernel (LaunchPagedAttention with decode_only).
#pragma once

#include <cstdint>

#include "common/device.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {

// q: the step's rows at q_stride floats; out: rows × num_heads × head_dim (rows of decode
// sequences are not written). `grid_blocks` blocks stride over the step's tiles (PrefillGrid).
// REQUIRES: 1 <= kv.head_dim <= 256, num_heads <= kAttnMaxHeads, the step's K/V written.
// Returns the launch's cudaError_t as an int (0: queued).
int LaunchPrefillAttention(const float* q, int64_t q_stride, const cpu::PagedKvLayer& kv,
                           const cpu::PagedAttentionBatch& batch, float* out, int64_t num_heads,
                           const int32_t* kv_head_of_q, unsigned grid_blocks, StreamHandle stream);

// The same attention with tensor cores (kernels/cuda/prefill_attention_tc.cu): K/V tiles in bf16
// (bf16 pools as stored, fp8/int8 pools dequantized to bf16), Q rounded to bf16, Q·Kᵀ and P·V as
// mma.sync m16n8k16 bf16 products with fp32 accumulation, the softmax in fp32. About 3 significant
// digits (bf16): the fp32 kernel above is its oracle. 64-query tiles (PlanPrefill(group,
// kTcQueries)) over 64-key tiles.
// REQUIRES: TcPrefillSupports(kv.storage, kv.head_dim) (kernels/cuda/prefill_select.h), sm_80+,
// num_heads <= kAttnMaxHeads, the step's K/V written. Returns the launch's cudaError_t as an int.
int LaunchPrefillAttentionTc(const float* q, int64_t q_stride, const cpu::PagedKvLayer& kv,
                             const cpu::PagedAttentionBatch& batch, float* out, int64_t num_heads,
                             const int32_t* kv_head_of_q, unsigned grid_blocks,
                             StreamHandle stream);

}  // namespace kvshard::cuda
