// Named tensors inside a memory-mapped model file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"

namespace kvshard {

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
// quantizers do. For writing synthetic models and test data. REQUIRES: dtype is F32, F16, BF16,
// Q8_0, Q4_0 or Q4_1 (the Q5 and K-quant types are read, not written: llama-quantize makes them).
void QuantizeRows(DType dtype, const float* in, int64_t num_rows, int64_t num_cols, uint8_t* out);

}  // namespace kvshard
