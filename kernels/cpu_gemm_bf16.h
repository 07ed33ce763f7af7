// The bf16 prefill product (kernels/cpu_matmul.cc dispatches to it): y[m, n] = x[m, k] · W[n, k]^T
// with W in its stored format, for prefill-sized m, on CPUs with AVX512-BF16: with AMX tiles
// (tdpbf16ps) where the CPU and the OS offer AMX-BF16, else with vdpbf16ps in zmm registers.
//
// The activations are rounded to bf16 once per product (round to nearest even) and kept
// row-major, so the pair (x[i, 2p], x[i, 2p + 1]) is one dword that a tile broadcasts. Each strip
// of kBf16StripRows weight rows is dequantized once (the AVX-512 DequantizeRows of
// cpu_matmul_avx512.cc), rounded to bf16 and laid out with pairs of k interleaved: pair p of the
// strip is kBf16StripRows dwords, one per weight row, i.e. two zmm operands of vdpbf16ps. A tile of
// up to 12 activation rows × the strip's 32 weight rows keeps 24 fp32 accumulators in registers;
// a row of y is written directly (16 output columns per accumulator). Threads split over n.
// With AMX the strip's layout is the B operand as it lies (16 pairs × 16 weight rows a tile), the
// bf16 activation rows the A operand, and 2 × 2 accumulator tiles hold 32 activation rows × the
// strip's 32 weight rows.
//
// Accuracy: each product x·w is exact in fp32 (bf16 × bf16), the sums are fp32, so y[i, j] is the
// fp32 sum over p of bf16(x[i, p]) · bf16(w[j, p]) (vdpbf16ps adds the two products of a pair to
// the accumulator; inputs and outputs that are denormal are flushed to zero). Against the fp32
// product the error is that of rounding both operands to 8 significant bits: at most ~2^-8 of
// sum_p |x[i, p] w[j, p]|, typically ~2^-8 / sqrt(k) of it. A row's result does not depend on the
// batch it came in, the tile or the thread that computed it (each output's additions are in order
// of p) — among the products this kernel computes; the fp32 kernels of smaller m give another.
//
// Thread-safety: a pure function of its arguments; it runs on the calling thread's OpenMP team.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/cpu_matmul.h"

namespace kvshard::cpu::gemm_bf16 {

// Weight rows per strip (two zmm of fp32 lanes).
constexpr int64_t kBf16StripRows = 32;

// Products of at least this many rows take the bf16 kernel when it is chosen: those that take
// OpenBLAS sgemm on dequantized panels (or the batched-decode kernel's upper range) in fp32.
constexpr int64_t kMinBf16Rows = 49;

// How prefill-sized products are computed: fp32 (sgemm on dequantized panels, or the batched
// kernel; exact up to the order of additions) or bf16 (this kernel).
enum class PrefillMode { kFp32, kBf16 };
std::string_view PrefillModeName(PrefillMode mode);

// The mode of a KVSHARD_MATMUL_PREFILL value: nullptr (unset) is the default; "fp32" or "bf16"
// that mode; anything else the default, with *warning set to one line saying so.
PrefillMode PrefillModeFromSetting(const char* value, std::string* warning);
// The default when KVSHARD_MATMUL_PREFILL is unset.
constexpr PrefillMode kDefaultPrefillMode = PrefillMode::kFp32;

// The mode in force: KVSHARD_MATMUL_PREFILL (read once; a bad value is reported on stderr once)
// unless pinned by ForcePrefillMode.
PrefillMode ActivePrefillMode();
// Pins the mode process-wide (tests, benchmarks). Not to be called while kernels run.
void ForcePrefillMode(PrefillMode mode);
void ResetPrefillMode();

// Whether this CPU (and its OS) runs AVX512-BF16 (cpuid leaf 7 sub-leaf 1, with AVX-512 state).
bool CpuHasAvx512Bf16();

// Whether this CPU has AMX-TILE and AMX-BF16 with the OS's tile state, and Linux granted this
// process the tile data (arch_prctl, asked on the first call).
bool CpuHasAmxBf16();

// The unit that multiplies: AMX tiles when the CPU has them, else AVX512-BF16 registers. Both
// sum the same bf16 products in fp32 in order of k (the pairs' two products may be added in another
// order, so the two agree to fp32 rounding, not bit for bit).
enum class Bf16Unit { kAvx512Bf16, kAmx };
std::string_view Bf16UnitName(Bf16Unit unit);
// The best unit this CPU has, unless pinned (tests, benchmarks; a pinned unit the CPU lacks falls
// back to the one it has). Not to be called while kernels run.
Bf16Unit ActiveBf16Unit();
void ForceBf16Unit(Bf16Unit unit);
void ResetBf16Unit();

// Whether the kernel reads `dtype`: the types of the AVX-512 dequantizer but F32 (F32 weights go
// to sgemm as they are, so that an F32 model stays exact).
bool GemmBf16Reads(DType dtype);

// Whether MatMulStored of m rows against `dtype` weights on `isa` runs GemmBf16 now: the
// bf16 mode, m >= kMinBf16Rows, isa kAvx512 on a CPU with AVX512-BF16, and a type it reads.
// Elsewhere (a CPU without AVX512-BF16, or an ISA pinned below AVX-512) the fp32 path runs.
bool UsesGemmBf16(KernelIsa isa, DType dtype, int64_t m);

// y = x · W^T as above. REQUIRES: CpuHasAvx512Bf16(); GemmBf16Reads(w.dtype); m >= 1; x rows of
// stride k = w.cols, y rows of stride n = w.rows.
void GemmBf16(const float* x, int64_t m, const StoredMatrix& w, float* y);

}  // namespace kvshard::cpu::gemm_bf16
