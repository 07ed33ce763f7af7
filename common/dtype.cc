#include "common/dtype.h"

#include <bit>
#include <cstring>

#include "common/check.h"

namespace kvshard {
namespace {

constexpr int64_t kQBlock = 32;
constexpr int64_t kSuperBlock = 256;

// Model files are little-endian and the pointers may be unaligned (safetensors does not align).
uint16_t LoadU16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

uint32_t LoadU32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

// Scale and min j (0..7) of a Q4_K/Q5_K super-block: 12 bytes hold eight 6-bit scales and eight
// 6-bit mins. Bytes 0..3: scales 0..3 (low 6 bits), bytes 4..7: mins 0..3; bytes 8..11 hold the
// low nibbles of scales 4..7 (low) and mins 4..7 (high), whose top 2 bits are the top bits of
// bytes 0..3 (scales) and 4..7 (mins).
void ScaleMinK4(const uint8_t* q, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Scale i (0..15) of a Q3_K super-block, as stored (0..63; the weight uses sc - 32): low 4 bits
// are the low nibbles of bytes 0..7 then their high nibbles; the top 2 bits come from bytes
// 8..11, two bits per scale, (i / 4)-th pair of byte 8 + i % 4.
int ScaleQ3K(const uint8_t* s, int i) {
    const int low = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4);
    const int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return low | (high << 4);
}

void DequantizeQ5(const uint8_t* src, int64_t blocks, bool has_min, float* out) {
    const size_t bytes = has_min ? 24 : 22;
    for (int64_t b = 0; b < blocks; ++b, src += bytes, out += kQBlock) {
        const float d = HalfToFloat(LoadU16(src));
        const float m = has_min ? HalfToFloat(LoadU16(src + 2)) : 0.0f;
        const uint8_t* p = src + (has_min ? 4 : 2);
        const uint32_t qh = LoadU32(p);
        const uint8_t* q = p + 4;
        const int offset = has_min ? 0 : 16;
        for (int j = 0; j < 16; ++j) {
            const int lo = (q[j] & 0x0F) | (((qh >> j) & 1) << 4);
            const int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            out[j] = d * static_cast<float>(lo - offset) + m;
            out[j + 16] = d * static_cast<float>(hi - offset) + m;
        }
    }
}

void DequantizeQ2K(const uint8_t* src, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b, src += 84) {
        const uint8_t* scales = src;
        const uint8_t* q = src + 16;
        const float d = HalfToFloat(LoadU16(src + 80));
        const float dmin = HalfToFloat(LoadU16(src + 82));
        int is = 0;
        // Two halves of 128 weights, each 32 bytes of q holding 4 groups of 32 (2 bits each,
        // lowest bits first), each group two sub-blocks of 16 with their own scale and min.
        for (int half = 0; half < 2; ++half, q += 32) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int s = 0; s < 2; ++s, ++is) {
                    const float dl = d * static_cast<float>(scales[is] & 0x0F);
                    const float ml = dmin * static_cast<float>(scales[is] >> 4);
                    for (int l = 0; l < 16; ++l) {
                        *out++ = dl * static_cast<float>((q[l + 16 * s] >> shift) & 3) - ml;
                    }
                }
            }
        }
    }
}

void DequantizeQ3K(const uint8_t* src, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b, src += 110) {
        const uint8_t* hmask = src;
        const uint8_t* q = src + 32;
        const uint8_t* scales = src + 96;
        const float d = HalfToFloat(LoadU16(src + 108));
        int is = 0;
        int bit = 0;  // the hmask bit of the current group of 32
        for (int half = 0; half < 2; ++half, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, ++bit) {
                for (int s = 0; s < 2; ++s, ++is) {
                    const float dl = d * static_cast<float>(ScaleQ3K(scales, is) - 32);
                    for (int l = 0; l < 16; ++l) {
                        const int i = l + 16 * s;
                        const int low = (q[i] >> shift) & 3;
                        const int sub = (hmask[i] >> bit) & 1 ? 0 : 4;
                        *out++ = dl * static_cast<float>(low - sub);
                    }
                }
            }
        }
    }
}

void DequantizeQ45K(const uint8_t* src, int64_t blocks, bool five, float* out) {
    const size_t bytes = five ? 176 : 144;
    for (int64_t b = 0; b < blocks; ++b, src += bytes) {
        const float d = HalfToFloat(LoadU16(src));
        const float dmin = HalfToFloat(LoadU16(src + 2));
        const uint8_t* scales = src + 4;
        const uint8_t* qh = src + 16;  // Q5_K only
        const uint8_t* q = src + (five ? 48 : 16);
        // Four groups of 64 weights: 32 bytes, low nibbles then high nibbles, each 32 weights
        // one sub-block (scale/min pair); Q5_K's 5th bits are bit 2g (low) and 2g+1 (high).
        for (int g = 0; g < 4; ++g, q += 32) {
            int sc;
            int m;
            ScaleMinK4(scales, 2 * g, &sc, &m);
            const float d1 = d * static_cast<float>(sc);
            const float m1 = dmin * static_cast<float>(m);
            ScaleMinK4(scales, 2 * g + 1, &sc, &m);
            const float d2 = d * static_cast<float>(sc);
            const float m2 = dmin * static_cast<float>(m);
            for (int l = 0; l < 32; ++l) {
                const int h = five ? ((qh[l] >> (2 * g)) & 1) << 4 : 0;
                *out++ = d1 * static_cast<float>((q[l] & 0x0F) | h) - m1;
            }
            for (int l = 0; l < 32; ++l) {
                const int h = five ? ((qh[l] >> (2 * g + 1)) & 1) << 4 : 0;
                *out++ = d2 * static_cast<float>((q[l] >> 4) | h) - m2;
            }
        }
    }
}

void DequantizeQ6K(const uint8_t* src, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b, src += 210) {
        const uint8_t* ql = src;
        const uint8_t* qh = src + 128;
        const auto* sc = reinterpret_cast<const int8_t*>(src + 192);
        const float d = HalfToFloat(LoadU16(src + 208));
        // Two halves of 128 weights: 64 bytes of ql, 32 of qh, 8 scales. Weight l + 32 * k of
        // the half (k = 0..3) has low nibble k / 2 (low, high) of ql[l + 32 * (k % 2)] and high
        // bits 2k..2k+1 of qh[l]; scale sc[k * 2 + l / 16].
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, out += 128) {
            for (int l = 0; l < 32; ++l) {
                for (int k = 0; k < 4; ++k) {
                    const uint8_t lo = ql[l + 32 * (k % 2)];
                    const int low = k < 2 ? (lo & 0x0F) : (lo >> 4);
                    const int q = (low | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
                    out[l + 32 * k] =
                        d * static_cast<float>(sc[2 * k + l / 16]) * static_cast<float>(q);
                }
            }
        }
    }
}

void DequantizeQ8K(const uint8_t* src, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b, src += 292, out += kSuperBlock) {
        float d;
        std::memcpy(&d, src, sizeof(d));
        const auto* q = reinterpret_cast<const int8_t*>(src + 4);
        for (int j = 0; j < kSuperBlock; ++j) out[j] = d * static_cast<float>(q[j]);
    }
}

}  // namespace

bool IsKQuant(DType dtype) {
    switch (dtype) {
        case DType::kQ2_K:
        case DType::kQ3_K:
        case DType::kQ4_K:
        case DType::kQ5_K:
        case DType::kQ6_K:
        case DType::kQ8_K:
            return true;
        default:
            return false;
    }
}

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
        case DType::kQ5_0:
            return 2 + 4 + 16;
        case DType::kQ5_1:
            return 2 + 2 + 4 + 16;
        case DType::kQ2_K:
            return 16 + 64 + 2 + 2;
        case DType::kQ3_K:
            return 32 + 64 + 12 + 2;
        case DType::kQ4_K:
            return 2 + 2 + 12 + 128;
        case DType::kQ5_K:
            return 2 + 2 + 12 + 32 + 128;
        case DType::kQ6_K:
            return 128 + 64 + 16 + 2;
        case DType::kQ8_K:
            return 4 + 256 + 2 * 16;
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
        case DType::kQ5_0:
            return DequantizeQ5(src, num_cols / kQBlock, /*has_min=*/false, out);
        case DType::kQ5_1:
            return DequantizeQ5(src, num_cols / kQBlock, /*has_min=*/true, out);
        case DType::kQ2_K:
            return DequantizeQ2K(src, num_cols / kSuperBlock, out);
        case DType::kQ3_K:
            return DequantizeQ3K(src, num_cols / kSuperBlock, out);
        case DType::kQ4_K:
            return DequantizeQ45K(src, num_cols / kSuperBlock, /*five=*/false, out);
        case DType::kQ5_K:
            return DequantizeQ45K(src, num_cols / kSuperBlock, /*five=*/true, out);
        case DType::kQ6_K:
            return DequantizeQ6K(src, num_cols / kSuperBlock, out);
        case DType::kQ8_K:
            return DequantizeQ8K(src, num_cols / kSuperBlock, out);
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
        case DType::kQ5_0:
            return "Q5_0";
        case DType::kQ5_1:
            return "Q5_1";
        case DType::kQ2_K:
            return "Q2_K";
        case DType::kQ3_K:
            return "Q3_K";
        case DType::kQ4_K:
            return "Q4_K";
        case DType::kQ5_K:
            return "Q5_K";
        case DType::kQ6_K:
            return "Q6_K";
        case DType::kQ8_K:
            return "Q8_K";
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
        case DType::kQ5_0:
        case DType::kQ5_1:
            return kQBlock;
        case DType::kQ2_K:
        case DType::kQ3_K:
        case DType::kQ4_K:
        case DType::kQ5_K:
        case DType::kQ6_K:
        case DType::kQ8_K:
            return kSuperBlock;
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
