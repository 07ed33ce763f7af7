// Products of many rows over the interleaved copies (kernels/cpu_matmul.h, BatchWeightSource):
// the batched-decode GEMM (kernels/cpu_gemm.cc) and the prefill panels (kernels/cpu_matmul.cc)
// dequantize strips of weight rows to fp32 before multiplying them; with kCopy the rows of whole
// groups come out of the single-row copy instead of the stored rows, so a prefill between decode
// steps streams the same bytes the decode steps read instead of a second copy of the weights.
//
// The values are those the stored rows give, bit for bit: Q4_1's table d·i + m (one FMA, i =
// 0..15) indexed by each nibble, Q8_0's q · d, with the same fp16 conversions; only where the
// quant bytes are read from differs. A group block's quants are 32-byte units of one 16-bit word
// per row (unit t: bytes 2t and 2t + 1 of the 16 rows), so a row's bytes are a word transpose:
// vpermt2w gathers, from two registers of two units each, word t of 4 (Q4_1) or 2 (Q8_0) rows,
// and masked blends put the units of the other registers in.
#include "kernels/cpu_matmul_batch_copy.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/check.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_matmul_internal.h"

namespace kvshard::cpu {
namespace {

constexpr int kNotForced = -1;
std::atomic<int> g_forced{kNotForced};

// KVSHARD_MATMUL_BATCH_WEIGHTS=stored|copy, read once; unset means the default.
BatchWeightSource EnvironmentSource() {
    static const BatchWeightSource source = [] {
        const char* env = std::getenv("KVSHARD_MATMUL_BATCH_WEIGHTS");
        if (env == nullptr) return kDefaultBatchWeightSource;
        if (std::string_view(env) == "stored") return BatchWeightSource::kStored;
        if (std::string_view(env) == "copy") return BatchWeightSource::kCopy;
        std::fprintf(stderr,
                     "kvshard: KVSHARD_MATMUL_BATCH_WEIGHTS=%s is not stored or copy; using %s\n",
                     env, std::string(BatchWeightSourceName(kDefaultBatchWeightSource)).c_str());
        return kDefaultBatchWeightSource;
    }();
    return source;
}

}  // namespace

std::string_view BatchWeightSourceName(BatchWeightSource source) {
    switch (source) {
        case BatchWeightSource::kStored:
            return "stored";
        case BatchWeightSource::kCopy:
            return "copy";
    }
    return "?";
}

BatchWeightSource ActiveBatchWeightSource() {
    const int forced = g_forced.load(std::memory_order_relaxed);
    return forced == kNotForced ? EnvironmentSource() : static_cast<BatchWeightSource>(forced);
}

void ForceBatchWeightSource(BatchWeightSource source) {
    g_forced.store(static_cast<int>(source), std::memory_order_relaxed);
}

void ResetBatchWeightSource() { g_forced.store(kNotForced, std::memory_order_relaxed); }

}  // namespace kvshard::cpu

#if defined(__x86_64__)

// GCC 12 reports the deliberately undefined pass-through operand of many AVX-512 intrinsics as
// uninitialized once they are inlined (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

namespace kvshard::cpu::matmul_internal {
namespace {

static_assert(kInterleaveRows == 16, "a group is 16 rows");
constexpr int64_t kBlock = 32;

KV_AVX512 inline __m512i Load64(const uint8_t* p) {
    return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// A float in memory broadcast to 16 lanes (as the stored-layout kernels load their scales).
KV_AVX512 inline __m512 BroadcastFromMemory(const float* f) {
    __m512 r;
    __asm__("vbroadcastss %1, %0" : "=v"(r) : "m"(*f));
    return r;
}

// Rows [lo, hi) of group g (rows counted inside the group), Q4_1: 320 bytes a block (the 16
// rows' fp16 d, their fp16 m, 8 units).
KV_AVX512 void GroupRowsQ4_1(const uint8_t* group, int64_t blocks, int64_t k, int64_t lo,
                             int64_t hi, float* out) {
    // Word lane L of quad q: row 4q + L / 8, unit L % 8, found at word (L % 8 % 4) · 16 + row of
    // the pair of registers holding units 0-3 (or 4-7, blended in under kHighUnits).
    alignas(64) uint16_t index[4][32];
    for (int q = 0; q < 4; ++q) {
        for (int lane = 0; lane < 32; ++lane) {
            index[q][lane] = static_cast<uint16_t>((lane % 8 % 4) * 16 + 4 * q + lane / 8);
        }
    }
    constexpr __mmask32 kHighUnits = 0xF0F0F0F0u;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = group + b * 320;
        alignas(64) float d[16];
        alignas(64) float mn[16];
        _mm512_store_ps(d,
                        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
        _mm512_store_ps(
            mn, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))));
        const uint8_t* units = p + 64;
        const __m512i u01 = Load64(units);
        const __m512i u23 = Load64(units + 64);
        const __m512i u45 = Load64(units + 128);
        const __m512i u67 = Load64(units + 192);
        for (int64_t q = lo / 4; q * 4 < hi; ++q) {
            const __m512i idx = _mm512_load_si512(index[q]);
            const __m512i low = _mm512_permutex2var_epi16(u01, idx, u23);
            const __m512i high = _mm512_permutex2var_epi16(u45, idx, u67);
            alignas(64) uint8_t bytes[64];
            _mm512_store_si512(bytes, _mm512_mask_blend_epi16(kHighUnits, low, high));
            for (int64_t r = std::max(lo, 4 * q); r < std::min(hi, 4 * q + 4); ++r) {
                const __m512 table =
                    _mm512_fmadd_ps(iota, BroadcastFromMemory(&d[r]), BroadcastFromMemory(&mn[r]));
                const __m512i nibbles = _mm512_cvtepu8_epi32(
                    _mm_load_si128(reinterpret_cast<const __m128i*>(bytes + 16 * (r - 4 * q))));
                float* o = out + (r - lo) * k + b * kBlock;
                _mm512_storeu_ps(o, _mm512_permutexvar_ps(nibbles, table));
                _mm512_storeu_ps(o + 16,
                                 _mm512_permutexvar_ps(_mm512_srli_epi32(nibbles, 4), table));
            }
        }
    }
}

// The same for Q8_0: 544 bytes a block (the 16 rows' fp16 d, 16 units).
KV_AVX512 void GroupRowsQ8_0(const uint8_t* group, int64_t blocks, int64_t k, int64_t lo,
                             int64_t hi, float* out) {
    // Word lane L of pair p: row 2p + L / 16, unit t = L % 16, at word (t % 4) · 16 + row of the
    // register pair holding units 4(t / 4) .. 4(t / 4) + 3.
    alignas(64) uint16_t index[8][32];
    for (int p = 0; p < 8; ++p) {
        for (int lane = 0; lane < 32; ++lane) {
            index[p][lane] = static_cast<uint16_t>((lane % 16 % 4) * 16 + 2 * p + lane / 16);
        }
    }
    constexpr __mmask32 kUnits4to7 = 0x00F000F0u;
    constexpr __mmask32 kUnits8to11 = 0x0F000F00u;
    constexpr __mmask32 kUnits12to15 = 0xF000F000u;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* p = group + b * 544;
        alignas(64) float d[16];
        _mm512_store_ps(d,
                        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
        const uint8_t* units = p + 32;
        __m512i u[8];
        for (int i = 0; i < 8; ++i) u[i] = Load64(units + 64 * i);
        for (int64_t pair = lo / 2; pair * 2 < hi; ++pair) {
            const __m512i idx = _mm512_load_si512(index[pair]);
            __m512i words = _mm512_permutex2var_epi16(u[0], idx, u[1]);
            words = _mm512_mask_blend_epi16(kUnits4to7, words,
                                            _mm512_permutex2var_epi16(u[2], idx, u[3]));
            words = _mm512_mask_blend_epi16(kUnits8to11, words,
                                            _mm512_permutex2var_epi16(u[4], idx, u[5]));
            words = _mm512_mask_blend_epi16(kUnits12to15, words,
                                            _mm512_permutex2var_epi16(u[6], idx, u[7]));
            alignas(64) uint8_t bytes[64];
            _mm512_store_si512(bytes, words);
            for (int64_t r = std::max(lo, 2 * pair); r < std::min(hi, 2 * pair + 2); ++r) {
                const uint8_t* q = bytes + 32 * (r - 2 * pair);
                const __m512 scale = _mm512_set1_ps(d[r]);
                float* o = out + (r - lo) * k + b * kBlock;
                _mm512_storeu_ps(
                    o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                         _mm_load_si128(reinterpret_cast<const __m128i*>(q)))),
                                     scale));
                _mm512_storeu_ps(
                    o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(
                                              reinterpret_cast<const __m128i*>(q + 16)))),
                                          scale));
            }
        }
    }
}

}  // namespace

KV_AVX512 void DequantizeRowsPreferCopyAvx512(const StoredMatrix& w, int64_t r0, int64_t r1,
                                              float* out) {
    const int64_t whole = w.rows / kInterleaveRows * kInterleaveRows;
    const bool copy = w.interleaved != nullptr &&
                      (w.dtype == DType::kQ4_1 || w.dtype == DType::kQ8_0) && r0 < whole &&
                      ActiveBatchWeightSource() == BatchWeightSource::kCopy;
    if (!copy) return DequantizeRowsAvx512(w, r0, r1, out);
    const int64_t k = w.cols;
    const int64_t blocks = k / kBlock;
    const size_t group_bytes = static_cast<size_t>(kInterleaveRows) * RowBytes(w.dtype, k);
    const int64_t mid = std::min(r1, whole);
    for (int64_t g = r0 / kInterleaveRows; g * kInterleaveRows < mid; ++g) {
        const int64_t first = g * kInterleaveRows;
        const int64_t lo = std::max(r0, first) - first;
        const int64_t hi = std::min(mid, first + kInterleaveRows) - first;
        const uint8_t* group = w.interleaved + static_cast<size_t>(g) * group_bytes;
        float* o = out + (first + lo - r0) * k;
        if (w.dtype == DType::kQ4_1) {
            GroupRowsQ4_1(group, blocks, k, lo, hi, o);
        } else {
            GroupRowsQ8_0(group, blocks, k, lo, hi, o);
        }
    }
    if (r1 > mid) DequantizeRowsAvx512(w, mid, r1, out + (mid - r0) * k);
}

}  // namespace kvshard::cpu::matmul_internal

#endif  // defined(__x86_64__)
