// KV element encodings on the CPU, the arithmetic the paged pools store (paged_attention.h):
//  - 8-bit: int8 with a scale, and fp8 e4m3 (OCP FP8: 1 sign, 4 exponent bits with bias 7, 3
//    mantissa bits, no infinities, max 448, NaN = S.1111.111) with a scale. Both keep one fp32
//    scale per token per head: q = x / scale, scale = max|x| / (127 or 448).
//  - 16-bit, no scale: bfloat16 and IEEE fp16, rounded to nearest even (the values of
//    common/dtype.h's FloatToBF16 and FloatToHalf); decoding is exact.
// The 16-bit row conversions use AVX-512 when cpu::ActiveKernelIsa() is kAvx512 (bf16 -> fp32 as a
// 16-bit shift; fp32 -> bf16 with vcvtneps2bf16 where the CPU has AVX512_BF16; fp16 both ways
// with vcvtph2ps / vcvtps2ph), else portable C++. The only difference: vcvtneps2bf16 takes an
// fp32 subnormal input (|x| < 2^-126) as zero, where the portable path rounds it; a NaN stays a NaN
// either way (its payload may differ).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>

namespace kvshard::cpu {

// Round-to-nearest-even, saturating at ±448; NaN maps to NaN.
uint8_t FloatToFp8E4M3(float x);
float Fp8E4M3ToFloat(uint8_t v);

// Quantizes n floats; returns the scale to store (0 when all are 0).
float QuantizeInt8(const float* x, int64_t n, int8_t* out);
float QuantizeFp8(const float* x, int64_t n, uint8_t* out);
void DequantizeInt8(const int8_t* q, float scale, int64_t n, float* out);
void DequantizeFp8(const uint8_t* q, float scale, int64_t n, float* out);

// n floats to bf16 / fp16 and back.
void EncodeBf16(const float* x, int64_t n, uint16_t* out);
void DecodeBf16(const uint16_t* q, int64_t n, float* out);
void EncodeFp16(const float* x, int64_t n, uint16_t* out);
void DecodeFp16(const uint16_t* q, int64_t n, float* out);

}  // namespace kvshard::cpu
