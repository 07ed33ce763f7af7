// Reading K/V rows out of a paged pool for the batched attention kernel
// (kernels/paged_attention_rows.h).
#include "kernels/paged_attention_rows.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>

#include "kernels/kv_quant.h"

namespace kvshard::cpu {
namespace {

inline void DequantInt8(const int8_t* q, float scale, int64_t n, float* out) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
}

// Same values as kv_quant's table lookup (every e4m3 value is exact in fp32), but branch-free so it
// vectorizes: a normal e4m3 number moves its exponent and mantissa into fp32's fields with the bias
// raised from 7 to 127; subnormals are man * 2^-9; S.1111.111 is NaN.
inline void DequantFp8(const uint8_t* q, float scale, int64_t n, float* out) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t v = q[i];
        const uint32_t mag = v & 0x7F;
        const float normal = std::bit_cast<float>((mag << 20) + (120u << 23));
        const float subnormal = static_cast<float>(mag & 0x7) * 0x1p-9f;
        float f = (mag >> 3) != 0 ? normal : subnormal;
        f = mag == 0x7F ? std::numeric_limits<float>::quiet_NaN() : f;
        f = std::bit_cast<float>(std::bit_cast<uint32_t>(f) | ((v & 0x80) << 24));
        out[i] = f * scale;
    }
}

}  // namespace

void GatherPagedRows(const PagedKvLayer& kv, const int32_t* block_table, int64_t kv_head,
                     int64_t p0, int64_t n, float* kbuf, float* vbuf, const float** krows,
                     const float** vrows) {
    const int64_t bs = kv.block_size;
    const int64_t hd = kv.head_dim;
    int64_t block = p0 / bs;
    int64_t slot = p0 % bs;
    for (int64_t i = 0; i < n; ++block, slot = 0) {
        const int64_t run = std::min(bs - slot, n - i);
        if (block_table[block] < 0) {
            std::fill(kbuf + i * hd, kbuf + (i + run) * hd, 0.0f);
            std::fill(vbuf + i * hd, vbuf + (i + run) * hd, 0.0f);
            for (int64_t r = 0; r < run; ++r) {
                krows[i + r] = kbuf + (i + r) * hd;
                vrows[i + r] = vbuf + (i + r) * hd;
            }
            i += run;
            continue;
        }
        const uint8_t* b = kv.base + int64_t{block_table[block]} * kv.block_stride;
        const int64_t index = kv_head * bs + slot;  // [head][slot]
        switch (kv.storage) {
            case KvDtype::kFp32: {
                const float* k = reinterpret_cast<const float*>(b + kv.k_offset) + index * hd;
                const float* v = reinterpret_cast<const float*>(b + kv.v_offset) + index * hd;
                for (int64_t r = 0; r < run; ++r) {
                    krows[i + r] = k + r * hd;
                    vrows[i + r] = v + r * hd;
                }
                break;
            }
            case KvDtype::kFp16:
            case KvDtype::kBf16: {
                // A run of slots of one head is contiguous: one conversion per block and side.
                const auto* k = reinterpret_cast<const uint16_t*>(b + kv.k_offset) + index * hd;
                const auto* v = reinterpret_cast<const uint16_t*>(b + kv.v_offset) + index * hd;
                if (kv.storage == KvDtype::kBf16) {
                    DecodeBf16(k, run * hd, kbuf + i * hd);
                    DecodeBf16(v, run * hd, vbuf + i * hd);
                } else {
                    DecodeFp16(k, run * hd, kbuf + i * hd);
                    DecodeFp16(v, run * hd, vbuf + i * hd);
                }
                for (int64_t r = 0; r < run; ++r) {
                    krows[i + r] = kbuf + (i + r) * hd;
                    vrows[i + r] = vbuf + (i + r) * hd;
                }
                break;
            }
            case KvDtype::kInt8:
            case KvDtype::kFp8: {
                const uint8_t* k = b + kv.k_offset + index * hd;
                const uint8_t* v = b + kv.v_offset + index * hd;
                const float* ks = reinterpret_cast<const float*>(b + kv.k_scale_offset) + index;
                const float* vs = reinterpret_cast<const float*>(b + kv.v_scale_offset) + index;
                for (int64_t r = 0; r < run; ++r) {
                    float* kd = kbuf + (i + r) * hd;
                    float* vd = vbuf + (i + r) * hd;
                    if (kv.storage == KvDtype::kInt8) {
                        DequantInt8(reinterpret_cast<const int8_t*>(k) + r * hd, ks[r], hd, kd);
                        DequantInt8(reinterpret_cast<const int8_t*>(v) + r * hd, vs[r], hd, vd);
                    } else {
                        DequantFp8(k + r * hd, ks[r], hd, kd);
                        DequantFp8(v + r * hd, vs[r], hd, vd);
                    }
                    krows[i + r] = kd;
                    vrows[i + r] = vd;
                }
                break;
            }
        }
        i += run;
    }
}

void PrefetchPagedRows(const PagedKvLayer& kv, const int32_t* block_table, int64_t kv_head,
                       int64_t p0, int64_t p1) {
    constexpr int64_t kLine = 64;
    const int64_t bs = kv.block_size;
    const int64_t row_bytes = kv.head_dim * KvDtypeBytes(kv.storage);
    for (int64_t p = p0; p < p1;) {
        const int64_t block = p / bs;
        const int64_t slot = p % bs;
        const int64_t run = std::min(bs - slot, p1 - p);
        p += run;
        if (block_table[block] < 0) continue;
        const uint8_t* b = kv.base + int64_t{block_table[block]} * kv.block_stride;
        // A run of slots of one head is contiguous in K and in V.
        const int64_t first = (kv_head * bs + slot) * row_bytes;
        for (const int64_t offset : {kv.k_offset, kv.v_offset}) {
            const uint8_t* begin = b + offset + first;
            for (int64_t o = 0; o < run * row_bytes; o += kLine) __builtin_prefetch(begin + o, 0, 2);
        }
    }
}

}  // namespace kvshard::cpu
