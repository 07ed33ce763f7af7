// The index and launch arithmetic of the CUDA backend (kernels/cuda/cuda_backend.h), written once
// as __host__ __device__ functions: the kernels call them on the device and
// tests/kernels/cuda_launch_math_test.cc checks them on the CPU against the CPU ops, so a build
// without a GPU (or without CUDA) still tests the slot → address math, the split ranges, the
// softmax merge and the 8-bit and 16-bit KV encodings the device kernels use.
// A plain header: no CUDA includes; compiled by nvcc and by the host compiler alike.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/kv_dtype.h"

#if defined(__CUDACC__)
#define KV_HD __host__ __device__ inline
#else
#define KV_HD inline
#endif

namespace kvshard::cuda {

using std::isnan;
using std::signbit;

// ---- paged attention launch shapes ----

// Keys a thread block scores per tile (one per lane of a warp).
constexpr int kAttnTileKeys = 32;
// Threads of an attention block.
constexpr int kAttnThreads = 128;
// Query vectors × head_dim a block holds in its accumulators (kAttnThreads threads, 16 floats
// each): 16 query vectors at head_dim 128, 8 at 256.
constexpr int kAttnMaxAccFloats = 2048;
// Most KV splits of one decode row.
constexpr int kMaxKvSplits = 32;
// head_dim the attention kernel accepts.
constexpr int kAttnMaxHeadDim = 256;

// Most query vectors of one pass (the bookkeeping arrays of a block).
constexpr int kAttnMaxQueryVectors = 128;
// Most query heads of one rank the attention kernel accepts (a block lists its GQA group).
constexpr int kAttnMaxHeads = 256;

// Query vectors (one head of one query row) a block processes in one pass over the keys.
KV_HD int QueryVectorsPerPass(int64_t head_dim) {
    if (head_dim <= 0) return 0;
    const int64_t qv = kAttnMaxAccFloats / head_dim;
    return static_cast<int>(qv < kAttnMaxQueryVectors ? qv : kAttnMaxQueryVectors);
}

// Floats from one key's (or value's) row to the next in a block's tile: one more than head_dim,
// so that the 32 keys a warp scores at once fall in 32 different shared-memory banks.
KV_HD int64_t TileRowFloats(int64_t head_dim) { return head_dim + 1; }

// Dynamic shared memory of an attention block: the pass's queries, one K or V tile, the scores,
// and per query vector its running max, sum and rescale factor.
KV_HD int64_t AttentionSharedBytes(int64_t head_dim) {
    const int64_t qv = QueryVectorsPerPass(head_dim);
    return (qv * head_dim + kAttnTileKeys * TileRowFloats(head_dim) + qv * kAttnTileKeys + 3 * qv) *
           static_cast<int64_t>(sizeof(float));
}

// How many blocks split the keys of each decode row: enough blocks (seqs × kv_heads × splits)
// to give every multiprocessor two, at most kMaxKvSplits, and no more than the partial results
// (m, l and head_dim sums per query head and split) that fit in `scratch_floats`.
KV_HD int ChooseNumSplits(int64_t num_seqs, int64_t num_kv_heads, int64_t num_heads,
                          int64_t head_dim, int sm_count, int64_t scratch_floats) {
    if (num_seqs <= 0 || num_kv_heads <= 0 || num_heads <= 0 || head_dim <= 0) return 1;
    const int64_t blocks = num_seqs * num_kv_heads;
    const int64_t target = 2 * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);
    int64_t splits = (target + blocks - 1) / blocks;
    if (splits > kMaxKvSplits) splits = kMaxKvSplits;
    const int64_t per_split = num_seqs * num_heads * (head_dim + 2);
    const int64_t fit = per_split > 0 ? scratch_floats / per_split : 0;
    if (splits > fit) splits = fit;
    return splits < 1 ? 1 : static_cast<int>(splits);
}

// The keys [begin, end) split `split` of `num_splits` of a context of `len` positions covers:
// whole tiles, in order, the last ranges possibly empty (begin >= end).
struct KeyRange {
    int64_t begin;
    int64_t end;
};
KV_HD KeyRange SplitKeyRange(int64_t len, int num_splits, int split) {
    const int64_t tiles = (len + kAttnTileKeys - 1) / kAttnTileKeys;
    const int64_t per = (tiles + num_splits - 1) / num_splits;
    int64_t begin = static_cast<int64_t>(split) * per * kAttnTileKeys;
    int64_t end = begin + per * kAttnTileKeys;
    if (begin > len) begin = len;
    if (end > len) end = len;
    return {begin, end};
}

// The same over the keys [first, len) only (a sliding window's): whole tiles from `first`.
KV_HD KeyRange SplitKeyRange(int64_t first, int64_t len, int num_splits, int split) {
    const KeyRange r = SplitKeyRange(len - first, num_splits, split);
    return {first + r.begin, first + r.end};
}

// ---- sliding windows (PagedAttentionBatch::window) ----

// The first key a query at position `pos` sees: pos - window + 1, or 0 (window <= 0: no window).
KV_HD int64_t WindowStart(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}
// Whether the query at `pos` attends to the key at `key`: causal, and inside its window.
KV_HD bool KeyVisible(int64_t key, int64_t pos, int64_t window) {
    return key <= pos && key >= WindowStart(pos, window);
}

// ---- how an attention block deals out its sequence's work ----

// A block (sequence s, KV head, split z) holds at most QueryVectorsPerPass(head_dim) query
// vectors (one head of one row) at a time. A decode row (n_rows == 1) takes every head of the
// GQA group in passes of heads_per_pass, over its own split of the keys; a prefill chunk is cut
// into items of rows_per_pass rows × one head pass, dealt out round robin to the z blocks, each
// over keys 0 .. its last row's position.
struct AttnPlan {
    bool decode;
    int heads_per_pass;
    int head_passes;
    int64_t rows_per_pass;
    int64_t items;
};
KV_HD AttnPlan PlanAttention(int64_t n_rows, int group_size, int qv_max) {
    AttnPlan p;
    p.decode = n_rows == 1;
    p.heads_per_pass = group_size < qv_max ? group_size : qv_max;
    p.head_passes = p.heads_per_pass > 0 ? (group_size + p.heads_per_pass - 1) / p.heads_per_pass : 0;
    p.rows_per_pass = p.decode || p.heads_per_pass == 0 ? 1 : qv_max / p.heads_per_pass;
    p.items = (n_rows + p.rows_per_pass - 1) / p.rows_per_pass * p.head_passes;
    return p;
}
// The items block z takes: first, first + stride, ... below plan.items.
KV_HD int64_t FirstItem(const AttnPlan& p, int z) { return p.decode ? 0 : z; }
KV_HD int64_t ItemStride(const AttnPlan& p, int num_splits) { return p.decode ? 1 : num_splits; }

// One item: rows [r_begin, r_end) of the sequence, group heads [h_begin, h_end), keys
// [k_begin, k_end). `len` is the sequence's context after the step; its rows sit at positions
// len - n_rows + r. With a sliding window (window > 0) the keys start at the window of the item's
// first row (a decode row's splits share its window), and KeyVisible masks each row's.
struct AttnItem {
    int64_t r_begin, r_end;
    int h_begin, h_end;
    int64_t k_begin, k_end;
};
KV_HD AttnItem ItemOf(const AttnPlan& p, int64_t item, int64_t n_rows, int64_t len,
                      int group_size, int num_splits, int z, int64_t window = 0) {
    AttnItem w;
    const int64_t tile = item / p.head_passes;
    const int pass = static_cast<int>(item % p.head_passes);
    w.r_begin = tile * p.rows_per_pass;
    w.r_end = w.r_begin + p.rows_per_pass < n_rows ? w.r_begin + p.rows_per_pass : n_rows;
    w.h_begin = pass * p.heads_per_pass;
    w.h_end = w.h_begin + p.heads_per_pass < group_size ? w.h_begin + p.heads_per_pass : group_size;
    if (p.decode) {
        const KeyRange range = SplitKeyRange(WindowStart(len - 1, window), len, num_splits, z);
        w.k_begin = range.begin;
        w.k_end = range.end;
    } else {
        w.k_begin = WindowStart(len - n_rows + w.r_begin, window);
        w.k_end = len - n_rows + w.r_end;  // causal bound of the item's last row
    }
    return w;
}

// ---- the FA2-style prefill kernel (kernels/cuda/prefill_attention.h) ----

// Threads of a prefill block: 4 warps.
constexpr int kPrefillThreads = 128;
// Keys of one K/V tile: one per lane of a warp when scoring.
constexpr int kPrefillTileKeys = 32;
// Query vectors × head-dim class one block holds in its output accumulators (64 floats a thread).
constexpr int kPrefillAccFloats = 8192;
// Most query vectors (rows × heads of the GQA group) of one block.
constexpr int kPrefillMaxQueries = 64;
// The accumulator layout: thread t owns query vectors t / 16 + 8 i and dims t % 16 + 16 k.
constexpr int kPrefillQueryLanes = 8;
constexpr int kPrefillDimLanes = kPrefillThreads / kPrefillQueryLanes;

// The head_dim a kernel instance is compiled for (its registers are sized by it): 64, 128 or 256;
// 0 above 256.
KV_HD int PrefillHeadDimClass(int64_t head_dim) {
    if (head_dim <= 0 || head_dim > 256) return 0;
    return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}
// Query vectors a block of head-dim class `hd_class` holds: 64 at 64 and 128, 32 at 256.
KV_HD int PrefillQueriesPerBlock(int hd_class) {
    if (hd_class <= 0) return 0;
    const int q = kPrefillAccFloats / hd_class;
    return q < kPrefillMaxQueries ? q : kPrefillMaxQueries;
}
// Floats from one K or V row to the next in a tile (one more than head_dim: the 32 keys a warp
// scores fall in 32 banks), as the split-KV kernel's tiles (LoadTile reads both).
KV_HD int64_t PrefillTileRowFloats(int64_t head_dim) { return TileRowFloats(head_dim); }
// Floats from one query vector's probabilities to the next.
constexpr int kPrefillProbRowFloats = kPrefillTileKeys + 1;

// Dynamic shared memory of a prefill block: the block's queries (pre-scaled), a K tile and a V
// tile, the tile's probabilities, and per query vector its running max, sum and rescale factor.
KV_HD int64_t PrefillSharedBytes(int64_t head_dim) {
    const int64_t q = PrefillQueriesPerBlock(PrefillHeadDimClass(head_dim));
    return (q * head_dim + 2 * kPrefillTileKeys * PrefillTileRowFloats(head_dim) +
            q * kPrefillProbRowFloats + 3 * q) *
               static_cast<int64_t>(sizeof(float)) +
           2 * kPrefillTileKeys * static_cast<int64_t>(sizeof(int64_t));
}

// How a prefill chunk (a sequence with more than one new row) is cut into blocks: query tiles of
// rows_per_tile rows × heads_per_tile heads of one KV head's GQA group (head_passes tiles cover
// the group), each one block, over keys from its first row's window to its last row's position.
// A decode row (n_rows == 1) is the split-KV kernel's and has no prefill tile.
struct PrefillPlan {
    int group_size;
    int heads_per_tile;
    int head_passes;
    int64_t rows_per_tile;
};
KV_HD PrefillPlan PlanPrefill(int group_size, int queries_per_block) {
    PrefillPlan p;
    p.group_size = group_size;
    p.heads_per_tile = group_size < queries_per_block ? group_size : queries_per_block;
    p.head_passes = p.heads_per_tile > 0 ? (group_size + p.heads_per_tile - 1) / p.heads_per_tile : 0;
    p.rows_per_tile = p.heads_per_tile > 0 ? queries_per_block / p.heads_per_tile : 0;
    return p;
}
// Row tiles of a sequence with n_rows new rows (0 for a decode row).
KV_HD int64_t PrefillRowTiles(const PrefillPlan& p, int64_t n_rows) {
    return n_rows > 1 && p.rows_per_tile > 0 ? (n_rows + p.rows_per_tile - 1) / p.rows_per_tile : 0;
}

// One block's work: sequence `seq`, rows [r_begin, r_end), group heads [h_begin, h_end) of KV
// head kv_head, keys [k_begin, k_end) (causal bound of the last row; window of the first row).
struct PrefillTile {
    int64_t seq;
    int64_t kv_head;
    int64_t r_begin, r_end;
    int h_begin, h_end;
    int64_t k_begin, k_end;
};

// The tile of work item `w` of a step: items are numbered ((row tile) × head_passes + pass) ×
// num_kv_heads + kv_head over the step's row tiles in sequence order, each sequence's tiles last
// row first (the longest causal ranges start first). query_starts / context_lens are the batch's
// (PagedAttentionBatch); seq = -1 when w is past the step's items. Each block walks the
// sequences from the start: O(num_seqs) per item, small beside the tile's attention.
KV_HD PrefillTile PrefillTileOf(const PrefillPlan& p, int64_t w, int64_t num_seqs,
                                int64_t num_kv_heads, const int32_t* query_starts,
                                const int32_t* context_lens, int64_t window) {
    PrefillTile t{};
    t.seq = -1;
    if (p.head_passes <= 0 || num_kv_heads <= 0 || w < 0) return t;
    t.kv_head = w % num_kv_heads;
    const int64_t rest = w / num_kv_heads;
    const int pass = static_cast<int>(rest % p.head_passes);
    int64_t tile = rest / p.head_passes;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t n_rows = query_starts[s + 1] - query_starts[s];
        const int64_t tiles = PrefillRowTiles(p, n_rows);
        if (tile >= tiles) {
            tile -= tiles;
            continue;
        }
        const int64_t local = tiles - 1 - tile;
        const int64_t len = context_lens[s];
        t.seq = s;
        t.r_begin = local * p.rows_per_tile;
        t.r_end = t.r_begin + p.rows_per_tile < n_rows ? t.r_begin + p.rows_per_tile : n_rows;
        t.h_begin = pass * p.heads_per_tile;
        t.h_end = t.h_begin + p.heads_per_tile < p.group_size ? t.h_begin + p.heads_per_tile
                                                              : p.group_size;
        t.k_begin = WindowStart(len - n_rows + t.r_begin, window);
        t.k_end = len - n_rows + t.r_end;
        return t;
    }
    return t;
}

// Blocks of a prefill launch: a fixed grid (blocks_per_sm on every multiprocessor) that strides
// over the step's items, since the row counts of a step's sequences are in device memory.
constexpr int kPrefillBlocksPerSm = 2;  // the kernel's launch bound; shared memory fits two
KV_HD unsigned PrefillGrid(int sm_count, int blocks_per_sm) {
    const int64_t g = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) *
                      (blocks_per_sm > 0 ? blocks_per_sm : 1);
    return static_cast<unsigned>(g);
}

// Whether a step's attention launches the prefill kernel, from the most new rows of one
// sequence the host knows (PagedAttentionBatch::max_query_rows): not on a pure-decode step (1)
// or an empty one (0), whose blocks would find no tile; where the host does not know (-1), or a
// chunk is there (> 1), it does.
KV_HD bool LaunchesPrefillAttention(int64_t max_query_rows) {
    return max_query_rows < 0 || max_query_rows > 1;
}

// ---- the paged KV layout (kernels/paged_attention.h) ----

// Bytes from the pool's base to element `d` of (kv_head, position held at `slot_id`) of K
// (`v` false) or V, for elements of `elem_bytes`; slot_id = block * block_size + offset.
KV_HD int64_t KvElementOffset(int64_t block_stride, int64_t data_offset, int64_t block_size,
                              int64_t head_dim, int64_t elem_bytes, int64_t slot_id,
                              int64_t kv_head, int64_t d) {
    const int64_t block = slot_id / block_size;
    const int64_t slot = slot_id % block_size;
    return block * block_stride + data_offset + ((kv_head * block_size + slot) * head_dim + d) * elem_bytes;
}

// Bytes from the pool's base to the fp32 scale of (kv_head, slot_id) in the scales region at
// `scale_offset` of each block.
KV_HD int64_t KvScaleOffset(int64_t block_stride, int64_t scale_offset, int64_t block_size,
                            int64_t slot_id, int64_t kv_head) {
    const int64_t block = slot_id / block_size;
    const int64_t slot = slot_id % block_size;
    return block * block_stride + scale_offset + (kv_head * block_size + slot) * 4;
}

// Bytes of one stored K/V element of `storage` (KvDtypeBytes, usable in device code and constant
// expressions): the `elem_bytes` of KvElementOffset.
KV_HD constexpr int64_t KvElementBytes(KvDtype storage) {
    switch (storage) {
        case KvDtype::kFp32:
            return 4;
        case KvDtype::kFp16:
        case KvDtype::kBf16:
            return 2;
        case KvDtype::kFp8:
        case KvDtype::kInt8:
            return 1;
    }
    return 0;
}

// The slot id of position `pos` of a sequence whose blocks are `block_table`.
KV_HD int64_t SlotOfPosition(const int32_t* block_table, int64_t block_size, int64_t pos) {
    return static_cast<int64_t>(block_table[pos / block_size]) * block_size + pos % block_size;
}

// ---- the log-sum-exp merge of split partial results ----

// A split's partial result for one query head: the max score m, the sum l of exp(score - m) and
// the sums acc[d] of exp(score - m) · v[d]. An empty split has m = -inf, l = 0, acc = 0.
// out[d] = Σ_s acc_s[d] · exp(m_s - M) / Σ_s l_s · exp(m_s - M), M = max_s m_s; 0 when no split
// saw a key. partial(s) points at split s's record {m, l, acc[head_dim]}.
template <typename PartialAt>
KV_HD float MergedValue(int num_splits, PartialAt partial, int64_t d) {
    float m_max = -INFINITY;
    for (int s = 0; s < num_splits; ++s) m_max = fmaxf(m_max, partial(s)[0]);
    if (m_max == -INFINITY) return 0.0f;
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < num_splits; ++s) {
        const float* p = partial(s);
        if (p[0] == -INFINITY) continue;
        const float w = expf(p[0] - m_max);
        den += p[1] * w;
        num += p[2 + d] * w;
    }
    return den > 0.0f ? num / den : 0.0f;
}

// ---- 8-bit KV encodings: the arithmetic of kernels/kv_quant.cc ----

KV_HD float Fp8E4M3Decode(uint8_t v) {
    const int sign = v >> 7, exp = (v >> 3) & 0xF, man = v & 0x7;
    float mag;
    if (exp == 0xF && man == 0x7) {
        mag = NAN;
    } else if (exp == 0) {
        mag = ldexpf(static_cast<float>(man) / 8.0f, -6);
    } else {
        mag = ldexpf(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
    }
    return sign ? -mag : mag;
}

// Round-to-nearest-even, saturating at ±448; NaN → 0x7F (cpu::FloatToFp8E4M3).
KV_HD uint8_t Fp8E4M3Encode(float x) {
    if (isnan(x)) return 0x7F;
    const uint8_t sign = signbit(x) ? 0x80 : 0x00;
    const float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7E;
    int exp;
    frexpf(a, &exp);
    int e = exp - 1;
    if (e < -6) e = -6;
    const float step = ldexpf(1.0f, e - 3);
    const float q = rintf(a / step) * step;
    if (q >= 448.0f) return sign | 0x7E;
    if (q == 0.0f) return sign;
    int qexp;
    frexpf(q, &qexp);
    const int qe = qexp - 1;
    if (qe < -6) return sign | static_cast<uint8_t>(lroundf(q / ldexpf(1.0f, -9)));
    const int man = static_cast<int>(lroundf((q / ldexpf(1.0f, qe) - 1.0f) * 8.0f));
    return sign | static_cast<uint8_t>(((qe + 7) << 3) | man);
}

// One element of cpu::QuantizeInt8 given the head's inverse scale.
KV_HD int8_t Int8Encode(float x, float inv_scale) {
    return static_cast<int8_t>(lrintf(fminf(fmaxf(x * inv_scale, -127.0f), 127.0f)));
}

// ---- 16-bit KV encodings (no scale): the arithmetic of kernels/kv_quant.cc ----

KV_HD uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(x);
#else
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
#endif
}

KV_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
#endif
}

// bfloat16, rounded to nearest even; a NaN keeps its upper bits and is made quiet
// (common/dtype.h FloatToBF16, cpu::EncodeBf16).
KV_HD uint16_t Bf16Encode(float x) {
    const uint32_t b = FloatBits(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
    return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

KV_HD float Bf16Decode(uint16_t v) { return BitsFloat(static_cast<uint32_t>(v) << 16); }

// IEEE fp16, rounded to nearest even, overflowing to infinity; NaN stays NaN (common/dtype.h
// FloatToHalf, cpu::EncodeFp16).
KV_HD uint16_t Fp16Encode(float f) {
    const uint32_t bits = FloatBits(f);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t abs = bits & 0x7FFFFFFFu;
    if (abs >= 0x7F800000u) {
        return static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u));
    }
    if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520
    const int32_t exp = static_cast<int32_t>(abs >> 23) - 127 + 15;
    if (exp <= 0) {  // a subnormal fp16 (or zero): the mantissa with its implicit bit, shifted
        if (exp < -10) return sign;
        const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
        const int shift = 14 - exp;
        uint32_t half = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u);
        const uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
        return static_cast<uint16_t>(sign | half);
    }
    uint32_t half = (static_cast<uint32_t>(exp) << 10) | ((abs >> 13) & 0x3FFu);
    const uint32_t rem = abs & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // may carry into the exponent
    return static_cast<uint16_t>(sign | half);
}

// Exact: normals re-biased, subnormals mant · 2^-24 (a normal fp32, so no denormal arithmetic),
// infinities and NaNs with their payload (common/dtype.h HalfToFloat).
KV_HD float Fp16Decode(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    const uint32_t mant = h & 0x3FFu;
    if (exp == 0x1Fu) return BitsFloat(sign | 0x7F800000u | (mant << 13));
    if (exp == 0u) return BitsFloat(FloatBits(static_cast<float>(mant) * 0x1p-24f) | sign);
    return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// ---- elementwise launch shapes ----

// Blocks of `threads` covering n elements, capped at `max_blocks` (grid-stride loops do the rest).
KV_HD unsigned GridFor(int64_t n, int threads, int64_t max_blocks = 65535 * 4) {
    int64_t blocks = (n + threads - 1) / threads;
    if (blocks < 1) blocks = 1;
    if (blocks > max_blocks) blocks = max_blocks;
    return static_cast<unsigned>(blocks);
}

}  // namespace kvshard::cuda
