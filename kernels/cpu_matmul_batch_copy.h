// Which bytes the products of many rows read when a weight has an interleaved copy
// (kernels/cpu_matmul.h, StoredMatrix::interleaved): the stored rows, or the copy that batch-1
// decode reads. Implemented in cpu_matmul_batch_copy.cc.
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/cpu_matmul.h"

namespace kvshard::cpu {

// Where the products that dequantize weight rows to fp32 before multiplying them (the batched-
// decode GEMM of kernels/cpu_gemm.h, m = 16-128; the sgemm panels of prefill, m > 128; the bf16
// prefill kernel when chosen; the embedding gather) read Q4_1 and Q8_0 weights that have an
// interleaved copy:
//  - kStored: the stored rows (`data`).
//  - kCopy: the copy's whole groups (the rows past the last group from `data`), dequantized to
//    the same fp32 values bit for bit, so every product is unchanged. A prefill between batch-1
//    decode steps then streams the bytes the decode steps read, not a second copy of the weights
//    (docs/benchmarks.md, "Decode steps after a prefill (session 6)").
// The register-tiled products (m = 2-15) and the int8 kernels read the stored rows either way.
// KVSHARD_MATMUL_BATCH_WEIGHTS=stored|copy in the environment (read once), or
// ForceBatchWeightSource, picks; unset: kDefaultBatchWeightSource.
enum class BatchWeightSource { kStored, kCopy };
constexpr BatchWeightSource kDefaultBatchWeightSource = BatchWeightSource::kStored;
std::string_view BatchWeightSourceName(BatchWeightSource source);
BatchWeightSource ActiveBatchWeightSource();
// Pins the source process-wide (tests, benchmarks). Not to be called while kernels run.
void ForceBatchWeightSource(BatchWeightSource source);
void ResetBatchWeightSource();

namespace matmul_internal {

// Rows [r0, r1) of w in fp32 (stride w.cols) as DequantizeRowsAvx512 (cpu_matmul_internal.h)
// writes them, bit for bit; the rows of w's whole interleaved groups read from w.interleaved when
// it is set (Q4_1, Q8_0) and ActiveBatchWeightSource() is kCopy. REQUIRES: the CPU supports
// AVX-512 (KernelIsa::kAvx512); 0 <= r0 <= r1 <= w.rows.
void DequantizeRowsPreferCopyAvx512(const StoredMatrix& w, int64_t r0, int64_t r1, float* out);

}  // namespace matmul_internal

}  // namespace kvshard::cpu
