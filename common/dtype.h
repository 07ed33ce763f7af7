// Storage types of tensors: the one spelling of "dtype" for model files (model/), weights kept in
// their stored format (worker/) and the kernels that read them (kernels/).
// Quantized types are block formats of GGUF:
// Q8_0: 32 weights = fp16 scale d + 32 int8 (w = d*q); Q4_0: fp16 d + 16 bytes of 4-bit q
// (w = d*(q-8)); Q4_1: fp16 d, fp16 m + 16 bytes (w = d*q + m). Nibble order: low nibbles are
// weights 0..15 of the block, high nibbles 16..31.
// Q5_0: fp16 d, 4 bytes qh (bit j = 5th bit of weight j), 16 bytes of low nibbles (w = d*(q-16));
// Q5_1: fp16 d, fp16 m, qh, 16 bytes (w = d*q + m).
// K-quants: super-blocks of 256 weights in sub-blocks, with the sub-block scales quantized too.
// Q2_K (84 B): 16 bytes of 4-bit scale|4-bit min per 16 weights, 64 bytes of 2-bit q, fp16 d,
//   fp16 dmin (w = d*sc*q - dmin*m).
// Q3_K (110 B): 32 bytes hmask (3rd bit), 64 bytes 2-bit low bits, 12 bytes of sixteen 6-bit
//   scales, fp16 d (w = d*(sc-32)*(q-4)).
// Q4_K (144 B): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins (one per 32 weights),
//   128 bytes of nibbles (w = d*sc*q - dmin*m).
// Q5_K (176 B): as Q4_K plus 32 bytes qh of 5th bits.
// Q6_K (210 B): 128 bytes low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (per 16
//   weights), fp16 d (w = d*sc*(q-32)).
// Q8_K (292 B): f32 d, 256 int8 q, 16 int16 sums of 16 q (w = d*q).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvshard {

enum class DType {
    kF32,
    kF16,
    kBF16,
    kQ8_0,
    kQ4_0,
    kQ4_1,
    kQ5_0,
    kQ5_1,
    kQ2_K,
    kQ3_K,
    kQ4_K,
    kQ5_K,
    kQ6_K,
    kQ8_K,
};

// The K-quant types (super-blocks of 256).
bool IsKQuant(DType dtype);

std::string_view DTypeName(DType dtype);
// Elements per block: 1 for float types, 32 for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1, 256 for K-quants.
int64_t BlockElements(DType dtype);
// Bytes of one block of `dtype` (one element for the float types).
size_t BlockBytes(DType dtype);
// Bytes of one row of `num_cols` elements (num_cols must be a multiple of the block size).
size_t RowBytes(DType dtype, int64_t num_cols);

// Dequantizes one row of `num_cols` elements stored as `dtype` at `src` (may be unaligned) into
// `out`. REQUIRES: num_cols a multiple of BlockElements(dtype).
void DequantizeRow(DType dtype, const uint8_t* src, int64_t num_cols, float* out);

// IEEE half and bfloat16 conversions.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BF16ToFloat(uint16_t b);
uint16_t FloatToBF16(float f);  // round to nearest even

}  // namespace kvshard
