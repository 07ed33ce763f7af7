// Named tensors inside a memory-mapped model file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvshard {

// Storage types of tensors in model files. Quantized types are block formats of GGUF:
// Q8_0: 32 weights = fp16 scale d + 32 int8 (w = d*q); Q4_0: fp16 d + 16 bytes of 4-bit q
// (w = d*(q-8)); Q4_1: fp16 d, fp16 m + 16 bytes (w = d*q + m). Nibble order: low nibbles are
// weights 0..15 of the block, high nibbles 16..31.
enum class DType { kF32, kF16, kBF16, kQ8_0, kQ4_0, kQ4_1 };

std::string_view DTypeName(DType dtype);
// Bytes of one row of `num_cols` elements (num_cols must be a multiple of the block size).
size_t RowBytes(DType dtype, int64_t num_cols);
// Elements per block: 1 for float types, 32 for the Q types.
int64_t BlockElements(DType dtype);

struct TensorInfo {
    std::string name;  // canonical (GGUF) name, e.g. "blk.3.attn_q.weight"
    DType dtype = DType::kF32;
    // Row-major shape, outermost first: a Linear weight is {out_features, in_features}.
    // (GGUF lists dims innermost first; the readers reverse them.)
    std::vector<int64_t> shape;
    const uint8_t* data = nullptr;  // into the mapped file; valid while the file object lives
    size_t num_bytes = 0;

    int64_t NumElements() const;
    int64_t NumRows() const;  // product of all dims but the last (1 for a vector)
    int64_t NumCols() const;  // last dim
};

// Dequantizes rows [row_begin, row_begin + num_rows) of `t` (a 1-D tensor is one row) into
// `out` (num_rows * t.NumCols() floats). REQUIRES: the range lies inside the tensor.
void DequantizeRows(const TensorInfo& t, int64_t row_begin, int64_t num_rows, float* out);

// The inverse of DequantizeRows: encodes `num_rows` rows of `num_cols` floats as `dtype` into
// `out` (num_rows * RowBytes(dtype, num_cols) bytes). Float types round to nearest even; the Q
// types pick each block's scale (and Q4_1 minimum) from its values as llama.cpp's reference
// quantizers do. For writing synthetic models and test data.
void QuantizeRows(DType dtype, const float* in, int64_t num_rows, int64_t num_cols, uint8_t* out);

// IEEE half and bfloat16 conversions.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BF16ToFloat(uint16_t b);
uint16_t FloatToBF16(float f);  // round to nearest even

}  // namespace kvshard
