// Matrix products against weights kept in their stored format (common/dtype.h), and the embedding
// gather from such a table: the CPU kernels behind Backend::MatMul and Backend::Embedding.
//
// Three activation formats (ActivationFormat), for Q8_0, Q4_0 and Q4_1 weights:
//  - kInt16 (opt-in; needs AVX512_VNNI and the AVX-512 kernels active): every product against
//    Q4_1 weights, whatever its number of rows, multiplies the activations rounded to int16 per
//    32-element block (s_b = max|x| / 32767, q = round(x / s_b), x' = s_b · q; an element's
//    error is at most 1.5e-5 of its block's largest |x|). A single row against an interleaved
//    copy multiplies q with vpdpwssd, 2.2x the fp32 kernel's rate (docs/benchmarks.md, "int16
//    activations for batch-1 decode"); every other product (batches, prefill, the rows past the
//    last interleaved group) gives x' to the fp32 kernels. Both compute the product of the same
//    x' (the min term takes the block sums of x'), so a row's product is the same, up to fp32
//    rounding, alone, in a batch or in a prompt (tests/kernels/cpu_matmul_int16_test.cc). Q8_0 (the
//    default model's tied classifier) keeps fp32 rows: its fp32 kernel already reads at memory
//    speed on two cores. Other weight types, other ISAs and CPUs without VNNI: kFp32.
//    Opt-in because the rounding is discontinuous: a float-rounding difference upstream (tp N's
//    row-parallel sums, another kernel's order of additions for another batch size, a prefix
//    reused) flips some rounded activations, and the flips grow through the layers to about
//    int16's own distance from fp32. On the default model: tp 2 / 3 prompt logits 1.4e-4 /
//    1.1e-4 of the largest from tp 1's (DESIGN.md's tp rule asks 1e-5), a sequence alone vs
//    batched 0.0047 (RunnerInvariance asks 1e-3) (docs/benchmarks.md, "Batch-1 decode: int16 by
//    default").
//  - kFp32 (the default), exact: each weight block is dequantized in registers and multiplied by
//    fp32 activations with fp32 accumulation, so a product equals the dequantize-at-load
//    reference up to the order of the additions.
//  - kInt8: the activations are rounded to blocks of 32 signed bytes with one fp32 scale per
//    block (d = max|x| / 127, q = round(x / d)) and the product is that of the dequantized
//    weights and d·q. At m <= kMaxInt8KernelRows on AVX2/AVX-512 (decode, small batches) the
//    kernels multiply the bytes with integer dot products (AVX-512 VNNI vpdpbusd, else AVX2
//    vpmaddubsw), one fp32 scale per block; otherwise (prefill, the portable ISA) the rounded
//    activations go to the fp32 kernels, so a row's product is the same up to fp32 rounding
//    whatever batch it is in. The error is that of 8-bit activations (bounded in
//    tests/kernels/cpu_matmul_test.cc and tests/worker/weight_format_test.cc).
//  KVSHARD_MATMUL_ACTIVATIONS=fp32|int16|int8 in the environment (read once), or
//  ForceActivationFormat, picks the format; fp32, the exact one, is the default.
//  kInt8 is opt-in: rounding is discontinuous, so an fp32-rounding difference upstream (a
//  tp N row-parallel sum, another batch, a prefix-cache hit) can flip a rounded activation and
//  the flip grows through the layers; logits of tp 2 vs tp 1 then differ by ~7% of the largest
//  |logit| instead of 1e-6 (DESIGN.md's tensor-parallel rule asks 1e-5). F32/F16/BF16, Q5_0/Q5_1
//  and the K-quants always take fp32 activations.
// Kernel choice (KernelIsa): AVX-512 (F/BW/VL, with F16C for half scales) when the CPU has it,
// else AVX2+FMA, else portable C++. The AVX2/AVX-512 kernels read F16, BF16, Q8_0, Q4_0, Q4_1,
// Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (F32 goes to sgemm); Q2_K, Q3_K and Q8_K take the portable
// kernel (a row dequantized, then dotted) whatever the ISA. ForceKernelIsa() pins a choice for
// tests and benchmarks; asking for an ISA the CPU lacks falls back to the best one it has.
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

enum class ActivationFormat { kFp32, kInt8, kInt16 };

// Products of at most this many activation rows take the int8 dot-product kernels.
// kvshard_matmul_bench (SmolLM2-135M shapes; docs/benchmarks.md, issue 10) puts them ahead of
// the fp32 kernels on rounded activations up to here.
constexpr int64_t kMaxInt8KernelRows = 16;

std::string_view ActivationFormatName(ActivationFormat format);
// The format in force: the process default (KVSHARD_MATMUL_ACTIVATIONS, else kFp32) unless
// forced.
ActivationFormat ActiveActivationFormat();
// Pins the format process-wide (tests, benchmarks, an exact reference run). Not to be called
// while kernels run on other threads.
void ForceActivationFormat(ActivationFormat format);
void ResetActivationFormat();
// Whether products with `dtype` weights round the activations to 8 bits now.
bool QuantizesActivations(DType dtype);
// Whether MatMulStored of m rows against `dtype` weights runs the int8 dot-product kernels now.
bool UsesInt8Kernels(DType dtype, int64_t m);

// A weight matrix {rows, cols} in its stored format: row r at data + r * RowBytes(dtype, cols).
// REQUIRES: cols a multiple of BlockElements(dtype). `data` need not be aligned.
// `interleaved`, when not null, is a second copy of the matrix's whole groups of kInterleaveRows
// rows in the interleaved layout (InterleaveRows), which single-row products read instead of
// `data` where the ISA has a kernel for it; every other product reads `data`.
struct StoredMatrix {
    DType dtype = DType::kF32;
    const uint8_t* data = nullptr;
    int64_t rows = 0;
    int64_t cols = 0;
    const uint8_t* interleaved = nullptr;
};

// The interleaved layout of Q4_1 and Q8_0 rows, for single-row products (batch-1 decode). A
// single-row product over the stored layout spends most of its instructions per 32-weight block
// on the block's own scale (converted from fp16, broadcast; Q4_1's 16-entry table d·q + m built)
// and needs a horizontal sum per weight row; with kInterleaveRows rows side by side, one zmm lane
// per row, the scales of 16 rows convert in one instruction and a block costs the quants'
// conversion and the FMAs (docs/benchmarks.md, issue 10: Q4_1 1.16 against 1.91 ns per 32-weight
// block and row with the weights in cache, Q8_0 1.11 against 1.68, on this machine's AVX-512).
// The bytes are those of the stored rows, rearranged: group g (rows 16g .. 16g + 15) at
// g * 16 * RowBytes, and in it block b at b * 16 * BlockBytes: the 16 rows' fp16 scales d (Q4_1:
// then their fp16 mins m), then the quants in 32-byte units, unit t holding bytes 2t and 2t + 1
// of each of the 16 rows in turn (Q4_1: 8 units, byte j holding weights j and j + 16; Q8_0: 16
// units). A unit zero- or sign-extended to words is 16 dword lanes of two columns of one row each,
// the operand of vpdpwssd (the int16 kernel); the fp32 kernel extends it to one word per lane.
// A row's product is sum_b d_b (sum_i q_i x_i)
// (+ m_b (sum_i x_i) for Q4_1): the stored layout's fp32 arithmetic up to the order of the
// additions and where the scale is applied (the results agree to fp32 rounding, not bit for bit).
constexpr int64_t kInterleaveRows = 16;
// Bytes of the interleaved copy of `w` (its whole groups of kInterleaveRows rows); 0 when the
// active ISA has no interleaved kernel for w.dtype (AVX-512 only, Q4_1 and Q8_0) or w has no
// whole group.
size_t InterleavedBytes(const StoredMatrix& w);
// Writes the interleaved copy of w's whole groups to `out` (InterleavedBytes(w) bytes).
// REQUIRES: InterleavedBytes(w) > 0.
void InterleaveRows(const StoredMatrix& w, uint8_t* out);

// Whether MatMulStored against `dtype` weights rounds the activations to int16 now (kInt16,
// AVX-512 kernels active, AVX512_VNNI, Q4_1), whatever the number of rows.
bool RoundsToInt16(DType dtype);

// y[m, n] = x[m, k] · W[n, k]^T with W = `w` (n = w.rows, k = w.cols), all row-major; x rows have
// stride k, y rows stride n. REQUIRES: m >= 1. A single row (m = 1) with fp32 or int16
// activations reads w.interleaved when it is set and the active ISA has its kernel; a row's
// result then does not depend on how the team splits the product (whole groups always take the
// interleaved kernel, the rows past the last group the stored one with the same activations).
void MatMulStored(const float* x, int64_t m, const StoredMatrix& w, float* y);

// out[i, :] = the dequantized row ids[i] - row_offset of `table` when that lies in
// [0, table.rows), else zeros (a tensor-parallel rank holding a slice of the vocabulary).
void EmbeddingRows(const StoredMatrix& table, int64_t row_offset, const int32_t* ids, int64_t n,
                   float* out);

}  // namespace kvshard::cpu
