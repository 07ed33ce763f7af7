#include "kernels/kv_quant.h"

#include <array>
#include <bit>
#include <cmath>

namespace kvshard::cpu {
namespace {

constexpr float kFp8Max = 448.0f;

std::array<float, 256> MakeFp8Table() {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) {
        const int sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 0x7;
        float mag;
        if (exp == 0xF && man == 0x7) {
            mag = std::nanf("");
        } else if (exp == 0) {
            mag = std::ldexp(static_cast<float>(man) / 8.0f, -6);  // subnormal
        } else {
            mag = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
        }
        t[static_cast<size_t>(v)] = sign ? -mag : mag;
    }
    return t;
}

const std::array<float, 256> kFp8Table = MakeFp8Table();

}  // namespace

float Fp8E4M3ToFloat(uint8_t v) { return kFp8Table[v]; }

uint8_t FloatToFp8E4M3(float x) {
    if (std::isnan(x)) return 0x7F;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    float a = std::fabs(x);
    if (a >= kFp8Max) return sign | 0x7E;  // 448
    // Smallest subnormal step is 2^-9; below half of it rounds to zero.
    int exp;
    std::frexp(a, &exp);  // a = f * 2^exp, f in [0.5, 1)
    int e = exp - 1;      // a = 1.m * 2^e
    if (e < -6) e = -6;   // subnormal range shares the 2^-6 exponent with a 0.m mantissa
    const float step = std::ldexp(1.0f, e - 3);  // spacing of representable values at this e
    float q = std::nearbyint(a / step) * step;   // round half to even (default rounding mode)
    if (q >= kFp8Max) return sign | 0x7E;
    if (q == 0.0f) return sign;
    int qexp;
    std::frexp(q, &qexp);
    int qe = qexp - 1;
    if (qe < -6) {  // subnormal: value = man/8 * 2^-6
        const int man = static_cast<int>(std::lround(q / std::ldexp(1.0f, -9)));
        return sign | static_cast<uint8_t>(man);
    }
    const int man = static_cast<int>(std::lround((q / std::ldexp(1.0f, qe) - 1.0f) * 8.0f));
    return sign | static_cast<uint8_t>(((qe + 7) << 3) | man);
}

float QuantizeInt8(const float* x, int64_t n, int8_t* out) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        out[i] = static_cast<int8_t>(std::lrint(std::fmin(std::fmax(x[i] * inv, -127.0f), 127.0f)));
    }
    return scale;
}

float QuantizeFp8(const float* x, int64_t n, uint8_t* out) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float scale = amax / kFp8Max;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToFp8E4M3(x[i] * inv);
    return scale;
}

void DequantizeInt8(const int8_t* q, float scale, int64_t n, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
}

void DequantizeFp8(const uint8_t* q, float scale, int64_t n, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = kFp8Table[q[i]] * scale;
}

}  // namespace kvshard::cpu
