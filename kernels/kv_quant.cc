#include "kernels/kv_quant.h"

#if defined(__x86_64__)
// GCC 12 reports the deliberately undefined pass-through operand of AVX-512 intrinsics as
// uninitialized once inlined (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#include <array>
#include <bit>
#include <cmath>
#include <cstring>

#include "common/dtype.h"
#include "kernels/cpu_matmul.h"

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

// ---- 16-bit encodings, portable: branch-free, so the loops below vectorize ----

// FloatToBF16's value: round to nearest even; a NaN keeps its upper bits and is made quiet.
inline uint16_t Bf16Of(float x) {
    const uint32_t b = std::bit_cast<uint32_t>(x);
    const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    const uint32_t nan = (b >> 16) | 0x40u;
    return static_cast<uint16_t>((b & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// HalfToFloat's value: normals re-biased (15 -> 127), subnormals mant · 2^-24 (exact in fp32),
// infinities and NaNs with their payload.
inline float HalfValue(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    const uint32_t mant = h & 0x3FFu;
    const float normal = std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
    const float special = std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
    const float subnormal =
        std::bit_cast<float>(std::bit_cast<uint32_t>(static_cast<float>(mant) * 0x1p-24f) | sign);
    return exp == 0x1Fu ? special : exp == 0u ? subnormal : normal;
}

// ---- 16-bit encodings, AVX-512: 16 elements a step, the tail under a mask ----
#if defined(__x86_64__)
#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#define KV_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline __mmask16 TailMask(int64_t left) { return static_cast<__mmask16>((1u << left) - 1u); }

KV_AVX512 void DecodeBf16Avx512(const uint16_t* q, int64_t n, float* out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
        _mm512_storeu_ps(out + i,
                         _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    if (i < n) {
        const __mmask16 m = TailMask(n - i);
        const __m256i h = _mm256_maskz_loadu_epi16(m, q + i);
        _mm512_mask_storeu_ps(out + i, m,
                              _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
}

KV_AVX512_BF16 void EncodeBf16Avx512(const float* x, int64_t n, uint16_t* out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        std::memcpy(out + i, &b, sizeof b);
    }
    if (i < n) {
        const __mmask16 m = TailMask(n - i);
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i));
        __m256i v;
        std::memcpy(&v, &b, sizeof v);
        _mm256_mask_storeu_epi16(out + i, m, v);
    }
}

KV_AVX512 void DecodeFp16Avx512(const uint16_t* q, int64_t n, float* out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(
            out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i))));
    }
    if (i < n) {
        const __mmask16 m = TailMask(n - i);
        _mm512_mask_storeu_ps(out + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, q + i)));
    }
}

KV_AVX512 void EncodeFp16Avx512(const float* x, int64_t n, uint16_t* out) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + i), kRound));
    }
    if (i < n) {
        const __mmask16 m = TailMask(n - i);
        _mm256_mask_storeu_epi16(out + i, m,
                                 _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), kRound));
    }
}

bool Avx512() { return ActiveKernelIsa() == KernelIsa::kAvx512; }

bool Avx512Bf16() {
    static const bool has = __builtin_cpu_supports("avx512bf16");
    return has && Avx512();
}
#endif  // defined(__x86_64__)

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

void EncodeBf16(const float* x, int64_t n, uint16_t* out) {
#if defined(__x86_64__)
    if (Avx512Bf16()) return EncodeBf16Avx512(x, n, out);
#endif
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = Bf16Of(x[i]);
}

void DecodeBf16(const uint16_t* q, int64_t n, float* out) {
#if defined(__x86_64__)
    if (Avx512()) return DecodeBf16Avx512(q, n, out);
#endif
#pragma omp simd
    for (int64_t i = 0; i < n; ++i)
        out[i] = std::bit_cast<float>(static_cast<uint32_t>(q[i]) << 16);
}

void EncodeFp16(const float* x, int64_t n, uint16_t* out) {
#if defined(__x86_64__)
    if (Avx512()) return EncodeFp16Avx512(x, n, out);
#endif
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalf(x[i]);
}

void DecodeFp16(const uint16_t* q, int64_t n, float* out) {
#if defined(__x86_64__)
    if (Avx512()) return DecodeFp16Avx512(q, n, out);
#endif
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = HalfValue(q[i]);
}

}  // namespace kvshard::cpu
