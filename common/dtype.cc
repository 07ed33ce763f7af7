#include "common/dtype.h"

#include <bit>
#include <cstring>

#include "common/check.h"

namespace kvshard {
namespace {

constexpr int64_t kQBlock = 32;

// Model files are little-endian and the pointers may be unaligned (safetensors does not align).
uint16_t LoadU16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

}  // namespace

// Bytes of one block of each type (one element for the float types).
size_t BlockBytes(DType dtype) {
    switch (dtype) {
        case DType::kF32:
            return 4;
        case DType::kF16:
        case DType::kBF16:
            return 2;
        case DType::kQ8_0:
            return 2 + 32;
        case DType::kQ4_0:
            return 2 + 16;
        case DType::kQ4_1:
            return 2 + 2 + 16;
    }
    return 0;
}

void DequantizeRow(DType dtype, const uint8_t* src, int64_t num_cols, float* out) {
    switch (dtype) {
        case DType::kF32:
            std::memcpy(out, src, static_cast<size_t>(num_cols) * sizeof(float));
            return;
        case DType::kF16:
            for (int64_t i = 0; i < num_cols; ++i) out[i] = HalfToFloat(LoadU16(src + 2 * i));
            return;
        case DType::kBF16:
            for (int64_t i = 0; i < num_cols; ++i) out[i] = BF16ToFloat(LoadU16(src + 2 * i));
            return;
        case DType::kQ8_0:
            for (int64_t b = 0; b < num_cols / kQBlock; ++b, src += 34, out += kQBlock) {
                const float d = HalfToFloat(LoadU16(src));
                const auto* q = reinterpret_cast<const int8_t*>(src + 2);
                for (int j = 0; j < kQBlock; ++j) out[j] = d * static_cast<float>(q[j]);
            }
            return;
        case DType::kQ4_0:
            for (int64_t b = 0; b < num_cols / kQBlock; ++b, src += 18, out += kQBlock) {
                const float d = HalfToFloat(LoadU16(src));
                const uint8_t* q = src + 2;
                for (int j = 0; j < 16; ++j) {
                    out[j] = d * static_cast<float>((q[j] & 0x0F) - 8);
                    out[j + 16] = d * static_cast<float>((q[j] >> 4) - 8);
                }
            }
            return;
        case DType::kQ4_1:
            for (int64_t b = 0; b < num_cols / kQBlock; ++b, src += 20, out += kQBlock) {
                const float d = HalfToFloat(LoadU16(src));
                const float m = HalfToFloat(LoadU16(src + 2));
                const uint8_t* q = src + 4;
                for (int j = 0; j < 16; ++j) {
                    out[j] = d * static_cast<float>(q[j] & 0x0F) + m;
                    out[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
                }
            }
            return;
    }
}

std::string_view DTypeName(DType dtype) {
    switch (dtype) {
        case DType::kF32:
            return "F32";
        case DType::kF16:
            return "F16";
        case DType::kBF16:
            return "BF16";
        case DType::kQ8_0:
            return "Q8_0";
        case DType::kQ4_0:
            return "Q4_0";
        case DType::kQ4_1:
            return "Q4_1";
    }
    return "?";
}

int64_t BlockElements(DType dtype) {
    switch (dtype) {
        case DType::kF32:
        case DType::kF16:
        case DType::kBF16:
            return 1;
        case DType::kQ8_0:
        case DType::kQ4_0:
        case DType::kQ4_1:
            return kQBlock;
    }
    return 1;
}

size_t RowBytes(DType dtype, int64_t num_cols) {
    const int64_t block = BlockElements(dtype);
    KV_CHECK(num_cols >= 0 && num_cols % block == 0)
        << DTypeName(dtype) << " row of " << num_cols << " elements";
    return static_cast<size_t>(num_cols / block) * BlockBytes(dtype);
}

float HalfToFloat(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1F;
    uint32_t mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);  // inf or NaN (payload kept)
    } else if (exp != 0) {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;  // signed zero
    } else {
        // Subnormal half: normalize into a float exponent.
        int e = -1;
        do {
            ++e;
            mant <<= 1;
        } while ((mant & 0x400) == 0);
        bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3FF) << 13);
    }
    return std::bit_cast<float>(bits);
}

uint16_t FloatToHalf(float f) {
    const uint32_t bits = std::bit_cast<uint32_t>(f);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
    const uint32_t abs = bits & 0x7FFFFFFF;
    if (abs >= 0x7F800000u) {  // inf or NaN
        return static_cast<uint16_t>(sign | 0x7C00 | (abs > 0x7F800000u ? 0x200 : 0));
    }
    if (abs >= 0x477FF000u) return sign | 0x7C00;  // rounds to >= 65520: overflow to inf
    const int32_t exp = static_cast<int32_t>(abs >> 23) - 127 + 15;
    if (exp <= 0) {
        // Result is subnormal (or zero) in half: shift the mantissa with its implicit bit.
        if (exp < -10) return sign;  // below half of the smallest subnormal
        const uint32_t mant = (abs & 0x7FFFFF) | 0x800000;
        const int shift = 14 - exp;  // 14..24
        uint32_t half = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1);
        const uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (half & 1))) ++half;
        return static_cast<uint16_t>(sign | half);
    }
    uint32_t half = (static_cast<uint32_t>(exp) << 10) | ((abs >> 13) & 0x3FF);
    const uint32_t rem = abs & 0x1FFF;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;  // may carry into the exponent
    return static_cast<uint16_t>(sign | half);
}

float BF16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBF16(float f) {
    const uint32_t bits = std::bit_cast<uint32_t>(f);
    if ((bits & 0x7FFFFFFF) > 0x7F800000u) {
        return static_cast<uint16_t>((bits >> 16) | 0x40);  // keep NaN a (quiet) NaN
    }
    const uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);
    return static_cast<uint16_t>((bits + rounding) >> 16);
}

}  // namespace kvshard
