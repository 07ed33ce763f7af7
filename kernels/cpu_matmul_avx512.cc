// AVX-512 kernels of MatMulStored (kernels/cpu_matmul.h). Compiled for any x86-64 target: every
// function carries the AVX-512 target attribute, and kernels/cpu_matmul.cc calls them only after
// cpuid and xgetbv said the CPU and the OS support the registers.
//
// A tile computes R activation rows × C weight rows. Each 32-weight block of the C weight rows is
// dequantized once into 2·C zmm registers and used by all R activation rows, so the dequantization
// cost is shared by R rows (batched decode) while the weights stream from memory once per strip.
// For a single row the dequantization is the bottleneck (it competes with the FMAs for the two
// 512-bit ports), so the 4-bit formats use a 16-entry lookup table per block (vpermps) instead of
// mask + int→float convert + scale per weight: ~9 instead of ~17 port-0/5 µops per block.
#if defined(__x86_64__)

// GCC 12 reports the deliberately undefined pass-through operand of many AVX-512 intrinsics
// (`__m512 __Y = __Y;` in _mm512_undefined_ps) as uninitialized once they are inlined (GCC bug
// 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/check.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_matmul_internal.h"

#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define KV_AVX512_INLINE KV_AVX512 inline __attribute__((always_inline))

namespace kvshard::cpu::matmul_internal {
namespace {

constexpr int64_t kBlock = 32;

// Bytes of 32 consecutive weights of a row (one GGUF block; 32 elements of the float types).
template <DType T>
constexpr size_t kBlockBytes = T == DType::kQ8_0   ? 34
                               : T == DType::kQ4_0 ? 18
                               : T == DType::kQ4_1 ? 20
                               : T == DType::kQ5_0 ? 22
                               : T == DType::kQ5_1 ? 24
                                                   : 64;

// The K-quants read by super-blocks of 256 weights (kSuperBlock) in eight sub-blocks of 32.
template <DType T>
constexpr bool kIsSuper = T == DType::kQ4_K || T == DType::kQ5_K || T == DType::kQ6_K;

template <DType T>
constexpr size_t kSuperBytes = T == DType::kQ4_K   ? 144
                               : T == DType::kQ5_K ? 176
                                                   : 210;

template <DType T>
constexpr bool kIsFloat = T == DType::kF16 || T == DType::kBF16;

KV_AVX512_INLINE float LoadHalf(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
}

KV_AVX512_INLINE __m512 Iota() {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

KV_AVX512_INLINE __m512 IotaMinus8() {
    return _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
}

KV_AVX512_INLINE __m512 Iota16() {
    return _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
}

// A float in memory broadcast to 16 lanes by the load unit. GCC would otherwise keep a value just
// converted in a register and broadcast it with shuffles, on the port the dequantization needs.
KV_AVX512_INLINE __m512 BroadcastFromMemory(const float* f) {
    __m512 r;
    __asm__("vbroadcastss %1, %0" : "=v"(r) : "m"(*f));
    return r;
}

// The two fp16 values at p, each broadcast: one conversion for both, broadcasts from memory.
KV_AVX512_INLINE void LoadTwoHalves(const uint8_t* p, __m512& a, __m512& b) {
    uint32_t bits;
    std::memcpy(&bits, p, sizeof(bits));
    alignas(16) float f[4];
    _mm_store_ps(f, _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits))));
    a = BroadcastFromMemory(&f[0]);
    b = BroadcastFromMemory(&f[1]);
}

KV_AVX512_INLINE __m128i LoadBytes16(const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

KV_AVX512_INLINE __m512 BF16ToPs(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Weights 0..15 of the block at `p` into w0, 16..31 into w1.
template <DType T>
KV_AVX512_INLINE void LoadBlock(const uint8_t* p, __m512& w0, __m512& w1) {
    if constexpr (T == DType::kQ8_0) {
        const __m512 d = _mm512_set1_ps(LoadHalf(p));
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LoadBytes16(p + 2))), d);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LoadBytes16(p + 18))), d);
    } else if constexpr (T == DType::kQ4_0) {
        // A 16-entry table d·(q - 8) indexed by each nibble: vpermps reads only an index's low 4
        // bits, so neither the nibble masking nor an int→float conversion per weight is needed.
        const __m512 table = _mm512_mul_ps(_mm512_set1_ps(LoadHalf(p)), IotaMinus8());
        const __m512i idx = _mm512_cvtepu8_epi32(LoadBytes16(p + 2));
        w0 = _mm512_permutexvar_ps(idx, table);
        w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
    } else if constexpr (T == DType::kQ4_1) {
        __m512 d;
        __m512 mn;
        LoadTwoHalves(p, d, mn);
        const __m512 table = _mm512_fmadd_ps(Iota(), d, mn);
        const __m512i idx = _mm512_cvtepu8_epi32(LoadBytes16(p + 4));
        w0 = _mm512_permutexvar_ps(idx, table);
        w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
    } else if constexpr (T == DType::kQ5_0 || T == DType::kQ5_1) {
        // 5-bit quants: a 32-entry table in two halves (vpermt2ps reads an index's low 5 bits),
        // the low nibble from the byte and the 5th bit, bit j of qh for weight j, or-ed in under
        // a mask. Q5_0's entries are d·(q - 16), Q5_1's d·q + m.
        constexpr int kQh = T == DType::kQ5_0 ? 2 : 4;
        __m512 lo;
        __m512 hi;
        if constexpr (T == DType::kQ5_0) {
            const __m512 d = _mm512_set1_ps(LoadHalf(p));
            lo = _mm512_mul_ps(d, _mm512_sub_ps(Iota(), _mm512_set1_ps(16.0f)));
            hi = _mm512_mul_ps(d, Iota());
        } else {
            __m512 d;
            __m512 mn;
            LoadTwoHalves(p, d, mn);
            lo = _mm512_fmadd_ps(Iota(), d, mn);
            hi = _mm512_fmadd_ps(Iota16(), d, mn);
        }
        uint32_t qh;
        std::memcpy(&qh, p + kQh, sizeof(qh));
        const __m512i idx = _mm512_cvtepu8_epi32(LoadBytes16(p + kQh + 4));
        const __m512i sixteen = _mm512_set1_epi32(16);
        const __m512i i0 = _mm512_mask_or_epi32(_mm512_and_si512(idx, _mm512_set1_epi32(15)),
                                                static_cast<__mmask16>(qh), idx, sixteen);
        const __m512i i1 = _mm512_srli_epi32(idx, 4);
        w0 = _mm512_permutex2var_ps(lo, i0, hi);
        w1 = _mm512_permutex2var_ps(
            lo, _mm512_mask_or_epi32(i1, static_cast<__mmask16>(qh >> 16), i1, sixteen), hi);
    } else if constexpr (T == DType::kF16) {
        w0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        w1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    } else {
        static_assert(T == DType::kBF16);
        w0 = BF16ToPs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        w1 = BF16ToPs(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    }
}

// The last `rem` (< 32) elements of a float-type row: masked loads, zeros beyond the row.
template <DType T>
KV_AVX512_INLINE void LoadTail(const uint8_t* p, __mmask16 m0, __mmask16 m1, __m512& w0,
                               __m512& w1) {
    const __m256i h0 = _mm256_maskz_loadu_epi16(m0, p);
    const __m256i h1 = _mm256_maskz_loadu_epi16(m1, p + 32);
    if constexpr (T == DType::kF16) {
        w0 = _mm512_cvtph_ps(h0);
        w1 = _mm512_cvtph_ps(h1);
    } else {
        w0 = BF16ToPs(h0);
        w1 = BF16ToPs(h1);
    }
}

KV_AVX512_INLINE void TailMasks(int64_t rem, __mmask16& m0, __mmask16& m1) {
    m0 = static_cast<__mmask16>(rem >= 16 ? 0xFFFF : (1u << rem) - 1);
    m1 = static_cast<__mmask16>(rem > 16 ? (1u << (rem - 16)) - 1 : 0);
}

// ---------------------------------------------------------------------------------------------
// K-quants (Q4_K, Q5_K, Q6_K). Per super-block and weight row the sub-block scales are unpacked
// once into a row of 32 floats (SuperScales); each sub-block of 32 weights then dequantizes like a
// 32-weight block of the simple formats (SubBlock), its scale and offset broadcast from that row:
//  - Q4_K/Q5_K: [0, 8) d·scale_s, [8, 16) -dmin·min_s; a sub-block is a 16-entry (Q5_K: 32-entry)
//    table d_s·q - m_s indexed by the nibbles (Q5_K: with the 5th bit of qh or-ed in).
//  - Q6_K: [0, 16) d·scale_i (one per 16 weights), [16, 32) -32·d·scale_i; the 6-bit quant is
//    assembled from its nibble and 2 high bits as a byte and converted, w = q·ds - 32·ds (exactly
//    ds·(q - 32) rounded once, as common/dtype.cc computes it).
struct alignas(64) SuperScales {
    float f[32];
};

template <DType T>
KV_AVX512_INLINE void UnpackSuperScales(const uint8_t* sb, SuperScales& out) {
    if constexpr (T == DType::kQ6_K) {
        const __m512 d = _mm512_set1_ps(LoadHalf(sb + 208));
        const __m512 ds =
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LoadBytes16(sb + 192))), d);
        _mm512_store_ps(out.f, ds);
        _mm512_store_ps(out.f + 16, _mm512_mul_ps(ds, _mm512_set1_ps(-32.0f)));
    } else {
        alignas(16) uint8_t bytes[16];
        UnpackScalesK4(sb + 4, bytes);
        __m512 d;
        __m512 dmin;
        LoadTwoHalves(sb, d, dmin);
        const __m512 mul = _mm512_mask_blend_ps(static_cast<__mmask16>(0xFF00), d,
                                                _mm512_sub_ps(_mm512_setzero_ps(), dmin));
        _mm512_store_ps(out.f, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(
                                                 reinterpret_cast<const __m128i*>(bytes)))),
                                             mul));
    }
}

// Weights 32·S .. 32·S+15 of the super-block at `sb` into w0, the next 16 into w1.
template <DType T, int S>
KV_AVX512_INLINE void SubBlock(const uint8_t* sb, const SuperScales& sc, __m512& w0, __m512& w1) {
    if constexpr (T == DType::kQ4_K || T == DType::kQ5_K) {
        // 32 bytes of nibbles per pair of sub-blocks: the low nibbles are sub-block 2g, the high
        // ones 2g + 1. Q5_K's 5th bits: bit S of qh[l] for weight l of sub-block S.
        constexpr int kQs = T == DType::kQ4_K ? 16 : 48;
        const uint8_t* q = sb + kQs + 32 * (S / 2);
        const __m512 ds = BroadcastFromMemory(&sc.f[S]);
        const __m512 ms = BroadcastFromMemory(&sc.f[8 + S]);
        __m512i i0 = _mm512_cvtepu8_epi32(LoadBytes16(q));
        __m512i i1 = _mm512_cvtepu8_epi32(LoadBytes16(q + 16));
        if constexpr (S % 2 == 1) {
            i0 = _mm512_srli_epi32(i0, 4);
            i1 = _mm512_srli_epi32(i1, 4);
        }
        const __m512 lo = _mm512_fmadd_ps(Iota(), ds, ms);
        if constexpr (T == DType::kQ4_K) {
            w0 = _mm512_permutexvar_ps(i0, lo);
            w1 = _mm512_permutexvar_ps(i1, lo);
        } else {
            const __m512 hi = _mm512_fmadd_ps(Iota16(), ds, ms);
            const __mmask32 bits =
                _mm256_test_epi8_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16)),
                                      _mm256_set1_epi8(static_cast<char>(1 << S)));
            const __m512i sixteen = _mm512_set1_epi32(16);
            if constexpr (S % 2 == 0) {
                const __m512i low4 = _mm512_set1_epi32(15);
                i0 = _mm512_and_si512(i0, low4);
                i1 = _mm512_and_si512(i1, low4);
            }
            i0 = _mm512_mask_or_epi32(i0, static_cast<__mmask16>(bits), i0, sixteen);
            i1 = _mm512_mask_or_epi32(i1, static_cast<__mmask16>(bits >> 16), i1, sixteen);
            w0 = _mm512_permutex2var_ps(lo, i0, hi);
            w1 = _mm512_permutex2var_ps(lo, i1, hi);
        }
    } else {
        static_assert(T == DType::kQ6_K);
        // Half h of the super-block (128 weights: 64 bytes of ql, 32 of qh) holds sub-blocks
        // 4h + t: nibble t / 2 of ql[32 · (t % 2) + l], bits 2t, 2t + 1 of qh[l].
        constexpr int kHalf = S / 4;
        constexpr int kT = S % 4;
        __m256i lo =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * kHalf + 32 * (kT % 2)));
        if constexpr (kT >= 2) lo = _mm256_srli_epi16(lo, 4);
        __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * kHalf));
        if constexpr (kT < 2) {
            hi = _mm256_slli_epi16(hi, 4 - 2 * kT);
        } else if constexpr (kT == 3) {
            hi = _mm256_srli_epi16(hi, 2);
        }
        const __m256i q = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0F)),
                                          _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
        constexpr int kScale = 8 * kHalf + 2 * kT;
        w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q))),
                             BroadcastFromMemory(&sc.f[kScale]),
                             BroadcastFromMemory(&sc.f[16 + kScale]));
        w1 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1))),
            BroadcastFromMemory(&sc.f[kScale + 1]), BroadcastFromMemory(&sc.f[16 + kScale + 1]));
    }
}

// One sub-block S of a super-block tile: C weight rows' 32 weights against R activation rows.
template <DType T, int R, int C, int S, bool kSplit>
KV_AVX512_INLINE void SuperStep(const float* xs, int64_t k, const uint8_t* wsb, size_t row_bytes,
                                const SuperScales (&sc)[C], __m512 (&acc)[R][C],
                                __m512 (&acc1)[R][C]) {
    __m512 w0[C];
    __m512 w1[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) SubBlock<T, S>(wsb + c * row_bytes, sc[c], w0[c], w1[c]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_loadu_ps(xs + r * k + 32 * S);
        const __m512 x1 = _mm512_loadu_ps(xs + r * k + 32 * S + 16);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm512_fmadd_ps(x0, w0[c], acc[r][c]);
            if constexpr (kSplit) {
                acc1[r][c] = _mm512_fmadd_ps(x1, w1[c], acc1[r][c]);
            } else {
                acc[r][c] = _mm512_fmadd_ps(x1, w1[c], acc[r][c]);
            }
        }
    }
}

// Tile's (below) accumulation for the K-quants, super-block by super-block.
template <DType T, int R, int C, bool kSplit>
KV_AVX512_INLINE void AccumulateSuperBlocks(const float* x, int64_t k, const uint8_t* w,
                                            size_t row_bytes, __m512 (&acc)[R][C],
                                            __m512 (&acc1)[R][C]) {
    const int64_t supers = k / kSuperBlock;
    for (int64_t b = 0; b < supers; ++b) {
        const uint8_t* wsb = w + b * kSuperBytes<T>;
        SuperScales sc[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) UnpackSuperScales<T>(wsb + c * row_bytes, sc[c]);
        const float* xs = x + b * kSuperBlock;
        SuperStep<T, R, C, 0, kSplit>(xs, k, wsb, row_bytes, sc, acc, acc1);
        SuperStep<T, R, C, 1, kSplit>(xs, k, wsb, row_bytes, sc, acc, acc1);
        SuperStep<T, R, C, 2, kSplit>(xs, k, wsb, row_bytes, sc, acc, acc1);
        SuperStep<T, R, C, 3, kSplit>(xs, k, wsb, row_bytes, sc, acc, acc1);
        SuperStep<T, R, C, 4, kSplit>(xs, k, wsb, row_bytes, sc, acc, acc1);
        SuperStep<T, R, C, 5, kSplit>(xs, k, wsb, row_bytes, sc, acc, acc1);
        SuperStep<T, R, C, 6, kSplit>(xs, k, wsb, row_bytes, sc, acc, acc1);
        SuperStep<T, R, C, 7, kSplit>(xs, k, wsb, row_bytes, sc, acc, acc1);
    }
}

template <DType T, int S>
KV_AVX512_INLINE void StoreSubBlock(const uint8_t* sb, const SuperScales& sc, float* out) {
    __m512 w0;
    __m512 w1;
    SubBlock<T, S>(sb, sc, w0, w1);
    _mm512_storeu_ps(out + 32 * S, w0);
    _mm512_storeu_ps(out + 32 * S + 16, w1);
}

template <DType T>
KV_AVX512 void DequantizeSuperRow(const uint8_t* row, int64_t k, float* out) {
    for (int64_t b = 0; b < k / kSuperBlock; ++b) {
        const uint8_t* sb = row + b * kSuperBytes<T>;
        SuperScales sc;
        UnpackSuperScales<T>(sb, sc);
        float* o = out + b * kSuperBlock;
        StoreSubBlock<T, 0>(sb, sc, o);
        StoreSubBlock<T, 1>(sb, sc, o);
        StoreSubBlock<T, 2>(sb, sc, o);
        StoreSubBlock<T, 3>(sb, sc, o);
        StoreSubBlock<T, 4>(sb, sc, o);
        StoreSubBlock<T, 5>(sb, sc, o);
        StoreSubBlock<T, 6>(sb, sc, o);
        StoreSubBlock<T, 7>(sb, sc, o);
    }
}

// Tile's accumulation for the 32-weight block formats (and the float types' tail).
template <DType T, int R, int C, bool kSplit>
KV_AVX512_INLINE void AccumulateBlocks(const float* x, int64_t k, const uint8_t* w,
                                       size_t row_bytes, __m512 (&acc)[R][C],
                                       __m512 (&acc1)[R][C]) {
    const int64_t blocks = k / kBlock;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* wb = w + b * kBlockBytes<T>;
        __m512 w0[C];
        __m512 w1[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) LoadBlock<T>(wb + c * row_bytes, w0[c], w1[c]);
        const float* xb = x + b * kBlock;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const __m512 x0 = _mm512_loadu_ps(xb + r * k);
            const __m512 x1 = _mm512_loadu_ps(xb + r * k + 16);
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) {
                acc[r][c] = _mm512_fmadd_ps(x0, w0[c], acc[r][c]);
                if constexpr (kSplit) {
                    acc1[r][c] = _mm512_fmadd_ps(x1, w1[c], acc1[r][c]);
                } else {
                    acc[r][c] = _mm512_fmadd_ps(x1, w1[c], acc[r][c]);
                }
            }
        }
    }
    if constexpr (kIsFloat<T>) {
        const int64_t rem = k - blocks * kBlock;
        if (rem > 0) {
            __mmask16 m0;
            __mmask16 m1;
            TailMasks(rem, m0, m1);
            const uint8_t* wb = w + blocks * kBlockBytes<T>;
            __m512 w0[C];
            __m512 w1[C];
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) LoadTail<T>(wb + c * row_bytes, m0, m1, w0[c], w1[c]);
            const float* xb = x + blocks * kBlock;
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
                const __m512 x0 = _mm512_maskz_loadu_ps(m0, xb + r * k);
                const __m512 x1 = _mm512_maskz_loadu_ps(m1, xb + r * k + 16);
#pragma GCC unroll 4
                for (int c = 0; c < C; ++c) {
                    acc[r][c] = _mm512_fmadd_ps(x0, w0[c], acc[r][c]);
                    acc1[r][c] = _mm512_fmadd_ps(x1, w1[c], acc1[r][c]);
                }
            }
        }
    }
}

// y[r * ldy + c] = x row r · weight row c, for r < R, c < C. x rows have stride k; weight row c
// starts at w + c * row_bytes. With few accumulators, the two halves of a block go to separate
// ones so that the FMA latency chain does not limit a single-row product.
template <DType T, int R, int C>
KV_AVX512 void Tile(const float* x, int64_t k, const uint8_t* w, size_t row_bytes, float* y,
                    int64_t ldy) {
    constexpr bool kSplit = R * C <= 8;
    __m512 acc[R][C];
    __m512 acc1[R][C];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm512_setzero_ps();
            acc1[r][c] = _mm512_setzero_ps();
        }
    }
    if constexpr (kIsSuper<T>) {
        AccumulateSuperBlocks<T, R, C, kSplit>(x, k, w, row_bytes, acc, acc1);
    } else {
        AccumulateBlocks<T, R, C, kSplit>(x, k, w, row_bytes, acc, acc1);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            y[r * ldy + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c], acc1[r][c]));
        }
    }
}

// `rows` (1..8) activation rows against C weight rows.
template <DType T, int C>
KV_AVX512 void TileRows(int rows, const float* x, int64_t k, const uint8_t* w, size_t row_bytes,
                        float* y, int64_t ldy) {
    switch (rows) {
#define KV_TILE_CASE(r)                            \
    case r:                                        \
        Tile<T, r, C>(x, k, w, row_bytes, y, ldy); \
        return;
        KV_TILE_CASE(1)
        KV_TILE_CASE(2)
        KV_TILE_CASE(3)
        KV_TILE_CASE(4)
        KV_TILE_CASE(5)
        KV_TILE_CASE(6)
        KV_TILE_CASE(7)
        KV_TILE_CASE(8)
#undef KV_TILE_CASE
    }
}

// Activation rows per tile, and how many weight rows share them: the register budget (32 zmm)
// holds R·C accumulators plus 2·C dequantized weight vectors. Fewer activation rows take more
// weight rows so that there is enough independent work per block.
constexpr int kMaxTileRows = 8;
constexpr int kStrip = 4;  // weight rows per strip: C = 4, 2 or 1
constexpr size_t kCacheLine = 64;
// How far ahead of the strip being computed the weights are prefetched.
constexpr size_t kPrefetchBytes = 8192;

// Fetches into L2, every cache line of it, the strip about kPrefetchBytes after the one at
// weight row j (wj), if the matrix (`rows` weight rows) has one there. A strip's rows are
// contiguous and a thread walks its strips in order (cpu_matmul.cc), usually past the end of one
// call's range into its next. The hardware prefetchers start late on these short rows and leave
// a single-row decode waiting on DRAM. Batch-1 decode of the default model (docs/benchmarks.md,
// issue 10): one line per 256 bytes of the next strip into L1, 60 tok/s; every line, 120-130;
// every line 8 KiB ahead into L2 (prefetcht1), 145-160; 4, 16 and 32 KiB ahead did no better.
KV_AVX512_INLINE void PrefetchAhead(const uint8_t* wj, int64_t j, size_t row_bytes, int64_t rows) {
    const size_t strip_bytes = kStrip * row_bytes;
    const int64_t ahead = std::max<int64_t>(1, static_cast<int64_t>(kPrefetchBytes / strip_bytes));
    if (j + (ahead + 1) * kStrip > rows) return;
    const uint8_t* next = wj + ahead * strip_bytes;
    for (size_t off = 0; off < strip_bytes; off += kCacheLine) {
        _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
    }
}

// Columns [n0, n1) of y (stride ldy, which is also the number of weight rows) from weight rows
// [n0, n1).
template <DType T>
KV_AVX512 void RowsT(const float* x, int64_t m, int64_t k, const uint8_t* w, size_t row_bytes,
                     int64_t n0, int64_t n1, float* y, int64_t ldy) {
    int64_t j = n0;
    for (; j + kStrip <= n1; j += kStrip) {
        const uint8_t* wj = w + j * row_bytes;
        PrefetchAhead(wj, j, row_bytes, ldy);
        for (int64_t i = 0; i < m; i += kMaxTileRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kMaxTileRows, m - i));
            const float* xi = x + i * k;
            float* yi = y + i * ldy + j;
            if (rows <= 4) {
                TileRows<T, 4>(rows, xi, k, wj, row_bytes, yi, ldy);
            } else {
                TileRows<T, 2>(rows, xi, k, wj, row_bytes, yi, ldy);
                TileRows<T, 2>(rows, xi, k, wj + 2 * row_bytes, row_bytes, yi + 2, ldy);
            }
        }
    }
    for (; j < n1; ++j) {
        for (int64_t i = 0; i < m; i += kMaxTileRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kMaxTileRows, m - i));
            TileRows<T, 1>(rows, x + i * k, k, w + j * row_bytes, row_bytes, y + i * ldy + j, ldy);
        }
    }
}

template <DType T>
KV_AVX512 void DequantizeBlockRows(const uint8_t* w, size_t row_bytes, int64_t k, int64_t r0,
                                   int64_t r1, float* out) {
    const int64_t blocks = k / kBlock;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = w + r * row_bytes;
        float* o = out + (r - r0) * k;
        for (int64_t b = 0; b < blocks; ++b) {
            __m512 w0;
            __m512 w1;
            LoadBlock<T>(row + b * kBlockBytes<T>, w0, w1);
            _mm512_storeu_ps(o + b * kBlock, w0);
            _mm512_storeu_ps(o + b * kBlock + 16, w1);
        }
        if constexpr (kIsFloat<T>) {
            const int64_t rem = k - blocks * kBlock;
            if (rem > 0) {
                __mmask16 m0;
                __mmask16 m1;
                TailMasks(rem, m0, m1);
                __m512 w0;
                __m512 w1;
                LoadTail<T>(row + blocks * kBlockBytes<T>, m0, m1, w0, w1);
                _mm512_mask_storeu_ps(o + blocks * kBlock, m0, w0);
                _mm512_mask_storeu_ps(o + blocks * kBlock + 16, m1, w1);
            }
        }
    }
}

template <DType T>
KV_AVX512 void DequantizeRowsT(const uint8_t* w, size_t row_bytes, int64_t k, int64_t r0,
                               int64_t r1, float* out) {
    if constexpr (kIsSuper<T>) {
        for (int64_t r = r0; r < r1; ++r) {
            DequantizeSuperRow<T>(w + r * row_bytes, k, out + (r - r0) * k);
        }
    } else {
        DequantizeBlockRows<T>(w, row_bytes, k, r0, r1, out);
    }
}

}  // namespace

KV_AVX512 void MatMulRowsAvx512(const float* x, int64_t m, const StoredMatrix& w, int64_t n0,
                                int64_t n1, float* y) {
    const size_t row_bytes = RowBytes(w.dtype, w.cols);
    switch (w.dtype) {
        case DType::kF32:
            return;  // the caller uses BLAS
        case DType::kF16:
            return RowsT<DType::kF16>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kBF16:
            return RowsT<DType::kBF16>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kQ8_0:
            return RowsT<DType::kQ8_0>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kQ4_0:
            return RowsT<DType::kQ4_0>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kQ4_1:
            return RowsT<DType::kQ4_1>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kQ5_0:
            return RowsT<DType::kQ5_0>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kQ5_1:
            return RowsT<DType::kQ5_1>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kQ4_K:
            return RowsT<DType::kQ4_K>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kQ5_K:
            return RowsT<DType::kQ5_K>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        case DType::kQ6_K:
            return RowsT<DType::kQ6_K>(x, m, w.cols, w.data, row_bytes, n0, n1, y, w.rows);
        default:
            // Q2_K, Q3_K, Q8_K: cpu_matmul.cc sends them to the portable kernel.
            KV_CHECK(false) << "no avx512 kernel for " << DTypeName(w.dtype);
    }
}

KV_AVX512 void DequantizeRowsAvx512(const StoredMatrix& w, int64_t r0, int64_t r1, float* out) {
    const size_t row_bytes = RowBytes(w.dtype, w.cols);
    switch (w.dtype) {
        case DType::kF32:
            std::memcpy(out, w.data + r0 * row_bytes, static_cast<size_t>(r1 - r0) * row_bytes);
            return;
        case DType::kF16:
            return DequantizeRowsT<DType::kF16>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kBF16:
            return DequantizeRowsT<DType::kBF16>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kQ8_0:
            return DequantizeRowsT<DType::kQ8_0>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kQ4_0:
            return DequantizeRowsT<DType::kQ4_0>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kQ4_1:
            return DequantizeRowsT<DType::kQ4_1>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kQ5_0:
            return DequantizeRowsT<DType::kQ5_0>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kQ5_1:
            return DequantizeRowsT<DType::kQ5_1>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kQ4_K:
            return DequantizeRowsT<DType::kQ4_K>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kQ5_K:
            return DequantizeRowsT<DType::kQ5_K>(w.data, row_bytes, w.cols, r0, r1, out);
        case DType::kQ6_K:
            return DequantizeRowsT<DType::kQ6_K>(w.data, row_bytes, w.cols, r0, r1, out);
        default:
            break;
    }
    // Q2_K, Q3_K, Q8_K: the scalar dequantizer of common/dtype.cc.
    for (int64_t r = r0; r < r1; ++r) {
        DequantizeRow(w.dtype, w.data + r * row_bytes, w.cols, out + (r - r0) * w.cols);
    }
}

// ---------------------------------------------------------------------------------------------
// Int8 activations (ActivationFormat::kInt8): VNNI dot products of 8-bit activation blocks with
// the weights' integer quants, one fp32 scale per block and row.
//
// The activations of a row are quantized once per product into pairs of blocks laid out to match
// one 64-byte zmm of weights, so that a pair of weight blocks costs one vpdpbusd per activation
// row and no shuffle of the weights beyond unpacking:
//  - Q4_0/Q4_1: a weight zmm is [lowA, lowB, highA, highB] (the low nibbles of block A's 16 bytes
//    are weights 0..15, the high ones 16..31), so the activation bytes are [A0-15, B0-15, A16-31,
//    B16-31]; dword lanes 0-3 and 8-11 belong to block A, 4-7 and 12-15 to B.
//  - Q8_0: [A0-31, B0-31]; lanes 0-7 are A, 8-15 B.
// vpdpbusd multiplies unsigned by signed bytes. Q4 quants are unsigned (0..15) and Q4_0's -8 is
// folded into the accumulator's start, -8 x the lane's activation sum; Q8_0 quants get 128 added
// (xor 0x80) and the accumulator starts at -128 x the lane's activation sum. Q4_1's offset term is
// m x dx x sum(q).
namespace {

#define KV_VNNI \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,fma,f16c")))
#define KV_VNNI_INLINE KV_VNNI inline __attribute__((always_inline))

struct alignas(64) Int8Pair {
    int8_t q[64];
    float dx[16];      // the activation scale of each dword lane's block
    int32_t init[16];  // the dot product's start: -offset x the lane's 4 activations
    float sx[4];       // {0, dxA·sum qA, 0, dxB·sum qB}: against Q4_1's {dA, mA, dB, mB}
    float pad[12];
};
static_assert(sizeof(Int8Pair) == 256);

int64_t PairsOf(int64_t k) { return (k / kBlock + 1) / 2; }

void QuantizePairs(DType dtype, const float* x, int64_t k, Int8Pair* out) {
    const int64_t blocks = k / kBlock;
    const bool four_bit = dtype != DType::kQ8_0;
    const int32_t offset = dtype == DType::kQ4_0 ? 8 : dtype == DType::kQ8_0 ? 128 : 0;
    for (int64_t p = 0; p < PairsOf(k); ++p) {
        Int8Pair& pair = out[p];
        std::memset(&pair, 0, sizeof(pair));
        float d[2] = {0.0f, 0.0f};
        for (int h = 0; h < 2; ++h) {
            const int64_t b = 2 * p + h;
            if (b >= blocks) break;
            int8_t q[32];
            int32_t sum_q;
            d[h] = QuantizeBlock32(x + b * kBlock, q, &sum_q);
            if (four_bit) {
                std::memcpy(pair.q + 16 * h, q, 16);
                std::memcpy(pair.q + 32 + 16 * h, q + 16, 16);
            } else {
                std::memcpy(pair.q + 32 * h, q, 32);
            }
            pair.sx[2 * h + 1] = d[h] * static_cast<float>(sum_q);
        }
        for (int lane = 0; lane < 16; ++lane) {
            const int h = four_bit ? (lane / 4) % 2 : lane / 8;
            int32_t s = 0;
            for (int i = 0; i < 4; ++i) s += pair.q[4 * lane + i];
            pair.init[lane] = -offset * s;
            pair.dx[lane] = d[h];
        }
    }
}

KV_VNNI_INLINE __m512i Permutation4Bit(int a, int b) {
    // Bytes [a..a+15, b..b+15, a..a+15, b..b+15] of the loaded pair.
    alignas(64) uint8_t idx[64];
    for (int i = 0; i < 16; ++i) {
        idx[i] = static_cast<uint8_t>(a + i);
        idx[16 + i] = static_cast<uint8_t>(b + i);
        idx[32 + i] = static_cast<uint8_t>(a + i);
        idx[48 + i] = static_cast<uint8_t>(b + i);
    }
    return _mm512_load_si512(idx);
}

template <DType T>
constexpr int kQuantOffset = T == DType::kQ4_1 ? 4 : 2;  // quants' offset inside a block

// A pair of weight blocks at `p` (`both`: block B exists) as the zmm of quants in the activation
// layout, and their scales: `dw` per dword lane, and for Q4_1 `dm` = {dA, mA, dB, mB}.
// `safe`: 64 bytes from p may be read (the pair is not the end of the matrix).
template <DType T>
KV_VNNI_INLINE void LoadPair(const uint8_t* p, bool both, bool safe, __m512i perm, __m512i& wz,
                             __m512& dw, __m128& dm) {
    constexpr size_t bb = kBlockBytes<T>;
    if constexpr (T == DType::kQ8_0) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
        const __m256i b = both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + bb + 2))
                               : _mm256_setzero_si256();
        wz = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1),
                              _mm512_set1_epi8(static_cast<char>(0x80)));
    } else {
        const __m512i raw =
            safe ? _mm512_loadu_si512(p)
                 : _mm512_maskz_loadu_epi8(
                       both ? (uint64_t{1} << (2 * bb)) - 1 : (uint64_t{1} << bb) - 1, p);
        __m512i z = _mm512_permutexvar_epi8(perm, raw);
        z = _mm512_mask_srli_epi16(z, static_cast<__mmask32>(0xFFFF0000u), z, 4);
        wz = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
    }
    __m128 scales;
    __m512i lanes;
    if constexpr (T == DType::kQ4_1) {
        uint32_t a;
        uint32_t b = 0;
        std::memcpy(&a, p, 4);
        if (both) std::memcpy(&b, p + bb, 4);
        scales = _mm_cvtph_ps(
            _mm_cvtsi64_si128(static_cast<long long>((static_cast<uint64_t>(b) << 32) | a)));
        lanes = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2);
        dm = scales;
    } else {
        uint16_t a;
        uint16_t b = 0;
        std::memcpy(&a, p, 2);
        if (both) std::memcpy(&b, p + bb, 2);
        scales = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>((uint32_t{b} << 16) | a)));
        lanes = T == DType::kQ8_0
                    ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                    : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
        dm = _mm_setzero_ps();
    }
    dw = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(scales));
}

// y[r * ldy + c] = activation row r · weight row c for r < R, c < C: R rows of `pairs` pairs each
// (row r at xq + r * pairs), C consecutive weight rows from w. `end`: the end of the matrix.
template <DType T, int R, int C>
KV_VNNI void TileInt8(const Int8Pair* xq, int64_t pairs, int64_t blocks, const uint8_t* w,
                      size_t row_bytes, const uint8_t* end, float* y, int64_t ldy) {
    constexpr size_t bb = kBlockBytes<T>;
    const __m512i perm = Permutation4Bit(kQuantOffset<T>, static_cast<int>(bb) + kQuantOffset<T>);
    __m512 acc[R][C];
    __m128 accm[R][C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm512_setzero_ps();
            accm[r][c] = _mm_setzero_ps();
        }
    }
    for (int64_t p = 0; p < pairs; ++p) {
        const bool both = 2 * p + 1 < blocks;
        const uint8_t* last = w + (C - 1) * row_bytes + 2 * p * bb;
        const bool safe = last + 64 <= end;
        __m512i wz[C];
        __m512 dw[C];
        __m128 dm[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            LoadPair<T>(w + c * row_bytes + 2 * p * bb, both, safe, perm, wz[c], dw[c], dm[c]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const Int8Pair& xp = xq[r * pairs + p];
            const __m512i xv = _mm512_load_si512(xp.q);
            const __m512 dx = _mm512_load_ps(xp.dx);
            const __m512i init =
                T == DType::kQ4_1 ? _mm512_setzero_si512() : _mm512_load_si512(xp.init);
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) {
                const __m512i dot = _mm512_dpbusd_epi32(init, wz[c], xv);
                acc[r][c] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[c], dx), acc[r][c]);
                if constexpr (T == DType::kQ4_1) {
                    accm[r][c] = _mm_fmadd_ps(dm[c], _mm_load_ps(xp.sx), accm[r][c]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            float sum = _mm512_reduce_add_ps(acc[r][c]);
            if constexpr (T == DType::kQ4_1) {
                alignas(16) float m4[4];
                _mm_store_ps(m4, accm[r][c]);
                sum += m4[1] + m4[3];
            }
            y[r * ldy + c] = sum;
        }
    }
}

constexpr int kInt8TileRows = 4;

template <DType T, int C>
KV_VNNI void TileInt8Rows(int rows, const Int8Pair* xq, int64_t pairs, int64_t blocks,
                          const uint8_t* w, size_t row_bytes, const uint8_t* end, float* y,
                          int64_t ldy) {
    switch (rows) {
        case 1:
            return TileInt8<T, 1, C>(xq, pairs, blocks, w, row_bytes, end, y, ldy);
        case 2:
            return TileInt8<T, 2, C>(xq, pairs, blocks, w, row_bytes, end, y, ldy);
        case 3:
            return TileInt8<T, 3, C>(xq, pairs, blocks, w, row_bytes, end, y, ldy);
        case 4:
            return TileInt8<T, 4, C>(xq, pairs, blocks, w, row_bytes, end, y, ldy);
    }
}

template <DType T>
KV_VNNI void RowsInt8T(const Int8Pair* xq, int64_t m, const StoredMatrix& w, int64_t n0, int64_t n1,
                       float* y) {
    const size_t row_bytes = RowBytes(w.dtype, w.cols);
    const int64_t blocks = w.cols / kBlock;
    const int64_t pairs = PairsOf(w.cols);
    const uint8_t* end = w.data + w.rows * row_bytes;
    const int64_t ldy = w.rows;
    int64_t j = n0;
    for (; j + kStrip <= n1; j += kStrip) {
        const uint8_t* wj = w.data + j * row_bytes;
        PrefetchAhead(wj, j, row_bytes, ldy);
        for (int64_t i = 0; i < m; i += kInt8TileRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kInt8TileRows, m - i));
            const Int8Pair* xi = xq + i * pairs;
            float* yi = y + i * ldy + j;
            if (rows == 1) {
                TileInt8<T, 1, 4>(xi, pairs, blocks, wj, row_bytes, end, yi, ldy);
            } else {
                TileInt8Rows<T, 2>(rows, xi, pairs, blocks, wj, row_bytes, end, yi, ldy);
                TileInt8Rows<T, 2>(rows, xi, pairs, blocks, wj + 2 * row_bytes, row_bytes, end,
                                   yi + 2, ldy);
            }
        }
    }
    for (; j < n1; ++j) {
        for (int64_t i = 0; i < m; i += kInt8TileRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kInt8TileRows, m - i));
            TileInt8Rows<T, 1>(rows, xq + i * pairs, pairs, blocks, w.data + j * row_bytes,
                               row_bytes, end, y + i * ldy + j, ldy);
        }
    }
}

}  // namespace

size_t Int8Avx512Bytes(int64_t m, int64_t k) {
    return static_cast<size_t>(m * PairsOf(k)) * sizeof(Int8Pair);
}

void QuantizeRowsAvx512(DType dtype, const float* x, int64_t m, int64_t k, uint8_t* out) {
    auto* pairs = reinterpret_cast<Int8Pair*>(out);
    for (int64_t i = 0; i < m; ++i) QuantizePairs(dtype, x + i * k, k, pairs + i * PairsOf(k));
}

KV_VNNI void MatMulRowsInt8Avx512(const uint8_t* xq, int64_t m, const StoredMatrix& w, int64_t n0,
                                  int64_t n1, float* y) {
    const auto* pairs = reinterpret_cast<const Int8Pair*>(xq);
    switch (w.dtype) {
        case DType::kQ8_0:
            return RowsInt8T<DType::kQ8_0>(pairs, m, w, n0, n1, y);
        case DType::kQ4_0:
            return RowsInt8T<DType::kQ4_0>(pairs, m, w, n0, n1, y);
        case DType::kQ4_1:
            return RowsInt8T<DType::kQ4_1>(pairs, m, w, n0, n1, y);
        default:
            KV_CHECK(false) << "no int8 avx512 kernel for " << DTypeName(w.dtype);
    }
}

}  // namespace kvshard::cpu::matmul_internal

#endif  // defined(__x86_64__)
