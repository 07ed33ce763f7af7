// Matrix products against weights kept in their stored format (common/dtype.h), and the embedding
// gather from such a table: the CPU kernels behind Backend::MatMul and Backend::Embedding.
//
// Activations stay fp32: each weight block is dequantized in registers and multiplied by fp32
// activations with fp32 accumulation, so a product equals the dequantize-at-load reference up to
// the order of the additions (no activation quantization error).
// Q5_0, Q5_1 and the K-quants (Q2_K..Q6_K, Q8_K) have no AVX kernels: at small m a weight row is
// dequantized once into fp32 scratch (common/dtype.cc) and dotted with every activation row; at
// large m they take the dequantized-panel + sgemm path like the other types.
//
// Kernel choice (KernelIsa): AVX-512 (F/BW/VL, with F16C for half scales) when the CPU has it,
// else AVX2+FMA, else portable C++. ForceKernelIsa() pins a choice for tests and benchmarks;
// asking for an ISA the CPU lacks falls back to the best one it has.
// Thread-safety: the products are pure functions of their arguments; they parallelize over output
// columns with the calling thread's OpenMP team (cpu::SetThisThreadNumThreads).
#pragma once

#include <cstdint>
#include <string_view>

#include "common/dtype.h"

namespace kvshard::cpu {

enum class KernelIsa { kPortable, kAvx2, kAvx512 };

std::string_view KernelIsaName(KernelIsa isa);
// The best ISA this CPU supports (cpuid, and the OS's saved-state support for the registers).
KernelIsa DetectedKernelIsa();
// The ISA the kernels use now: DetectedKernelIsa() unless pinned.
KernelIsa ActiveKernelIsa();
// Pins the kernels to `isa` (or the best supported one below it); process-wide, for tests and
// benchmarks. Not to be called while kernels run on other threads.
void ForceKernelIsa(KernelIsa isa);
void ResetKernelIsa();

// A weight matrix {rows, cols} in its stored format: row r at data + r * RowBytes(dtype, cols).
// REQUIRES: cols a multiple of BlockElements(dtype). `data` need not be aligned.
struct StoredMatrix {
    DType dtype = DType::kF32;
    const uint8_t* data = nullptr;
    int64_t rows = 0;
    int64_t cols = 0;
};

// y[m, n] = x[m, k] · W[n, k]^T with W = `w` (n = w.rows, k = w.cols), all row-major; x rows have
// stride k, y rows stride n. REQUIRES: m >= 1.
void MatMulStored(const float* x, int64_t m, const StoredMatrix& w, float* y);

// out[i, :] = the dequantized row ids[i] - row_offset of `table` when that lies in
// [0, table.rows), else zeros (a tensor-parallel rank holding a slice of the vocabulary).
void EmbeddingRows(const StoredMatrix& table, int64_t row_offset, const int32_t* ids, int64_t n,
                   float* out);

}  // namespace kvshard::cpu
