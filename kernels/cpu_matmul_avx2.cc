// AVX2+FMA kernels of MatMulStored (kernels/cpu_matmul.h), for CPUs without AVX-512. Same scheme
// as kernels/cpu_matmul_avx512.cc with 8-lane registers: every function carries the AVX2 target
// attribute, and kernels/cpu_matmul.cc calls them only when cpuid and xgetbv allow.
//
// With 16 ymm registers a tile is at most 4 activation rows × 2 weight rows (or 1 × 4), and a
// block is processed in two halves of 16 weights to keep the dequantized weights in registers.
#if defined(__x86_64__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/check.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_matmul_internal.h"

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KV_AVX2_INLINE KV_AVX2 inline __attribute__((always_inline))

namespace kvshard::cpu::matmul_internal {
namespace {

constexpr int64_t kBlock = 32;

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

KV_AVX2_INLINE float LoadHalf(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);
}

KV_AVX2_INLINE __m128i LoadBytes16(const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

KV_AVX2_INLINE __m256 BF16ToPs(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

KV_AVX2_INLINE float HorizontalSum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Weights 16·H .. 16·H+15 of the block at `p`: the first 8 into w0, the next 8 into w1.
template <DType T, int H>
KV_AVX2_INLINE void LoadHalfBlock(const uint8_t* p, __m256& w0, __m256& w1) {
    if constexpr (T == DType::kQ8_0) {
        const __m256 d = _mm256_set1_ps(LoadHalf(p));
        const __m128i q = LoadBytes16(p + 2 + 16 * H);
        w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
        w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), d);
    } else if constexpr (T == DType::kQ4_0) {
        const __m256 d = _mm256_set1_ps(LoadHalf(p));
        __m128i q = LoadBytes16(p + 2);
        if constexpr (H == 1) q = _mm_srli_epi16(q, 4);
        q = _mm_sub_epi8(_mm_and_si128(q, _mm_set1_epi8(0x0F)), _mm_set1_epi8(8));
        w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
        w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), d);
    } else if constexpr (T == DType::kQ4_1) {
        const __m256 d = _mm256_set1_ps(LoadHalf(p));
        const __m256 mn = _mm256_set1_ps(LoadHalf(p + 2));
        __m128i q = LoadBytes16(p + 4);
        if constexpr (H == 1) q = _mm_srli_epi16(q, 4);
        q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
        w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, mn);
        w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), d, mn);
    } else if constexpr (T == DType::kQ5_0 || T == DType::kQ5_1) {
        // The 5th bits of weights 16·H .. 16·H+15 (bits 16·H.. of qh) spread to one byte each:
        // each byte of the pair replicated 8 times, tested against its bit, 0x10 where set.
        constexpr int kQh = T == DType::kQ5_0 ? 2 : 4;
        uint32_t qh;
        std::memcpy(&qh, p + kQh, sizeof(qh));
        const __m128i rep =
            _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(qh)),
                             _mm_setr_epi8(2 * H, 2 * H, 2 * H, 2 * H, 2 * H, 2 * H, 2 * H, 2 * H,
                                           2 * H + 1, 2 * H + 1, 2 * H + 1, 2 * H + 1, 2 * H + 1,
                                           2 * H + 1, 2 * H + 1, 2 * H + 1));
        const __m128i bit = _mm_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
        const __m128i fifth =
            _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(rep, bit), bit), _mm_set1_epi8(0x10));
        __m128i q = LoadBytes16(p + kQh + 4);
        if constexpr (H == 1) q = _mm_srli_epi16(q, 4);
        q = _mm_or_si128(_mm_and_si128(q, _mm_set1_epi8(0x0F)), fifth);
        const __m256 d = _mm256_set1_ps(LoadHalf(p));
        if constexpr (T == DType::kQ5_0) {
            q = _mm_sub_epi8(q, _mm_set1_epi8(16));
            w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
            w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), d);
        } else {
            const __m256 mn = _mm256_set1_ps(LoadHalf(p + 2));
            w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, mn);
            w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), d,
                                 mn);
        }
    } else if constexpr (T == DType::kF16) {
        w0 = _mm256_cvtph_ps(LoadBytes16(p + 32 * H));
        w1 = _mm256_cvtph_ps(LoadBytes16(p + 32 * H + 16));
    } else {
        static_assert(T == DType::kBF16);
        w0 = BF16ToPs(LoadBytes16(p + 32 * H));
        w1 = BF16ToPs(LoadBytes16(p + 32 * H + 16));
    }
}

// K-quants (Q4_K, Q5_K, Q6_K), as in cpu_matmul_avx512.cc: per super-block and weight row the
// sub-block scales unpacked once into 32 floats (Q4_K/Q5_K: [0, 8) d·scale_s, [8, 16)
// -dmin·min_s; Q6_K: [0, 16) d·scale_i, [16, 32) -32·d·scale_i), then each half of a 32-weight
// sub-block assembled as 16 unsigned bytes and converted, w = q·ds + offset.
struct alignas(32) SuperScales {
    float f[32];
};

template <DType T>
KV_AVX2_INLINE void UnpackSuperScales(const uint8_t* sb, SuperScales& out) {
    if constexpr (T == DType::kQ6_K) {
        const __m256 d = _mm256_set1_ps(LoadHalf(sb + 208));
        const __m256 minus32 = _mm256_set1_ps(-32.0f);
        const __m128i sc = LoadBytes16(sb + 192);
        for (int h = 0; h < 2; ++h) {
            const __m256 ds = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h == 0 ? sc : _mm_srli_si128(sc, 8))), d);
            _mm256_store_ps(out.f + 8 * h, ds);
            _mm256_store_ps(out.f + 16 + 8 * h, _mm256_mul_ps(ds, minus32));
        }
    } else {
        alignas(16) uint8_t bytes[16];
        UnpackScalesK4(sb + 4, bytes);
        const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes));
        const __m256 d = _mm256_set1_ps(LoadHalf(sb));
        const __m256 minus_dmin = _mm256_set1_ps(-LoadHalf(sb + 2));
        _mm256_store_ps(out.f, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), d));
        _mm256_store_ps(
            out.f + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))),
                                     minus_dmin));
    }
}

// Weights 32·S + 16·H .. +15 of the super-block at `sb`: the first 8 into w0, the next 8 into w1.
template <DType T, int S, int H>
KV_AVX2_INLINE void HalfSubBlock(const uint8_t* sb, const SuperScales& sc, __m256& w0, __m256& w1) {
    __m128i q;
    __m256 ds;
    __m256 offset;
    if constexpr (T == DType::kQ4_K || T == DType::kQ5_K) {
        constexpr int kQs = T == DType::kQ4_K ? 16 : 48;
        q = LoadBytes16(sb + kQs + 32 * (S / 2) + 16 * H);
        if constexpr (S % 2 == 1) q = _mm_srli_epi16(q, 4);
        q = _mm_and_si128(q, _mm_set1_epi8(0x0F));
        if constexpr (T == DType::kQ5_K) {
            // Bit S of qh[l]; a 16-bit shift moves the neighbour byte's bits above bit 0 only.
            const __m128i h =
                _mm_and_si128(_mm_srli_epi16(LoadBytes16(sb + 16 + 16 * H), S), _mm_set1_epi8(1));
            q = _mm_or_si128(q, _mm_slli_epi16(h, 4));
        }
        ds = _mm256_broadcast_ss(&sc.f[S]);
        offset = _mm256_broadcast_ss(&sc.f[8 + S]);
    } else {
        static_assert(T == DType::kQ6_K);
        constexpr int kHalf = S / 4;
        constexpr int kT = S % 4;
        __m128i lo = LoadBytes16(sb + 64 * kHalf + 32 * (kT % 2) + 16 * H);
        if constexpr (kT >= 2) lo = _mm_srli_epi16(lo, 4);
        __m128i hi = LoadBytes16(sb + 128 + 32 * kHalf + 16 * H);
        if constexpr (kT < 2) {
            hi = _mm_slli_epi16(hi, 4 - 2 * kT);
        } else if constexpr (kT == 3) {
            hi = _mm_srli_epi16(hi, 2);
        }
        q = _mm_or_si128(_mm_and_si128(lo, _mm_set1_epi8(0x0F)),
                         _mm_and_si128(hi, _mm_set1_epi8(0x30)));
        constexpr int kScale = 8 * kHalf + 2 * kT + H;
        ds = _mm256_broadcast_ss(&sc.f[kScale]);
        offset = _mm256_broadcast_ss(&sc.f[16 + kScale]);
    }
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), ds, offset);
    w1 =
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), ds, offset);
}

template <DType T, int R, int C, int S, int H>
KV_AVX2_INLINE void SuperHalfStep(const float* xs, int64_t k, const uint8_t* wsb, size_t row_bytes,
                                  const SuperScales (&sc)[C], __m256 (&acc)[R][C]) {
    __m256 w0[C];
    __m256 w1[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) HalfSubBlock<T, S, H>(wsb + c * row_bytes, sc[c], w0[c], w1[c]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        const __m256 x0 = _mm256_loadu_ps(xs + r * k + 32 * S + 16 * H);
        const __m256 x1 = _mm256_loadu_ps(xs + r * k + 32 * S + 16 * H + 8);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_fmadd_ps(x0, w0[c], acc[r][c]);
            acc[r][c] = _mm256_fmadd_ps(x1, w1[c], acc[r][c]);
        }
    }
}

template <DType T, int R, int C, int S>
KV_AVX2_INLINE void SuperStep(const float* xs, int64_t k, const uint8_t* wsb, size_t row_bytes,
                              const SuperScales (&sc)[C], __m256 (&acc)[R][C]) {
    SuperHalfStep<T, R, C, S, 0>(xs, k, wsb, row_bytes, sc, acc);
    SuperHalfStep<T, R, C, S, 1>(xs, k, wsb, row_bytes, sc, acc);
}

template <DType T, int S>
KV_AVX2_INLINE void StoreSubBlock(const uint8_t* sb, const SuperScales& sc, float* out) {
    __m256 w0;
    __m256 w1;
    HalfSubBlock<T, S, 0>(sb, sc, w0, w1);
    _mm256_storeu_ps(out + 32 * S, w0);
    _mm256_storeu_ps(out + 32 * S + 8, w1);
    HalfSubBlock<T, S, 1>(sb, sc, w0, w1);
    _mm256_storeu_ps(out + 32 * S + 16, w0);
    _mm256_storeu_ps(out + 32 * S + 24, w1);
}

template <DType T>
KV_AVX2 void DequantizeSuperRow(const uint8_t* row, int64_t k, float* out) {
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

float ScalarWeight(DType dtype, const uint8_t* row, int64_t col) {
    uint16_t h;
    std::memcpy(&h, row + 2 * col, sizeof(h));
    return dtype == DType::kF16 ? HalfToFloat(h) : BF16ToFloat(h);
}

template <DType T, int R, int C, int H>
KV_AVX2_INLINE void HalfStep(const float* xb, int64_t k, const uint8_t* wb, size_t row_bytes,
                             __m256 (&acc)[R][C]) {
    __m256 w0[C];
    __m256 w1[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) LoadHalfBlock<T, H>(wb + c * row_bytes, w0[c], w1[c]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
        const __m256 x0 = _mm256_loadu_ps(xb + r * k + 16 * H);
        const __m256 x1 = _mm256_loadu_ps(xb + r * k + 16 * H + 8);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_fmadd_ps(x0, w0[c], acc[r][c]);
            acc[r][c] = _mm256_fmadd_ps(x1, w1[c], acc[r][c]);
        }
    }
}

// y[r * ldy + c] = x row r · weight row c, for r < R, c < C.
template <DType T, int R, int C>
KV_AVX2 void Tile(const float* x, int64_t k, const uint8_t* w, size_t row_bytes, float* y,
                  int64_t ldy) {
    __m256 acc[R][C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    }
    if constexpr (kIsSuper<T>) {
        for (int64_t b = 0; b < k / kSuperBlock; ++b) {
            const uint8_t* wsb = w + b * kSuperBytes<T>;
            SuperScales sc[C];
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) UnpackSuperScales<T>(wsb + c * row_bytes, sc[c]);
            const float* xs = x + b * kSuperBlock;
            SuperStep<T, R, C, 0>(xs, k, wsb, row_bytes, sc, acc);
            SuperStep<T, R, C, 1>(xs, k, wsb, row_bytes, sc, acc);
            SuperStep<T, R, C, 2>(xs, k, wsb, row_bytes, sc, acc);
            SuperStep<T, R, C, 3>(xs, k, wsb, row_bytes, sc, acc);
            SuperStep<T, R, C, 4>(xs, k, wsb, row_bytes, sc, acc);
            SuperStep<T, R, C, 5>(xs, k, wsb, row_bytes, sc, acc);
            SuperStep<T, R, C, 6>(xs, k, wsb, row_bytes, sc, acc);
            SuperStep<T, R, C, 7>(xs, k, wsb, row_bytes, sc, acc);
        }
    } else {
        const int64_t blocks = k / kBlock;
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* wb = w + b * kBlockBytes<T>;
            const float* xb = x + b * kBlock;
            HalfStep<T, R, C, 0>(xb, k, wb, row_bytes, acc);
            HalfStep<T, R, C, 1>(xb, k, wb, row_bytes, acc);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            float sum = HorizontalSum(acc[r][c]);
            if constexpr (kIsFloat<T>) {
                // The < 32 trailing elements of a float-type row.
                for (int64_t i = k / kBlock * kBlock; i < k; ++i) {
                    sum += x[r * k + i] * ScalarWeight(T, w + c * row_bytes, i);
                }
            }
            y[r * ldy + c] = sum;
        }
    }
}

constexpr int kMaxTileRows = 4;

template <DType T, int C>
KV_AVX2 void TileRows(int rows, const float* x, int64_t k, const uint8_t* w, size_t row_bytes,
                      float* y, int64_t ldy) {
    switch (rows) {
        case 1:
            return Tile<T, 1, C>(x, k, w, row_bytes, y, ldy);
        case 2:
            return Tile<T, 2, C>(x, k, w, row_bytes, y, ldy);
        case 3:
            return Tile<T, 3, C>(x, k, w, row_bytes, y, ldy);
        case 4:
            return Tile<T, 4, C>(x, k, w, row_bytes, y, ldy);
    }
}

template <DType T>
KV_AVX2 void RowsT(const float* x, int64_t m, int64_t k, const uint8_t* w, size_t row_bytes,
                   int64_t n0, int64_t n1, float* y, int64_t ldy) {
    int64_t j = n0;
    if (m == 1) {
        for (; j + 4 <= n1; j += 4) Tile<T, 1, 4>(x, k, w + j * row_bytes, row_bytes, y + j, ldy);
    }
    for (; j + 2 <= n1; j += 2) {
        for (int64_t i = 0; i < m; i += kMaxTileRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kMaxTileRows, m - i));
            TileRows<T, 2>(rows, x + i * k, k, w + j * row_bytes, row_bytes, y + i * ldy + j, ldy);
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
KV_AVX2 void DequantizeRowsT(const uint8_t* w, size_t row_bytes, int64_t k, int64_t r0, int64_t r1,
                             float* out) {
    if constexpr (kIsSuper<T>) {
        for (int64_t r = r0; r < r1; ++r) {
            DequantizeSuperRow<T>(w + r * row_bytes, k, out + (r - r0) * k);
        }
    } else {
        const int64_t blocks = k / kBlock;
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* row = w + r * row_bytes;
            float* o = out + (r - r0) * k;
            for (int64_t b = 0; b < blocks; ++b) {
                __m256 w0;
                __m256 w1;
                LoadHalfBlock<T, 0>(row + b * kBlockBytes<T>, w0, w1);
                _mm256_storeu_ps(o + b * kBlock, w0);
                _mm256_storeu_ps(o + b * kBlock + 8, w1);
                LoadHalfBlock<T, 1>(row + b * kBlockBytes<T>, w0, w1);
                _mm256_storeu_ps(o + b * kBlock + 16, w0);
                _mm256_storeu_ps(o + b * kBlock + 24, w1);
            }
            if constexpr (kIsFloat<T>) {
                for (int64_t i = blocks * kBlock; i < k; ++i) o[i] = ScalarWeight(T, row, i);
            }
        }
    }
}

}  // namespace

KV_AVX2 void MatMulRowsAvx2(const float* x, int64_t m, const StoredMatrix& w, int64_t n0,
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
            KV_CHECK(false) << "no avx2 kernel for " << DTypeName(w.dtype);
    }
}

KV_AVX2 void DequantizeRowsAvx2(const StoredMatrix& w, int64_t r0, int64_t r1, float* out) {
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
// Int8 activations (ActivationFormat::kInt8) on AVX2: per 32-weight block, vpmaddubsw (unsigned
// weight bytes x signed activation bytes, pairs summed to 16 bits) and vpmaddwd by ones to 32-bit
// lanes, then one fp32 scale dw·dx per block. No 16-bit sum can saturate: Q4 quants are at most
// 15 (2·15·127 < 2^15), and Q8_0 goes through |w| and x·sign(w) (2·127·127 < 2^15).
// Activation blocks keep their natural order: a Q4 block's 16 bytes unpack to [low nibbles =
// weights 0-15, high nibbles = 16-31]. Q4_0's -8 is added per 32-bit lane (-8 x the lane's 4
// activations), Q4_1's offset is m x dx x sum(q).
namespace {

struct Int8Block {
    int8_t q[32];
    int32_t init[8];  // Q4_0: -8 x the sum of each lane's 4 activations
    float d;
    float sum_x;  // dx x sum(q): the block's activations as the kernels see them
    float pad[2];
};
static_assert(sizeof(Int8Block) == 80);

void QuantizeBlocks(const float* x, int64_t k, Int8Block* out) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
        Int8Block& blk = out[b];
        int32_t sum_q;
        blk.d = QuantizeBlock32(x + b * kBlock, blk.q, &sum_q);
        blk.sum_x = blk.d * static_cast<float>(sum_q);
        for (int lane = 0; lane < 8; ++lane) {
            int32_t s = 0;
            for (int i = 0; i < 4; ++i) s += blk.q[4 * lane + i];
            blk.init[lane] = -8 * s;
        }
        blk.pad[0] = blk.pad[1] = 0.0f;
    }
}

// The 32 quants of the weight block at p as bytes in activation order (Q8_0: signed; Q4: 0..15).
template <DType T>
KV_AVX2_INLINE __m256i LoadQuants(const uint8_t* p) {
    if constexpr (T == DType::kQ8_0) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    } else {
        const __m128i q = LoadBytes16(p + (T == DType::kQ4_1 ? 4 : 2));
        const __m256i both =
            _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
        return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
    }
}

template <DType T, int R, int C>
KV_AVX2 void TileInt8(const Int8Block* xq, int64_t blocks, const uint8_t* w, size_t row_bytes,
                      float* y, int64_t ldy) {
    __m256 acc[R][C];
    float offset[R][C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            acc[r][c] = _mm256_setzero_ps();
            offset[r][c] = 0.0f;
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i wq[C];
        float dw[C];
        float mw[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            const uint8_t* p = w + c * row_bytes + b * kBlockBytes<T>;
            wq[c] = LoadQuants<T>(p);
            dw[c] = LoadHalf(p);
            mw[c] = T == DType::kQ4_1 ? LoadHalf(p + 2) : 0.0f;
            if constexpr (T == DType::kQ8_0) wq[c] = _mm256_abs_epi8(wq[c]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const Int8Block& xb = xq[r * blocks + b];
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) {
                __m256i xs = xv;
                if constexpr (T == DType::kQ8_0) {
                    // The signs of the weights moved onto the activations.
                    const __m256i ws = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                        w + c * row_bytes + b * kBlockBytes<T> + 2));
                    xs = _mm256_sign_epi8(xv, ws);
                }
                __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq[c], xs), ones);
                if constexpr (T == DType::kQ4_0) {
                    dot = _mm256_add_epi32(
                        dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.init)));
                }
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[c] * xb.d),
                                            acc[r][c]);
                if constexpr (T == DType::kQ4_1) offset[r][c] += mw[c] * xb.sum_x;
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) y[r * ldy + c] = HorizontalSum(acc[r][c]) + offset[r][c];
    }
}

template <DType T, int C>
KV_AVX2 void TileInt8Rows(int rows, const Int8Block* xq, int64_t blocks, const uint8_t* w,
                          size_t row_bytes, float* y, int64_t ldy) {
    switch (rows) {
        case 1:
            return TileInt8<T, 1, C>(xq, blocks, w, row_bytes, y, ldy);
        case 2:
            return TileInt8<T, 2, C>(xq, blocks, w, row_bytes, y, ldy);
        case 3:
            return TileInt8<T, 3, C>(xq, blocks, w, row_bytes, y, ldy);
        case 4:
            return TileInt8<T, 4, C>(xq, blocks, w, row_bytes, y, ldy);
    }
}

template <DType T>
KV_AVX2 void RowsInt8T(const Int8Block* xq, int64_t m, const StoredMatrix& w, int64_t n0,
                       int64_t n1, float* y) {
    const size_t row_bytes = RowBytes(w.dtype, w.cols);
    const int64_t blocks = w.cols / kBlock;
    const int64_t ldy = w.rows;
    int64_t j = n0;
    if (m == 1) {
        for (; j + 4 <= n1; j += 4) {
            TileInt8<T, 1, 4>(xq, blocks, w.data + j * row_bytes, row_bytes, y + j, ldy);
        }
    }
    for (; j + 2 <= n1; j += 2) {
        for (int64_t i = 0; i < m; i += kMaxTileRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kMaxTileRows, m - i));
            TileInt8Rows<T, 2>(rows, xq + i * blocks, blocks, w.data + j * row_bytes, row_bytes,
                               y + i * ldy + j, ldy);
        }
    }
    for (; j < n1; ++j) {
        for (int64_t i = 0; i < m; i += kMaxTileRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kMaxTileRows, m - i));
            TileInt8Rows<T, 1>(rows, xq + i * blocks, blocks, w.data + j * row_bytes, row_bytes,
                               y + i * ldy + j, ldy);
        }
    }
}

}  // namespace

size_t Int8Avx2Bytes(int64_t m, int64_t k) {
    return static_cast<size_t>(m * (k / kBlock)) * sizeof(Int8Block);
}

void QuantizeRowsAvx2(DType /*dtype*/, const float* x, int64_t m, int64_t k, uint8_t* out) {
    auto* blocks = reinterpret_cast<Int8Block*>(out);
    for (int64_t i = 0; i < m; ++i) QuantizeBlocks(x + i * k, k, blocks + i * (k / kBlock));
}

KV_AVX2 void MatMulRowsInt8Avx2(const uint8_t* xq, int64_t m, const StoredMatrix& w, int64_t n0,
                                int64_t n1, float* y) {
    const auto* blocks = reinterpret_cast<const Int8Block*>(xq);
    switch (w.dtype) {
        case DType::kQ8_0:
            return RowsInt8T<DType::kQ8_0>(blocks, m, w, n0, n1, y);
        case DType::kQ4_0:
            return RowsInt8T<DType::kQ4_0>(blocks, m, w, n0, n1, y);
        case DType::kQ4_1:
            return RowsInt8T<DType::kQ4_1>(blocks, m, w, n0, n1, y);
        default:
            KV_CHECK(false) << "no int8 avx2 kernel for " << DTypeName(w.dtype);
    }
}

}  // namespace kvshard::cpu::matmul_internal

#endif  // defined(__x86_64__)
