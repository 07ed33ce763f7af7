#include "model/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/check.h"

namespace kvshard {
namespace {

constexpr int64_t kQBlock = 32;

void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, sizeof(v)); }

void QuantizeRow(DType dtype, const float* in, int64_t num_cols, uint8_t* dst) {
    switch (dtype) {
        case DType::kF32:
            std::memcpy(dst, in, static_cast<size_t>(num_cols) * sizeof(float));
            return;
        case DType::kF16:
            for (int64_t i = 0; i < num_cols; ++i) StoreU16(dst + 2 * i, FloatToHalf(in[i]));
            return;
        case DType::kBF16:
            for (int64_t i = 0; i < num_cols; ++i) StoreU16(dst + 2 * i, FloatToBF16(in[i]));
            return;
        case DType::kQ8_0:
            for (int64_t b = 0; b < num_cols / kQBlock; ++b, in += kQBlock, dst += 34) {
                float amax = 0;
                for (int j = 0; j < kQBlock; ++j) amax = std::max(amax, std::fabs(in[j]));
                const float d = amax / 127.0f;
                const float id = d != 0 ? 1.0f / d : 0.0f;
                StoreU16(dst, FloatToHalf(d));
                auto* q = reinterpret_cast<int8_t*>(dst + 2);
                for (int j = 0; j < kQBlock; ++j)
                    q[j] = static_cast<int8_t>(std::round(in[j] * id));
            }
            return;
        case DType::kQ4_0:
            for (int64_t b = 0; b < num_cols / kQBlock; ++b, in += kQBlock, dst += 18) {
                float amax = 0;
                float max = 0;  // the value of largest magnitude, with its sign
                for (int j = 0; j < kQBlock; ++j) {
                    if (std::fabs(in[j]) > amax) {
                        amax = std::fabs(in[j]);
                        max = in[j];
                    }
                }
                const float d = max / -8.0f;
                const float id = d != 0 ? 1.0f / d : 0.0f;
                StoreU16(dst, FloatToHalf(d));
                for (int j = 0; j < 16; ++j) {
                    const int lo = std::min(15, static_cast<int>(in[j] * id + 8.5f));
                    const int hi = std::min(15, static_cast<int>(in[j + 16] * id + 8.5f));
                    dst[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
                }
            }
            return;
        case DType::kQ4_1:
            for (int64_t b = 0; b < num_cols / kQBlock; ++b, in += kQBlock, dst += 20) {
                float min = in[0];
                float max = in[0];
                for (int j = 1; j < kQBlock; ++j) {
                    min = std::min(min, in[j]);
                    max = std::max(max, in[j]);
                }
                const float d = (max - min) / 15.0f;
                const float id = d != 0 ? 1.0f / d : 0.0f;
                StoreU16(dst, FloatToHalf(d));
                StoreU16(dst + 2, FloatToHalf(min));
                for (int j = 0; j < 16; ++j) {
                    const int lo = std::min(15, static_cast<int>((in[j] - min) * id + 0.5f));
                    const int hi = std::min(15, static_cast<int>((in[j + 16] - min) * id + 0.5f));
                    dst[4 + j] = static_cast<uint8_t>(lo | (hi << 4));
                }
            }
            return;
        case DType::kQ5_0:
        case DType::kQ5_1:
        case DType::kQ2_K:
        case DType::kQ3_K:
        case DType::kQ4_K:
        case DType::kQ5_K:
        case DType::kQ6_K:
        case DType::kQ8_K:
            // These come from llama.cpp's quantizer (llama-quantize); kvshard only reads them.
            KV_CHECK(false) << "QuantizeRows does not encode " << DTypeName(dtype);
            return;
    }
}

}  // namespace

int64_t TensorInfo::NumElements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
}

int64_t TensorInfo::NumRows() const {
    int64_t n = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) n *= shape[i];
    return n;
}

int64_t TensorInfo::NumCols() const { return shape.empty() ? 1 : shape.back(); }

void DequantizeRows(const TensorInfo& t, int64_t row_begin, int64_t num_rows, float* out) {
    KV_CHECK(row_begin >= 0 && num_rows >= 0 && row_begin + num_rows <= t.NumRows())
        << t.name << ": rows [" << row_begin << ", " << row_begin + num_rows << ") of "
        << t.NumRows();
    const int64_t cols = t.NumCols();
    const size_t row_bytes = RowBytes(t.dtype, cols);
    KV_CHECK_LE(static_cast<size_t>(row_begin + num_rows) * row_bytes, t.num_bytes) << t.name;
    for (int64_t r = 0; r < num_rows; ++r) {
        DequantizeRow(t.dtype, t.data + static_cast<size_t>(row_begin + r) * row_bytes, cols,
                      out + r * cols);
    }
}

void QuantizeRows(DType dtype, const float* in, int64_t num_rows, int64_t num_cols, uint8_t* out) {
    const size_t row_bytes = RowBytes(dtype, num_cols);
    for (int64_t r = 0; r < num_rows; ++r) {
        QuantizeRow(dtype, in + r * num_cols, num_cols, out + static_cast<size_t>(r) * row_bytes);
    }
}

}  // namespace kvshard
