// Host-side pieces of the CUDA backend that need no device, so tests run them on every machine
// (tests/kernels/cuda_launch_math_test.cc): the conversion of a weight from the format the
// model file stores it in to the bf16 rows cuBLASLt multiplies (through the CPU's dequantizer,
// then round-to-nearest-even), and the cache of matrix-product algorithms keyed by shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "common/dtype.h"

namespace kvshard::cuda {

// `rows` rows of `cols` elements stored as `dtype` at `bytes` (RowBytes(dtype, cols) apart),
// dequantized exactly as the CPU backend reads them (DequantizeRow), as fp32.
inline std::vector<float> DequantizeRowsToF32(DType dtype, const uint8_t* bytes, int64_t rows,
                                              int64_t cols) {
    std::vector<float> out(static_cast<size_t>(rows * cols));
    const size_t row_bytes = RowBytes(dtype, cols);
    for (int64_t r = 0; r < rows; ++r) {
        DequantizeRow(dtype, bytes + static_cast<size_t>(r) * row_bytes, cols,
                      out.data() + r * cols);
    }
    return out;
}

// The same rows as bf16 (FloatToBF16: round to nearest even, NaN kept), converted row by row
// so a large matrix needs no fp32 copy of itself.
inline std::vector<uint16_t> DequantizeRowsToBf16(DType dtype, const uint8_t* bytes, int64_t rows,
                                                  int64_t cols) {
    std::vector<uint16_t> out(static_cast<size_t>(rows * cols));
    std::vector<float> row(static_cast<size_t>(cols));
    const size_t row_bytes = RowBytes(dtype, cols);
    for (int64_t r = 0; r < rows; ++r) {
        DequantizeRow(dtype, bytes + static_cast<size_t>(r) * row_bytes, cols, row.data());
        uint16_t* o = out.data() + r * cols;
        for (int64_t c = 0; c < cols; ++c) o[c] = FloatToBF16(row[static_cast<size_t>(c)]);
    }
    return out;
}

// What a matrix product's algorithm depends on: y[m, n] = x[m, k] · w[n, k]^T with the
// operands' element types (the DType of x's device copy and of w), whether y accumulates, and
// the alignment (bytes, a power of two up to 256) of w and y, which limits the kernels cuBLASLt
// may pick.
struct GemmKey {
    int64_t m = 0;
    int64_t n = 0;
    int64_t k = 0;
    DType a_type = DType::kBF16;
    DType b_type = DType::kBF16;
    bool accumulate = false;
    int w_align = 256;
    int y_align = 256;

    friend bool operator<(const GemmKey& a, const GemmKey& b) {
        return std::tie(a.m, a.n, a.k, a.a_type, a.b_type, a.accumulate, a.w_align, a.y_align) <
               std::tie(b.m, b.n, b.k, b.a_type, b.b_type, b.accumulate, b.w_align, b.y_align);
    }
    friend bool operator==(const GemmKey& a, const GemmKey& b) { return !(a < b) && !(b < a); }
};

// Algorithms chosen once per shape: Get asks `choose` the first time a key is seen and returns
// the stored choice after that. Not thread-safe (one backend, one thread).
template <typename Algo>
class GemmAlgoCache {
  public:
    const Algo& Get(const GemmKey& key, const std::function<Algo(const GemmKey&)>& choose) {
        auto it = algos_.find(key);
        if (it != algos_.end()) {
            ++hits_;
            return it->second;
        }
        ++misses_;
        return algos_.emplace(key, choose(key)).first->second;
    }
    // f(key, algo) for every stored choice (to release what the choices hold).
    template <typename F>
    void ForEach(F f) {
        for (auto& [key, algo] : algos_) f(key, algo);
    }
    size_t size() const { return algos_.size(); }
    int64_t hits() const { return hits_; }
    int64_t misses() const { return misses_; }

  private:
    std::map<GemmKey, Algo> algos_;
    int64_t hits_ = 0;
    int64_t misses_ = 0;
};

}  // namespace kvshard::cuda
