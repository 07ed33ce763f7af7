// The register-blocked product of batched decode (kernels/cpu_matmul.cc dispatches to it): y[m, n]
// = x[m, k] · W[n, k]^T with W in its stored format, for the m of a decode step of 16-128 rows.
//
// Each strip of kGemmStripRows weight rows is dequantized once into fp32 in L1 (the AVX-512
// DequantizeRows of cpu_matmul_avx512.cc) and then multiplied by every activation row: the
// activations are transposed once per product (x^T, k rows of m floats, zero-padded to a multiple
// of 16), so a zmm holds one column of 16 activation rows and each dequantized weight is
// broadcast from L1 into 32 x 12 or 16 x 12 accumulators. The register-tiled kernels of
// cpu_matmul_avx512.cc dequantize a weight block once per tile of a few activation rows instead,
// which at m = 32 costs about as many port cycles as the FMAs themselves.
//
// Exact in the sense of kernels/cpu_matmul.h: y[i, j] is the fp32 sum of x[i, p] · w[j, p] over
// p = 0, 1, ..., k - 1 in that order, one fused multiply-add at a time from 0, whatever m, the tile
// or the thread that computes it; so a row's product does not depend on the batch it came in
// (among the products this kernel computes).
// Thread-safety: a pure function of its arguments; it runs on the calling thread's OpenMP team.
#pragma once

#include <cstdint>

#include "kernels/cpu_matmul.h"

namespace kvshard::cpu::gemm {

// Weight rows per strip: one dequantized strip (12 rows of k floats) is the tile's B operand.
constexpr int64_t kGemmStripRows = 12;

// Whether the kernel reads `dtype` (the types the AVX-512 DequantizeRows reads, F32 aside: F32
// weights go to sgemm as they are).
bool GemmReads(DType dtype);

// The products MatMulStored gives this kernel: m in [kMinGemmRows, kMaxGemmRows] (below, the
// register-tiled kernels share a dequantized block among all rows of a tile; above, OpenBLAS's
// sgemm on dequantized panels runs closer to the FMA peak), on AVX-512, for a type it reads.
// kvshard_matmul_bench --gemm off,auto compares them (docs/benchmarks.md, 2026-12-02 session 2).
constexpr int64_t kMinGemmRows = 16;
constexpr int64_t kMaxGemmRows = 128;

enum class GemmMode { kAuto, kOff, kOn };
// Whether MatMulStored of m rows against `dtype` weights on `isa` runs GemmAvx512 now: in kAuto
// (the default) by the row bounds above; kOff never; kOn for every m (tests and benchmarks).
// The process's mode is KVSHARD_MATMUL_GEMM=auto|off|on in the environment (read once; unset:
// auto) unless pinned by ForceGemmMode.
bool UsesGemm(KernelIsa isa, DType dtype, int64_t m);
// Pins the mode process-wide (tests, benchmarks). Not to be called while kernels run.
void ForceGemmMode(GemmMode mode);
void ResetGemmMode();

// y = x · W^T as above. REQUIRES: the CPU supports AVX-512 F/BW/VL/DQ (KernelIsa::kAvx512);
// GemmReads(w.dtype); m >= 1; x rows of stride k = w.cols, y rows of stride n = w.rows.
void GemmAvx512(const float* x, int64_t m, const StoredMatrix& w, float* y);

}  // namespace kvshard::cpu::gemm
