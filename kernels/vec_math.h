// Small inline vector helpers shared by the CPU kernels (internal to kernels/).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace kvshard::cpu {

// exp(x) within 1 ulp (measured over [-87, 88]; Cephes' expf polynomial) for x in [-87.3, 88];
// saturates outside that range instead of returning 0 or inf. Branch-free, so loops calling it
// vectorize, which glibc's expf does not without -ffast-math (SiluMul and attention's softmax were
// 5 ns per element).
inline float ExpFast(float x) {
    x = std::min(std::max(x, -87.3f), 88.0f);
    // n = round(x / ln 2) by the 1.5·2^23 trick (round-to-nearest, no reassociation here).
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    // r = x - n ln 2, with ln 2 split in two for precision; |r| <= ln 2 / 2.
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    // 2^n by building the exponent field; n is in [-126, 127] after the clamp.
    return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

inline float Dot(const float* a, const float* b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

// y += alpha * x over n floats.
inline void Axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace kvshard::cpu
