// Single-row products over the interleaved copies of Q4_1 and Q8_0 matrices (kernels/cpu_matmul.h,
// InterleaveRows): batch-1 decode's layout, 16 weight rows side by side, lane r of every vector
// being weight row 16g + r. Compiled for any x86-64 target: every function carries its AVX-512
// target attribute, and kernels/cpu_matmul.cc calls them only after cpuid and xgetbv said the CPU
// and the OS support the registers (and AVX512_VNNI for the int16 kernels).
//
// The copy's quants come in 32-byte units: for each of the 16 rows, two consecutive bytes of the
// row's block (bytes 2t and 2t + 1). Q4_1 byte j holds weights j (low nibble) and j + 16 (high),
// so a unit carries columns 2t, 2t + 1, 2t + 16 and 2t + 17 of the 16 rows; a Q8_0 unit carries
// columns 2t and 2t + 1.
//
// Two kernels read it:
//  - int16 activations (ActivationFormat::kInt16, AVX512_VNNI; Q4_1 only): the row is rounded
//    once per product to int16 per 32-element block (QuantizeRowInt16Avx512) and a unit
//    zero-extends to 32 words, i.e. 16 dword lanes of two columns each, which vpdpwssd multiplies
//    by the activation pair of those two columns (a dword broadcast from memory) into the row's
//    lane. A unit masked with 0x000F gives columns 2t, 2t + 1, masked with 0x00F0 columns
//    2t + 16, 2t + 17 times 16 (no shift: vpandd issues on either vector port, vpsrlw on one), so
//    64 weights cost one extension, two masks and two vpdpwssd. Per block and row the int32 sum
//    (16 x the high columns' part added in) converts to float once and takes d · s_b / 16, plus
//    m · sum_b(x). (Q8_0 the same way, one vpmovsxbw and one vpdpwssd per 32 weights, measured
//    2.2x the fp32 kernel hot but is not kept: docs/benchmarks.md.)
//  - fp32 activations (the exact path; CPUs without VNNI): a unit zero/sign-extends to 16 dword
//    lanes of one 16-bit word each, whose bytes shift down to the columns; Q4_1 looks the nibbles
//    up in the constant table 0..15 (vpermps reads an index's low 4 bits), Q8_0 converts the bytes
//    to float, and an FMA per 16 weights multiplies in the broadcast activation.
#if defined(__x86_64__)

// GCC 12 reports the deliberately undefined pass-through operand of many AVX-512 intrinsics as
// uninitialized once they are inlined (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cstdint>

#include "common/check.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_matmul_internal.h"

#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define KV_AVX512_VNNI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define KV_INLINE inline __attribute__((always_inline))

namespace kvshard::cpu::matmul_internal {
namespace {

static_assert(kInterleaveRows == 16, "one zmm lane per interleaved row");

constexpr int64_t kBlock = 32;
constexpr size_t kCacheLine = 64;

// Bytes of one block of a group (16 rows): Q4_1 16 x (2 + 2 + 16), Q8_0 16 x (2 + 32).
template <DType T>
constexpr size_t kGroupBlockBytes = T == DType::kQ4_1 ? 320 : 544;
// The fp16 scales (and Q4_1's fp16 mins) before a group block's quants.
template <DType T>
constexpr size_t kScaleBytes = T == DType::kQ4_1 ? 64 : 32;
// 32-byte quant units per group block (Q4_1: 4 columns of the 16 rows each; Q8_0: 2).
template <DType T>
constexpr int kUnits = T == DType::kQ4_1 ? 8 : 16;

KV_AVX512 KV_INLINE __m256i LoadUnit(const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

KV_AVX512 KV_INLINE __m512 LoadHalves16(const uint8_t* p) { return _mm512_cvtph_ps(LoadUnit(p)); }

// A float in memory broadcast to 16 lanes by the load unit. GCC would otherwise keep a value just
// converted in a register and broadcast it with shuffles, on the port the arithmetic needs.
KV_AVX512 KV_INLINE __m512 BroadcastFromMemory(const float* f) {
    __m512 r;
    __asm__("vbroadcastss %1, %0" : "=v"(r) : "m"(*f));
    return r;
}

// acc += the dword dot products of `w`'s word pairs with the word pair at `x` (broadcast from
// memory to the 16 lanes as vpdpwssd's {1to16} operand).
KV_AVX512_VNNI KV_INLINE __m512i DotPairs(__m512i acc, __m512i w, const int32_t* x) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

// The next group's lines of block `p` (group_bytes ahead) into L2: the stream a thread walks.
template <DType T>
KV_AVX512 KV_INLINE void PrefetchNextGroup(const uint8_t* p, size_t group_bytes) {
    for (size_t off = 0; off < kGroupBlockBytes<T>; off += kCacheLine) {
        _mm_prefetch(reinterpret_cast<const char*>(p + group_bytes + off), _MM_HINT_T1);
    }
}

template <DType T>
KV_AVX512 void GroupsFp32T(const float* x, const float* block_sums, const StoredMatrix& w,
                           int64_t g0, int64_t g1, float* y) {
    const int64_t blocks = w.cols / kBlock;
    const size_t group_bytes = static_cast<size_t>(blocks) * kGroupBlockBytes<T>;
    const int64_t groups = w.rows / kInterleaveRows;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* group = w.interleaved + static_cast<size_t>(g) * group_bytes;
        const bool prefetch = g + 1 < groups;
        __m512 acc = _mm512_setzero_ps();
        __m512 acc_min = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* p = group + b * kGroupBlockBytes<T>;
            if (prefetch) PrefetchNextGroup<T>(p, group_bytes);
            const __m512 d = LoadHalves16(p);
            const uint8_t* q = p + kScaleBytes<T>;
            const float* xb = x + b * kBlock;
            __m512 s0 = _mm512_setzero_ps();
            __m512 s1 = _mm512_setzero_ps();
            __m512 s2 = _mm512_setzero_ps();
            __m512 s3 = _mm512_setzero_ps();
            if constexpr (T == DType::kQ4_1) {
#pragma GCC unroll 8
                for (int t = 0; t < 8; ++t) {
                    // Lane r: bytes 2t (bits 0-7) and 2t + 1 (bits 8-15) of row r.
                    const __m512i u = _mm512_cvtepu16_epi32(LoadUnit(q + 32 * t));
                    s0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(u, iota),
                                         _mm512_set1_ps(xb[2 * t]), s0);
                    s1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(u, 8), iota),
                                         _mm512_set1_ps(xb[2 * t + 1]), s1);
                    s2 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(u, 4), iota),
                                         _mm512_set1_ps(xb[2 * t + 16]), s2);
                    s3 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(u, 12), iota),
                                         _mm512_set1_ps(xb[2 * t + 17]), s3);
                }
                acc_min = _mm512_fmadd_ps(LoadHalves16(p + 32), _mm512_set1_ps(block_sums[b]),
                                          acc_min);
            } else {
                static_assert(T == DType::kQ8_0);
#pragma GCC unroll 8
                for (int t = 0; t < 16; t += 2) {
                    // Lane r: row r's byte 2t in bits 0-7, its byte 2t + 1 sign-extended from
                    // bit 8 up. Byte 2t shifted to the top is 2^24 times its value (s0 and s2
                    // are scaled back, exactly, once per block): one shift instead of two.
                    const __m512i u0 = _mm512_cvtepi16_epi32(LoadUnit(q + 32 * t));
                    const __m512i u1 = _mm512_cvtepi16_epi32(LoadUnit(q + 32 * (t + 1)));
                    s0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_slli_epi32(u0, 24)),
                                         _mm512_set1_ps(xb[2 * t]), s0);
                    s1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(u0, 8)),
                                         _mm512_set1_ps(xb[2 * t + 1]), s1);
                    s2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_slli_epi32(u1, 24)),
                                         _mm512_set1_ps(xb[2 * t + 2]), s2);
                    s3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(u1, 8)),
                                         _mm512_set1_ps(xb[2 * t + 3]), s3);
                }
                s0 = _mm512_mul_ps(s0, _mm512_set1_ps(1.0f / 16777216.0f));
                s2 = _mm512_mul_ps(s2, _mm512_set1_ps(1.0f / 16777216.0f));
            }
            acc = _mm512_fmadd_ps(d, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)),
                                  acc);
        }
        _mm512_storeu_ps(y + g * kInterleaveRows, _mm512_add_ps(acc, acc_min));
    }
}

template <DType T>
KV_AVX512_VNNI void GroupsInt16T(const ActivationsInt16& x, const StoredMatrix& w, int64_t g0,
                                 int64_t g1, float* y) {
    const int64_t blocks = w.cols / kBlock;
    const size_t group_bytes = static_cast<size_t>(blocks) * kGroupBlockBytes<T>;
    const int64_t groups = w.rows / kInterleaveRows;
    // The activation pairs as dwords: pair t of block b is columns 2t, 2t + 1.
    const int32_t* pairs = reinterpret_cast<const int32_t*>(x.values);
    const __m512i low = _mm512_set1_epi16(0x000F);
    const __m512i high = _mm512_set1_epi16(0x00F0);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* group = w.interleaved + static_cast<size_t>(g) * group_bytes;
        const bool prefetch = g + 1 < groups;
        __m512 acc = _mm512_setzero_ps();
        __m512 acc_min = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* p = group + b * kGroupBlockBytes<T>;
            if (prefetch) PrefetchNextGroup<T>(p, group_bytes);
            const uint8_t* q = p + kScaleBytes<T>;
            const int32_t* xb = pairs + b * (kBlock / 2);
            // Four independent chains (vpdpwssd's latency is ~5 cycles).
            __m512i a0 = _mm512_setzero_si512();
            __m512i a1 = _mm512_setzero_si512();
            __m512i a2 = _mm512_setzero_si512();
            __m512i a3 = _mm512_setzero_si512();
            __m512i sum;
            {
                static_assert(T == DType::kQ4_1);
                // a0, a1: columns 0-15; a2, a3: 16 x columns 16-31. |sum| <= 16 x 32 x 15 x 32767
                // < 2^31.
#pragma GCC unroll 8
                for (int t = 0; t < 8; t += 2) {
                    const __m512i u0 = _mm512_cvtepu8_epi16(LoadUnit(q + 32 * t));
                    const __m512i u1 = _mm512_cvtepu8_epi16(LoadUnit(q + 32 * (t + 1)));
                    a0 = DotPairs(a0, _mm512_and_si512(u0, low), xb + t);
                    a2 = DotPairs(a2, _mm512_and_si512(u0, high), xb + t + 8);
                    a1 = DotPairs(a1, _mm512_and_si512(u1, low), xb + t + 1);
                    a3 = DotPairs(a3, _mm512_and_si512(u1, high), xb + t + 9);
                }
                sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(a0, a1), 4),
                                       _mm512_add_epi32(a2, a3));
                acc_min = _mm512_fmadd_ps(LoadHalves16(p + 32), BroadcastFromMemory(x.sums + b),
                                          acc_min);
            }
            const __m512 ds = _mm512_mul_ps(LoadHalves16(p), BroadcastFromMemory(x.scales + b));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, acc);
        }
        _mm512_storeu_ps(y + g * kInterleaveRows, _mm512_add_ps(acc, acc_min));
    }
}

}  // namespace

KV_AVX512 void MatMulInterleavedAvx512(const float* x, const float* block_sums,
                                       const StoredMatrix& w, int64_t g0, int64_t g1, float* y) {
    KV_CHECK(w.interleaved != nullptr);
    switch (w.dtype) {
        case DType::kQ4_1:
            return GroupsFp32T<DType::kQ4_1>(x, block_sums, w, g0, g1, y);
        case DType::kQ8_0:
            return GroupsFp32T<DType::kQ8_0>(x, block_sums, w, g0, g1, y);
        default:
            KV_CHECK(false) << "no interleaved kernel for " << DTypeName(w.dtype);
    }
}

namespace {

// Block b of 32 floats rounded to int16 (ActivationFormat::kInt16): q = round(x / s) with
// s = max|x| / 32767, into *q0 and *q1 (16 dwords each); returns s. Every rounding of an
// activation row goes through here, so a row's int16 values and scale are the same whichever
// product (single row, batch, prefill) rounds it.
KV_AVX512 KV_INLINE float RoundBlockInt16(const float* x, __m512i* q0, __m512i* q1) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512 v0 = _mm512_loadu_ps(x);
    const __m512 v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    // Round to nearest (even); |v · inv| <= 32767 up to rounding, and the callers saturate.
    *q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
    *q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    return amax / 32767.0f;
}

// q clamped to int16's range, as vpmovsdw saturates.
KV_AVX512 KV_INLINE __m512i SaturateInt16(__m512i q) {
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)),
                            _mm512_set1_epi32(-32768));
}

}  // namespace

KV_AVX512 void QuantizeRowInt16Avx512(const float* x, int64_t k, int16_t* values, float* scales,
                                      float* sums) {
    KV_CHECK(k % kBlock == 0) << "k=" << k;
    // The kernel sums 16 x the high nibbles' products; the scale carries the 1/16.
    const float unit = 1.0f / 16.0f;
    for (int64_t b = 0; b < k / kBlock; ++b) {
        __m512i q0;
        __m512i q1;
        const float s = RoundBlockInt16(x + b * kBlock, &q0, &q1);
        q0 = SaturateInt16(q0);
        q1 = SaturateInt16(q1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + b * kBlock),
                            _mm512_cvtepi32_epi16(q0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + b * kBlock + 16),
                            _mm512_cvtepi32_epi16(q1));
        scales[b] = s * unit;
        // The min term takes the rounded row's block sum (exact in int32, one fp32 rounding), so
        // the product is that of the rounded row, as RoundRowsInt16Avx512's rows give the fp32
        // kernels.
        sums[b] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
}

KV_AVX512 void RoundRowsInt16Avx512(const float* x, int64_t count, float* out) {
    KV_CHECK(count % kBlock == 0) << "count=" << count;
    for (int64_t b = 0; b < count / kBlock; ++b) {
        __m512i q0;
        __m512i q1;
        const __m512 s = _mm512_set1_ps(RoundBlockInt16(x + b * kBlock, &q0, &q1));
        _mm512_storeu_ps(out + b * kBlock, _mm512_mul_ps(_mm512_cvtepi32_ps(SaturateInt16(q0)), s));
        _mm512_storeu_ps(out + b * kBlock + 16,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(SaturateInt16(q1)), s));
    }
}

KV_AVX512_VNNI void MatMulInterleavedInt16Avx512(const ActivationsInt16& x, const StoredMatrix& w,
                                                 int64_t g0, int64_t g1, float* y) {
    KV_CHECK(w.interleaved != nullptr);
    switch (w.dtype) {
        case DType::kQ4_1:
            return GroupsInt16T<DType::kQ4_1>(x, w, g0, g1, y);
        default:
            KV_CHECK(false) << "no int16 interleaved kernel for " << DTypeName(w.dtype);
    }
}

}  // namespace kvshard::cpu::matmul_internal

#endif  // defined(__x86_64__)
