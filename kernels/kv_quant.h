// 8-bit KV encodings on the CPU: int8 with a scale, and fp8 e4m3 (OCP FP8: 1 sign, 4 exponent
// bits with bias 7, 3 mantissa bits, no infinities, max 448, NaN = S.1111.111) with a scale.
// Both keep one fp32 scale per token per head: q = x / scale, scale = max|x| / (127 or 448).
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

}  // namespace kvshard::cpu
