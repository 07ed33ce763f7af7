// Storage types of tensors: the one spelling of "dtype" for model files (model/), weights kept in
// their stored format (worker/) and the kernels that read them (kernels/).
// Quantized types are block formats of GGUF:
// Q8_0: 32 weights = fp16 scale d + 32 int8 (w = d*q); Q4_0: fp16 d + 16 bytes of 4-bit q
// (w = d*(q-8)); Q4_1: fp16 d, fp16 m + 16 bytes (w = d*q + m). Nibble order: low nibbles are
// weights 0..15 of the block, high nibbles 16..31.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvshard {

enum class DType { kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1 };

std::string_view DTypeName(DType dtype);
// Elements per block: 1 for float types, 32 for the Q types.
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
