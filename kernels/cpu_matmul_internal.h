// Internals shared by kernels/cpu_matmul.cc, its ISA files (cpu_matmul_avx512.cc,
// cpu_matmul_packed_avx512.cc, cpu_matmul_avx2.cc) and the batched-decode kernel (cpu_gemm.cc): the entry points of the ISA kernels and the 8-bit activation blocks of the
// int8 path. Not for use outside those files.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kernels/cpu_matmul.h"

namespace kvshard::cpu::matmul_internal {

// Whether the AVX2/AVX-512 kernels (and the batched-decode kernel, kernels/cpu_gemm.h, for the
// types other than F32) read `dtype`; the others take the portable kernel.
bool HasSimdKernel(DType dtype);

// The fp32-activation kernels (x86-64 only). MatMulRows* computes y[i, j] for i < m and j in
// [n0, n1) (y rows of stride w.rows); DequantizeRows* writes rows [r0, r1) of `w` to out (stride
// w.cols). REQUIRES: the CPU supports the ISA; w.dtype != kF32 for MatMulRows*.
void MatMulRowsAvx512(const float* x, int64_t m, const StoredMatrix& w, int64_t n0, int64_t n1,
                      float* y);
void DequantizeRowsAvx512(const StoredMatrix& w, int64_t r0, int64_t r1, float* out);
void MatMulRowsAvx2(const float* x, int64_t m, const StoredMatrix& w, int64_t n0, int64_t n1,
                    float* y);
// Single-row products over interleaved copies (cpu_matmul_packed_avx512.cc).
// One fp32 activation row against the interleaved groups [g0, g1) of w (cpu_matmul.h,
// InterleaveRows): y[16 g + r] for r < kInterleaveRows. block_sums[b] = the sum of x's block b
// (32 floats; read for Q4_1 only). REQUIRES: w.interleaved set, w.dtype Q4_1 or Q8_0, the CPU
// supports AVX-512.
void MatMulInterleavedAvx512(const float* x, const float* block_sums, const StoredMatrix& w,
                             int64_t g0, int64_t g1, float* y);
// One activation row rounded to int16 per 32-element block (ActivationFormat::kInt16): values[i]
// = round(x[i] / s_b) with s_b = max|x in block b| / 32767 (0 for a block of zeros); scales[b] =
// s_b / 16 (the Q4_1 kernel sums 16 x the high nibbles' products); sums[b] = the rounded block's
// sum, s_b · sum_i values[i] (Q4_1's min term), so the product is exactly that of the rounded row
// up to fp32 rounding. values 64-byte aligned for the kernel's broadcasts.
struct ActivationsInt16 {
    const int16_t* values = nullptr;
    const float* scales = nullptr;
    const float* sums = nullptr;
};
// Rounds x (k floats) into values (k), scales and sums (k / 32 each). REQUIRES: k a multiple of
// 32; the CPU supports AVX-512.
void QuantizeRowInt16Avx512(const float* x, int64_t k, int16_t* values, float* scales,
                            float* sums);
// out[i] = s_b · values[i] of QuantizeRowInt16Avx512, for `count` floats of any number of rows
// (the same values and scales, block by block): the rounded activations that the fp32 kernels
// multiply wherever kInt16 rounds a product without the int16 kernel (batches, prefill, the rows
// past the last interleaved group). REQUIRES: count a multiple of 32; the CPU supports AVX-512.
void RoundRowsInt16Avx512(const float* x, int64_t count, float* out);
// MatMulInterleavedAvx512 with the row rounded by QuantizeRowInt16Avx512, multiplied with
// vpdpwssd. REQUIRES: as MatMulInterleavedAvx512, w.dtype Q4_1, and AVX512_VNNI.
void MatMulInterleavedInt16Avx512(const ActivationsInt16& x, const StoredMatrix& w, int64_t g0,
                                  int64_t g1, float* y);
void DequantizeRowsAvx2(const StoredMatrix& w, int64_t r0, int64_t r1, float* out);

// The int8-activation kernels (kernels/cpu_matmul.h, ActivationFormat::kInt8) for Q8_0, Q4_0 and
// Q4_1 weights. Quantize*Rows writes the m activation rows of k floats (x, stride k) as 8-bit
// blocks in the ISA's own layout into `out` (Int8*Bytes(m, k) bytes, 64-byte aligned); the
// product then reads them once per weight strip. REQUIRES: k a multiple of 32; the CPU supports
// the ISA (AVX-512 with VNNI for the Avx512 pair).
size_t Int8Avx512Bytes(int64_t m, int64_t k);
void QuantizeRowsAvx512(DType dtype, const float* x, int64_t m, int64_t k, uint8_t* out);
void MatMulRowsInt8Avx512(const uint8_t* xq, int64_t m, const StoredMatrix& w, int64_t n0,
                          int64_t n1, float* y);
size_t Int8Avx2Bytes(int64_t m, int64_t k);
void QuantizeRowsAvx2(DType dtype, const float* x, int64_t m, int64_t k, uint8_t* out);
void MatMulRowsInt8Avx2(const uint8_t* xq, int64_t m, const StoredMatrix& w, int64_t n0, int64_t n1,
                        float* y);

// The K-quant super-block (256 weights) of Q4_K, Q5_K and Q6_K, which the fp32 kernels read in
// eight sub-blocks of 32 weights (common/dtype.h has the layouts).
constexpr int64_t kSuperBlock = 256;

// The eight 6-bit scales and eight 6-bit mins of a Q4_K/Q5_K super-block (the 12 bytes at
// `packed`) as 16 bytes: scales 0..7, then mins 0..7. Bytes 0..3 of `packed` hold scales 0..3 in
// their low 6 bits, bytes 4..7 mins 0..3; bytes 8..11 the low 4 bits of scales 4..7 (low nibble)
// and mins 4..7 (high nibble), whose top 2 bits are the top bits of bytes 0..3 and 4..7. Four
// bytes at a time: a shift by 6 of a word brings each byte's top bits to its own low bits.
inline void UnpackScalesK4(const uint8_t* packed, uint8_t out[16]) {
    uint32_t u[3];
    std::memcpy(u, packed, sizeof(u));
    constexpr uint32_t kLow6 = 0x3F3F3F3Fu;
    constexpr uint32_t kLow4 = 0x0F0F0F0Fu;
    constexpr uint32_t kLow2 = 0x03030303u;
    const uint32_t s[4] = {u[0] & kLow6, (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4),
                           u[1] & kLow6, ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4)};
    std::memcpy(out, s, sizeof(s));
}

constexpr int64_t kInt8Block = 32;

// One block of 32 activations as symmetric 8-bit integers: q[i] = round(x[i] / d) with
// d = max|x| / 127 (q in [-127, 127]; a block of zeros gets d = 0). Returns d; *sum_q is the sum
// of the q[i] (Q4_1's offset term is its min times d · sum_q).
inline float QuantizeBlock32(const float* x, int8_t* q, int32_t* sum_q) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sq = 0;
    for (int i = 0; i < 32; ++i) {
        const float v = std::clamp(std::nearbyint(x[i] * inv), -127.0f, 127.0f);
        q[i] = static_cast<int8_t>(v);
        sq += q[i];
    }
    *sum_q = sq;
    return d;
}

// out[i] = d · q[i] of QuantizeBlock32: the activations the int8 kernels multiply, for the fp32
// kernels (products of more than kMaxInt8KernelRows rows, or the portable ISA).
inline void RoundTripBlock32(const float* x, float* out) {
    int8_t q[32];
    int32_t sum_q;
    const float d = QuantizeBlock32(x, q, &sum_q);
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]);
}

}  // namespace kvshard::cpu::matmul_internal
