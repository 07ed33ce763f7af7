// Attention over a contiguous cache (cpu::Attention) and over a paged pool (cpu::PagedAttention).
// Both run the same loop, AttentionRows, parameterised by how a K or V row is found; so paged and
// contiguous results are bit-identical for fp32 storage.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common/check.h"
#include "kernels/cpu_ops.h"
#include "kernels/kv_quant.h"
#include "kernels/paged_attention.h"
#include "kernels/vec_math.h"

namespace kvshard::cpu {
namespace {

// Rows(t, kv_head, is_v, scratch) returns the K or V row of position t for one KV head as floats
// (possibly dequantized into scratch, which holds head_dim floats). Query head h reads KV head
// kv_head_of_q[h], or h / (num_heads / num_kv_heads) when kv_head_of_q is null.
template <typename Rows>
void AttentionRows(const float* q, const Rows& rows, float* out, int64_t num_q, int64_t q_pos0,
                   int64_t num_kv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   const int32_t* kv_head_of_q, int64_t window = 0) {
    KV_CHECK_LE(q_pos0 + num_q, num_kv);
    if (kv_head_of_q == nullptr) {
        KV_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0)
            << "num_heads=" << num_heads << " num_kv_heads=" << num_kv_heads;
    } else {
        for (int64_t h = 0; h < num_heads; ++h) {
            KV_CHECK(kv_head_of_q[h] >= 0 && kv_head_of_q[h] < num_kv_heads)
                << "query head " << h << " maps to KV head " << kv_head_of_q[h] << " of "
                << num_kv_heads;
        }
    }
    const int64_t group = kv_head_of_q == nullptr ? num_heads / num_kv_heads : 1;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const int64_t num_tasks = num_heads * num_q;
    // About 20 µs of work on one core; below that the OpenMP fork/join costs more than it saves.
    const bool parallel = num_tasks > 1 && num_tasks * (q_pos0 + num_q) * head_dim >= (1 << 16);
#pragma omp parallel if (parallel)
    {
        // Scores of one query row; a row attends to at most num_kv positions.
        std::vector<float> scores(static_cast<size_t>(num_kv));
        std::vector<float> scratch(static_cast<size_t>(head_dim));
        // Rows attend to different numbers of positions (causal), hence dynamic scheduling.
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task) {
            const int64_t h = task % num_heads;
            const int64_t i = task / num_heads;
            const int64_t kv_head = kv_head_of_q == nullptr ? h / group : kv_head_of_q[h];
            const float* qv = q + (i * num_heads + h) * head_dim;
            const int64_t len = q_pos0 + i + 1;
            // A sliding window keeps the last `window` positions: t > position - window.
            const int64_t begin = window > 0 ? std::max<int64_t>(0, len - window) : 0;
            float* s = scores.data();
            float max_score = -std::numeric_limits<float>::infinity();
            for (int64_t t = begin; t < len; ++t) {
                s[t] = Dot(qv, rows(t, kv_head, false, scratch.data()), head_dim) * scale;
                max_score = std::max(max_score, s[t]);
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = begin; t < len; ++t) {
                s[t] = ExpFast(s[t] - max_score);
                sum += s[t];
            }
            // Weighted sum of V with the unnormalized weights, then one scaling by 1/sum.
            float* o = out + (i * num_heads + h) * head_dim;
            std::fill(o, o + head_dim, 0.0f);
            for (int64_t t = begin; t < len; ++t) {
                Axpy(s[t], rows(t, kv_head, true, scratch.data()), o, head_dim);
            }
            const float inv_sum = 1.0f / sum;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv_sum;
        }
    }
}

struct ContiguousRows {
    const float* k;
    const float* v;
    int64_t stride;
    int64_t head_dim;
    const float* operator()(int64_t t, int64_t kv_head, bool is_v, float*) const {
        return (is_v ? v : k) + t * stride + kv_head * head_dim;
    }
};

struct PagedRows {
    const PagedKvLayer& kv;
    const int32_t* block_table;
    const float* operator()(int64_t t, int64_t kv_head, bool is_v, float* scratch) const {
        const int64_t block = block_table[t / kv.block_size];
        const int64_t slot = t % kv.block_size;
        const uint8_t* b = kv.base + block * kv.block_stride;
        const int64_t index = kv_head * kv.block_size + slot;  // [head][slot]
        const uint8_t* data = b + (is_v ? kv.v_offset : kv.k_offset);
        switch (kv.storage) {
            case KvDtype::kFp32:
                return reinterpret_cast<const float*>(data) + index * kv.head_dim;
            case KvDtype::kFp16:
                DecodeFp16(reinterpret_cast<const uint16_t*>(data) + index * kv.head_dim,
                           kv.head_dim, scratch);
                return scratch;
            case KvDtype::kBf16:
                DecodeBf16(reinterpret_cast<const uint16_t*>(data) + index * kv.head_dim,
                           kv.head_dim, scratch);
                return scratch;
            case KvDtype::kInt8: {
                const float sc = reinterpret_cast<const float*>(
                    b + (is_v ? kv.v_scale_offset : kv.k_scale_offset))[index];
                DequantizeInt8(reinterpret_cast<const int8_t*>(data) + index * kv.head_dim, sc,
                               kv.head_dim, scratch);
                return scratch;
            }
            case KvDtype::kFp8: {
                const float sc = reinterpret_cast<const float*>(
                    b + (is_v ? kv.v_scale_offset : kv.k_scale_offset))[index];
                DequantizeFp8(data + index * kv.head_dim, sc, kv.head_dim, scratch);
                return scratch;
            }
        }
        return nullptr;
    }
};

}  // namespace

void Attention(const float* q, const float* k, const float* v, float* out, int64_t num_q,
               int64_t q_pos0, int64_t num_kv, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, int64_t kv_stride, const int32_t* kv_head_of_q) {
    KV_CHECK_GE(kv_stride, num_kv_heads * head_dim);
    AttentionRows(q, ContiguousRows{k, v, kv_stride, head_dim}, out, num_q, q_pos0, num_kv,
                  num_heads, num_kv_heads, head_dim, kv_head_of_q);
}

int64_t PagedLayerBytes(KvDtype storage, int64_t block_size, int64_t num_kv_heads,
                        int64_t head_dim) {
    // K and V of every (head, slot) cell: data then (8-bit) scales, KvRowBytes each.
    return 2 * num_kv_heads * block_size * KvRowBytes(storage, head_dim);
}

PagedKvLayer MakePagedKvLayer(uint8_t* base, int64_t block_stride, int64_t layer, KvDtype storage,
                              int64_t block_size, int64_t num_kv_heads, int64_t head_dim) {
    PagedKvLayer kv;
    kv.base = base;
    kv.block_stride = block_stride;
    kv.storage = storage;
    kv.block_size = block_size;
    kv.num_kv_heads = num_kv_heads;
    kv.head_dim = head_dim;
    const int64_t cells = num_kv_heads * block_size;
    const int64_t data_bytes = cells * head_dim * KvDtypeBytes(storage);
    kv.k_offset = layer * PagedLayerBytes(storage, block_size, num_kv_heads, head_dim);
    kv.v_offset = kv.k_offset + data_bytes;
    kv.k_scale_offset = kv.v_offset + data_bytes;
    kv.v_scale_offset = kv.k_scale_offset + cells * int64_t(sizeof(float));
    return kv;
}

void PagedKvWrite(const PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                  const int64_t* slots, int64_t n) {
    const int64_t hd = kv.head_dim;
    for (int64_t i = 0; i < n; ++i) {
        if (slots[i] < 0) continue;  // a padded row of a decode step: no KV (Backend::KvWrite)
        const int64_t block = slots[i] / kv.block_size;
        const int64_t slot = slots[i] % kv.block_size;
        uint8_t* b = kv.base + block * kv.block_stride;
        for (int64_t h = 0; h < kv.num_kv_heads; ++h) {
            const int64_t index = h * kv.block_size + slot;
            for (int pass = 0; pass < 2; ++pass) {
                const float* src = (pass == 0 ? k : v) + i * row_stride + h * hd;
                uint8_t* data = b + (pass == 0 ? kv.k_offset : kv.v_offset);
                float* scales = reinterpret_cast<float*>(
                    b + (pass == 0 ? kv.k_scale_offset : kv.v_scale_offset));
                switch (kv.storage) {
                    case KvDtype::kFp32:
                        std::memcpy(reinterpret_cast<float*>(data) + index * hd, src,
                                    static_cast<size_t>(hd) * sizeof(float));
                        break;
                    case KvDtype::kInt8:
                        scales[index] =
                            QuantizeInt8(src, hd, reinterpret_cast<int8_t*>(data) + index * hd);
                        break;
                    case KvDtype::kFp8:
                        scales[index] = QuantizeFp8(src, hd, data + index * hd);
                        break;
                    case KvDtype::kFp16:
                        EncodeFp16(src, hd, reinterpret_cast<uint16_t*>(data) + index * hd);
                        break;
                    case KvDtype::kBf16:
                        EncodeBf16(src, hd, reinterpret_cast<uint16_t*>(data) + index * hd);
                        break;
                }
            }
        }
    }
}

void PagedAttention(const float* q, const PagedKvLayer& kv, const int32_t* block_table, float* out,
                    int64_t num_q, int64_t q_pos0, int64_t num_heads, const int32_t* kv_head_of_q,
                    int64_t window) {
    AttentionRows(q, PagedRows{kv, block_table}, out, num_q, q_pos0, q_pos0 + num_q, num_heads,
                  kv.num_kv_heads, kv.head_dim, kv_head_of_q, window);
}

}  // namespace kvshard::cpu
