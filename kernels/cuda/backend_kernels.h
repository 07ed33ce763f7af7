// The device kernels of CudaBackend (kernels/cuda/cuda_backend.h), seen from host code: each
// function queues one or two kernels on `stream` and returns the launch's cudaError_t as an int
// (0: queued). Errors of the kernels themselves surface at the stream's next synchronization.
// All pointers are device memory; the semantics are those of the Backend op of the same name
// (kernels/backend.h). A plain header: no CUDA types or includes.
#pragma once

#include <cstdint>

#include "common/device.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {

// The text of a cudaError_t value.
const char* CudaErrorText(int error);

// out[i, :] = table row ids[i] - row_offset (rows × cols, fp32 or bf16) when inside, else 0.
int LaunchEmbeddingF32(const float* table, int64_t rows, int64_t cols, int64_t row_offset,
                       const int32_t* ids, int64_t n, float* out, StreamHandle stream);
int LaunchEmbeddingBf16(const uint16_t* table, int64_t rows, int64_t cols, int64_t row_offset,
                        const int32_t* ids, int64_t n, float* out, StreamHandle stream);

int LaunchRmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                  float eps, StreamHandle stream);
int LaunchAddRmsNorm(float* residual, const float* delta, const float* weight, float* out,
                     int64_t rows, int64_t dim, float eps, StreamHandle stream);
int LaunchAdd(float* x, const float* y, int64_t n, StreamHandle stream);
int LaunchRope(float* x, int64_t row_stride, const int32_t* positions, int64_t rows,
               int64_t num_heads, int64_t head_dim, const float* inv_freq, StreamHandle stream);
int LaunchSiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out,
                  StreamHandle stream);
int LaunchGeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out,
                      StreamHandle stream);
int LaunchAddBias(float* x, const float* bias, int64_t rows, int64_t dim, StreamHandle stream);
int LaunchHeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                      int64_t head_dim, const float* weight, float eps, StreamHandle stream);
int LaunchScale(float* x, float s, int64_t n, StreamHandle stream);
// out[i] = bf16(x[i]), round to nearest even.
int LaunchF32ToBf16(const float* x, int64_t n, uint16_t* out, StreamHandle stream);

int LaunchKvWrite(const cpu::PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                  const int64_t* slots, int64_t n, StreamHandle stream);
// RoPE of q (num_heads heads) and k (kv.num_kv_heads heads) of each row, in place, then k and v
// stored at the row's slot (skipped when negative): Rope, Rope and KvWrite in one kernel, with
// their arithmetic (kernels/cuda/rope_kv_write.cu).
int LaunchRopeKvWrite(float* q, float* k, const float* v, int64_t row_stride,
                      const int32_t* positions, const int64_t* slots, int64_t rows,
                      int64_t num_heads, const float* inv_freq, const cpu::PagedKvLayer& kv,
                      StreamHandle stream);
// `num_splits` blocks share the keys of each decode row (a sequence with one new row); their
// partial results go to `partials` (num_seqs × num_heads × num_splits × (head_dim + 2) floats)
// and a second kernel merges them. `decode_only`: sequences of more than one row are skipped (the
// prefill kernel's, kernels/cuda/prefill_attention.h); otherwise their rows are spread over the
// same blocks by row tiles. batch.window > 0: each query sees only the last `window` positions
// up to its own.
int LaunchPagedAttention(const float* q, int64_t q_stride, const cpu::PagedKvLayer& kv,
                         const cpu::PagedAttentionBatch& batch, float* out, int64_t num_heads,
                         const int32_t* kv_head_of_q, int num_splits, float* partials,
                         bool decode_only, StreamHandle stream);
int LaunchCopyBlocks(void* pool, int64_t bytes_per_block, const int32_t* src_dst,
                     int64_t num_pairs, StreamHandle stream);
int LaunchGatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n, float* out,
                     StreamHandle stream);

}  // namespace kvshard::cuda
