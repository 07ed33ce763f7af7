// PagedAttentionBatched: the attention of a whole step over a paged pool, FlashAttention-2 style.
//
// Work is cut into tiles: (sequence, KV head, up to kMaxLanes query "lanes"), a lane being one
// (query row, query head) pair of the KV head's GQA group, lane = row_in_tile * group +
// head_in_group. A tile walks its KV positions kChunk at a time (several blocks when blocks are
// small, part of one when they are large), so each K/V row is read, and dequantized, once per tile
// instead of once per query head and row as in cpu::PagedAttention; scores and the weighted sum of
// V are register-blocked products over the chunk, with an online softmax (running max and sum per
// lane) between.
//
// Two inner kernels:
//   wide   (more than kNarrowLanes lanes: prefill): Q is held transposed, [head_dim][lane], so
//          both products vectorize over lanes and read K and V rows as broadcast scalars in the
//          pool's own [slot][head_dim] layout; K needs no transpose.
//   narrow (decode, short chunks): per lane dot products over head_dim, 16 K rows at a time with
//          one shuffle tree for their 16 sums, on K/V rows that stay in L1 across the group.
// A long KV walk of a step with few tiles (decode of a few sequences) is split in KV ranges
// (flash-decoding) so every thread has work; the partial results are merged after the walk.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/check.h"
#include "kernels/paged_attention.h"
#include "kernels/paged_attention_rows.h"
#include "kernels/paged_attention_tiles.h"
#include "kernels/vec_math.h"

// Vec never crosses a translation unit (every function taking one is file-local), so GCC's note
// that its calling convention depends on AVX-512 being enabled does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace kvshard::cpu {
namespace {

using paged_attention::kChunk;
using paged_attention::kMaxLanes;
using paged_attention::kVecLanes;
using paged_attention::PlanTiles;
using paged_attention::Problem;
using paged_attention::Tile;

// 16 floats through the GCC/Clang vector extension: one AVX-512 register with -march=native on the
// machines we serve on, two AVX2 registers elsewhere; one code path for every target.
typedef float Vec __attribute__((vector_size(64)));
// At or below this many lanes the wide kernel would waste most of each vector.
constexpr int64_t kNarrowLanes = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline Vec Load(const float* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void Store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// s[n][lane] = scale · Σ_d krows[n][d] · qt[d][lane] for n < num_n and the first kVecLanes · V
// lanes; rows of qt and s are kMaxLanes floats apart. Four K rows at a time: 4 × V accumulators,
// each Q vector loaded once per four rows, each K element broadcast once per V vectors.
template <int V>
void ScoresWide(const float* qt, const float* const* krows, int64_t num_n, int64_t head_dim,
                float scale, float* s) {
    int64_t n = 0;
    for (; n + 4 <= num_n; n += 4) {
        const float* k0 = krows[n];
        const float* k1 = krows[n + 1];
        const float* k2 = krows[n + 2];
        const float* k3 = krows[n + 3];
        Vec acc[4][V] = {};
        for (int64_t d = 0; d < head_dim; ++d) {
            const float* qd = qt + d * kMaxLanes;
#pragma GCC unroll 4
            for (int j = 0; j < V; ++j) {
                const Vec q = Load(qd + j * kVecLanes);
                acc[0][j] += k0[d] * q;
                acc[1][j] += k1[d] * q;
                acc[2][j] += k2[d] * q;
                acc[3][j] += k3[d] * q;
            }
        }
        for (int r = 0; r < 4; ++r) {
            for (int j = 0; j < V; ++j)
                Store(s + (n + r) * kMaxLanes + j * kVecLanes, acc[r][j] * scale);
        }
    }
    for (; n < num_n; ++n) {
        const float* k0 = krows[n];
        Vec acc[V] = {};
        for (int64_t d = 0; d < head_dim; ++d) {
            const float* qd = qt + d * kMaxLanes;
            for (int j = 0; j < V; ++j) acc[j] += k0[d] * Load(qd + j * kVecLanes);
        }
        for (int j = 0; j < V; ++j) Store(s + n * kMaxLanes + j * kVecLanes, acc[j] * scale);
    }
}

// ot[d][lane] = ot[d][lane] · alpha[lane] + Σ_n vrows[n][d] · p[n][lane]: four dims at a time,
// their 4 × V accumulators held over the whole chunk.
template <int V>
void AccumulateWide(const float* p, const float* const* vrows, int64_t num_n, int64_t head_dim,
                    const float* alpha, float* ot) {
    Vec a[V];
    for (int j = 0; j < V; ++j) a[j] = Load(alpha + j * kVecLanes);
    int64_t d = 0;
    for (; d + 4 <= head_dim; d += 4) {
        Vec acc[4][V];
        for (int r = 0; r < 4; ++r) {
            for (int j = 0; j < V; ++j)
                acc[r][j] = Load(ot + (d + r) * kMaxLanes + j * kVecLanes) * a[j];
        }
        for (int64_t n = 0; n < num_n; ++n) {
            const float* vn = vrows[n] + d;
            const float* pn = p + n * kMaxLanes;
#pragma GCC unroll 4
            for (int j = 0; j < V; ++j) {
                const Vec pv = Load(pn + j * kVecLanes);
                acc[0][j] += vn[0] * pv;
                acc[1][j] += vn[1] * pv;
                acc[2][j] += vn[2] * pv;
                acc[3][j] += vn[3] * pv;
            }
        }
        for (int r = 0; r < 4; ++r) {
            for (int j = 0; j < V; ++j) Store(ot + (d + r) * kMaxLanes + j * kVecLanes, acc[r][j]);
        }
    }
    for (; d < head_dim; ++d) {
        Vec acc[V];
        for (int j = 0; j < V; ++j) acc[j] = Load(ot + d * kMaxLanes + j * kVecLanes) * a[j];
        for (int64_t n = 0; n < num_n; ++n) {
            for (int j = 0; j < V; ++j)
                acc[j] += vrows[n][d] * Load(p + n * kMaxLanes + j * kVecLanes);
        }
        for (int j = 0; j < V; ++j) Store(ot + d * kMaxLanes + j * kVecLanes, acc[j]);
    }
}

// Per-thread buffers, kept by each thread from call to call (thread_local) and grown for a larger
// head_dim: a decode step calls the kernel once per layer, and allocating (and zero-filling) ~80 KB
// per thread per call cost more than the attention of a short context. Every kernel writes what
// it reads of them first.
struct Scratch {
    void Reserve(int64_t head_dim) {
        const auto lanes = static_cast<size_t>(head_dim * kMaxLanes);
        if (qt.size() >= lanes) return;
        qt.resize(lanes);
        o.resize(lanes);
        s.resize(static_cast<size_t>(kChunk * kMaxLanes));
        kbuf.resize(static_cast<size_t>(kChunk * head_dim));
        vbuf.resize(static_cast<size_t>(kChunk * head_dim));
        krows.resize(kChunk);
        vrows.resize(kChunk);
    }
    std::vector<float> qt;  // wide: Q^T [head_dim][kMaxLanes]; narrow: unused
    std::vector<float> o;   // wide: O^T [head_dim][kMaxLanes]; narrow: O [lane][head_dim]
    std::vector<float> s;   // wide: [kChunk][kMaxLanes]; narrow: [kChunk]
    std::vector<float> kbuf, vbuf;
    std::vector<const float*> krows, vrows;
    float m[kMaxLanes], l[kMaxLanes], alpha[kMaxLanes], cmax[kMaxLanes];
    int32_t pos[kMaxLanes];
    const float* qrow[kMaxLanes];
    float* orow[kMaxLanes];
};

// Lanes of a tile: their query rows, output rows and positions; returns the lane count.
int64_t SetUpLanes(const Problem& p, const Tile& t, Scratch& sc) {
    const int64_t hd = p.kv.head_dim;
    const int64_t group = t.head_end - t.head_begin;
    const int64_t pos_offset =
        int64_t{p.batch.context_lens[t.seq]} - p.batch.query_starts[t.seq + 1];
    int64_t lane = 0;
    for (int64_t r = t.row_begin; r < t.row_end; ++r) {
        for (int64_t j = 0; j < group; ++j, ++lane) {
            const int64_t h =
                p.heads[static_cast<size_t>(p.group_starts[t.kv_head] + t.head_begin + j)];
            sc.qrow[lane] = p.q + r * p.q_stride + h * hd;
            sc.orow[lane] = p.out + (r * p.num_heads + h) * hd;
            sc.pos[lane] = static_cast<int32_t>(pos_offset + r);
        }
    }
    return lane;
}

template <int V>
void RunWide(const Problem& p, const Tile& t, int64_t num_lanes, Scratch& sc) {
    const int64_t hd = p.kv.head_dim;
    const int64_t lanes = V * kVecLanes;
    const int32_t* table = p.batch.block_tables + p.batch.block_table_starts[t.seq];
    const int32_t first_pos = sc.pos[0];
    const int64_t window = p.batch.window;
    // Padding lanes get zero queries and the last position, so they never see a fully masked row.
    for (int64_t lane = num_lanes; lane < lanes; ++lane) sc.pos[lane] = sc.pos[num_lanes - 1];
    float* qt = sc.qt.data();
    float* ot = sc.o.data();
    for (int64_t d = 0; d < hd; ++d) {
        for (int64_t lane = 0; lane < lanes; ++lane) {
            qt[d * kMaxLanes + lane] = lane < num_lanes ? sc.qrow[lane][d] : 0.0f;
            ot[d * kMaxLanes + lane] = 0.0f;
        }
    }
    std::fill(sc.m, sc.m + lanes, kNegInf);
    std::fill(sc.l, sc.l + lanes, 0.0f);
    float* s = sc.s.data();
    for (int64_t p0 = t.kv_begin; p0 < t.kv_end; p0 += kChunk) {
        const int64_t n = std::min(kChunk, t.kv_end - p0);
        GatherPagedRows(p.kv, table, t.kv_head, p0, n, sc.kbuf.data(), sc.vbuf.data(),
                        sc.krows.data(), sc.vrows.data());
        ScoresWide<V>(qt, sc.krows.data(), n, hd, p.scale, s);
        // Causal masking only where the chunk reaches past the tile's first row; a window masks
        // the positions before each lane's window as well.
        const bool masked = p0 + n - 1 > first_pos;
        if (window > 0) {
            for (int64_t i = 0; i < n; ++i) {
                const int32_t pos = static_cast<int32_t>(p0 + i);
#pragma omp simd
                for (int64_t lane = 0; lane < lanes; ++lane) {
                    if (pos > sc.pos[lane] || pos <= sc.pos[lane] - window) {
                        s[i * kMaxLanes + lane] = kNegInf;
                    }
                }
            }
        } else if (masked) {
            for (int64_t i = 0; i < n; ++i) {
                const int32_t pos = static_cast<int32_t>(p0 + i);
#pragma omp simd
                for (int64_t lane = 0; lane < lanes; ++lane) {
                    if (pos > sc.pos[lane]) s[i * kMaxLanes + lane] = kNegInf;
                }
            }
        }
        std::fill(sc.cmax, sc.cmax + lanes, kNegInf);
        for (int64_t i = 0; i < n; ++i) {
#pragma omp simd
            for (int64_t lane = 0; lane < lanes; ++lane) {
                sc.cmax[lane] = std::max(sc.cmax[lane], s[i * kMaxLanes + lane]);
            }
        }
        // Without a window every lane sees position kv_begin (<= its own), so m is finite after
        // the first chunk and a lane fully masked in a later chunk keeps its max. With one, a lane
        // may see nothing yet (m stays -inf; its sum and output stay 0, so alpha does not matter).
#pragma omp simd
        for (int64_t lane = 0; lane < lanes; ++lane) {
            const float m_new = std::max(sc.m[lane], sc.cmax[lane]);
            sc.alpha[lane] = m_new == kNegInf ? 1.0f : ExpFast(sc.m[lane] - m_new);
            sc.m[lane] = m_new;
            sc.l[lane] *= sc.alpha[lane];
        }
        for (int64_t i = 0; i < n; ++i) {
            float* si = s + i * kMaxLanes;
#pragma omp simd
            for (int64_t lane = 0; lane < lanes; ++lane) {
                // ExpFast saturates instead of reaching 0, so masked weights are zeroed by hand.
                const float w = si[lane] == kNegInf ? 0.0f : ExpFast(si[lane] - sc.m[lane]);
                si[lane] = w;
                sc.l[lane] += w;
            }
        }
        AccumulateWide<V>(s, sc.vrows.data(), n, hd, sc.alpha, ot);
    }
    // Lane-major O for the finish, in the narrow layout ([lane][head_dim]) shared with it.
    for (int64_t lane = 0; lane < num_lanes; ++lane) {
        for (int64_t d = 0; d < hd; ++d) sc.qt[lane * hd + d] = ot[d * kMaxLanes + lane];
    }
    std::swap(sc.qt, sc.o);
}

// Σ of each of 16 vectors, as the lanes of one: four levels of shuffles and adds, each halving the
// vectors while folding their halves, instead of 16 horizontal reductions. The tree leaves lane k
// holding the input at bit-reversed index k, so inputs are taken in that order.
inline Vec SumEach16(const Vec* acc) {
    static constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    Vec a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) {
        const Vec x = acc[kBitReversed[2 * i]], y = acc[kBitReversed[2 * i + 1]];
        a[i] =
            __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                    31);
    }
    for (int i = 0; i < 4; ++i) {
        const Vec x = a[2 * i], y = a[2 * i + 1];
        b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                                       27) +
               __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                       31);
    }
    for (int i = 0; i < 2; ++i) {
        const Vec x = b[2 * i], y = b[2 * i + 1];
        c[i] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                       29) +
               __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                       31);
    }
    return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                   14, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                   15, 31);
}

// s[n] = scale · q · krows[n] for n < num_n, 16 rows at a time (head_dim a multiple of 16); s has
// room for num_n rounded up to 16, and rows past num_n read `zeros`.
void ScoresNarrow(const float* q, const float* const* krows, int64_t num_n, int64_t head_dim,
                  float scale, const float* zeros, float* s) {
    for (int64_t n0 = 0; n0 < num_n; n0 += kVecLanes) {
        const float* k[kVecLanes];
        for (int64_t r = 0; r < kVecLanes; ++r) k[r] = n0 + r < num_n ? krows[n0 + r] : zeros;
        Vec acc[kVecLanes] = {};
        for (int64_t d = 0; d < head_dim; d += kVecLanes) {
            const Vec qv = Load(q + d);
            for (int64_t r = 0; r < kVecLanes; ++r) acc[r] += qv * Load(k[r] + d);
        }
        Store(s + n0, SumEach16(acc) * scale);
    }
}

// o = o · alpha + Σ_{n < len} p[n] · vrows[n] (head_dim a multiple of 16), 64 dims at a time held
// in registers over the rows.
void AccumulateNarrow(const float* p, const float* const* vrows, int64_t len, int64_t head_dim,
                      float alpha, float* o) {
    int64_t d = 0;
    for (; d + 4 * kVecLanes <= head_dim; d += 4 * kVecLanes) {
        Vec acc[4];
        for (int j = 0; j < 4; ++j) acc[j] = Load(o + d + j * kVecLanes) * alpha;
        for (int64_t n = 0; n < len; ++n) {
            const float* v = vrows[n] + d;
            for (int j = 0; j < 4; ++j) acc[j] += p[n] * Load(v + j * kVecLanes);
        }
        for (int j = 0; j < 4; ++j) Store(o + d + j * kVecLanes, acc[j]);
    }
    for (; d < head_dim; d += kVecLanes) {
        Vec acc = Load(o + d) * alpha;
        for (int64_t n = 0; n < len; ++n) acc += p[n] * Load(vrows[n] + d);
        Store(o + d, acc);
    }
}

void RunNarrow(const Problem& p, const Tile& t, int64_t num_lanes, Scratch& sc) {
    const int64_t hd = p.kv.head_dim;
    const bool vectors = hd % kVecLanes == 0;
    const int32_t* table = p.batch.block_tables + p.batch.block_table_starts[t.seq];
    float* o = sc.o.data();
    std::fill(o, o + num_lanes * hd, 0.0f);
    std::fill(sc.m, sc.m + num_lanes, kNegInf);
    std::fill(sc.l, sc.l + num_lanes, 0.0f);
    std::fill(sc.qt.begin(), sc.qt.begin() + hd,
              0.0f);  // the zero row for ScoresNarrow
    float* s = sc.s.data();
    // A narrow tile (decode) reads each of its K/V rows once, most of them from DRAM: their lines
    // are requested kPrefetchChunks chunks ahead of the walk (the first ones before it starts), so
    // many misses are in flight at once instead of the few the walk's own loads would have
    // (-17% attention time at batch-1 decode, context ~160), without running farther ahead than
    // the L2 holds.
    constexpr int64_t kPrefetchChunks = 4;
    PrefetchPagedRows(p.kv, table, t.kv_head, t.kv_begin,
                      std::min<int64_t>(t.kv_end, t.kv_begin + kPrefetchChunks * kChunk));
    for (int64_t p0 = t.kv_begin; p0 < t.kv_end; p0 += kChunk) {
        const int64_t n = std::min(kChunk, t.kv_end - p0);
        const int64_t ahead = p0 + kPrefetchChunks * kChunk;
        if (ahead < t.kv_end) {
            PrefetchPagedRows(p.kv, table, t.kv_head, ahead,
                              std::min<int64_t>(t.kv_end, ahead + kChunk));
        }
        GatherPagedRows(p.kv, table, t.kv_head, p0, n, sc.kbuf.data(), sc.vbuf.data(),
                        sc.krows.data(), sc.vrows.data());
        for (int64_t lane = 0; lane < num_lanes; ++lane) {
            // Positions [p0 + lo, p0 + hi) of the chunk: causal, and inside the window if any.
            const int64_t hi = std::min(n, sc.pos[lane] - p0 + 1);
            const int64_t lo =
                p.batch.window > 0 ? std::max<int64_t>(0, sc.pos[lane] - p.batch.window + 1 - p0)
                                   : 0;
            const int64_t len = hi - lo;
            if (len <= 0) continue;
            const float* const* krows = sc.krows.data() + lo;
            const float* const* vrows = sc.vrows.data() + lo;
            const float* qv = sc.qrow[lane];
            if (vectors) {
                ScoresNarrow(qv, krows, len, hd, p.scale, sc.qt.data(), s);
            } else {
                for (int64_t i = 0; i < len; ++i) s[i] = Dot(qv, krows[i], hd) * p.scale;
            }
            float cmax = kNegInf;
            for (int64_t i = 0; i < len; ++i) cmax = std::max(cmax, s[i]);
            const float m_new = std::max(sc.m[lane], cmax);
            const float alpha = ExpFast(sc.m[lane] - m_new);
            sc.m[lane] = m_new;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < len; ++i) {
                s[i] = ExpFast(s[i] - m_new);
                sum += s[i];
            }
            sc.l[lane] = sc.l[lane] * alpha + sum;
            float* ol = o + lane * hd;
            if (vectors) {
                AccumulateNarrow(s, vrows, len, hd, alpha, ol);
            } else {
#pragma omp simd
                for (int64_t d = 0; d < hd; ++d) ol[d] *= alpha;
                for (int64_t i = 0; i < len; ++i) Axpy(s[i], vrows[i], ol, hd);
            }
        }
    }
}

// Runs one tile, then writes its lanes normalized to out, or unnormalized with their max and sum to
// its partial result (lanes × (head_dim + 2) floats) for the merge.
void RunTile(const Problem& p, const Tile& t, Scratch& sc, float* partials) {
    const int64_t num_lanes = SetUpLanes(p, t, sc);
    if (num_lanes <= kNarrowLanes) {
        RunNarrow(p, t, num_lanes, sc);
    } else {
        switch ((num_lanes + kVecLanes - 1) / kVecLanes) {
            case 1:
                RunWide<1>(p, t, num_lanes, sc);
                break;
            case 2:
                RunWide<2>(p, t, num_lanes, sc);
                break;
            case 3:
                RunWide<3>(p, t, num_lanes, sc);
                break;
            default:
                RunWide<4>(p, t, num_lanes, sc);
                break;
        }
    }
    const int64_t hd = p.kv.head_dim;
    const float* o = sc.o.data();
    if (t.partial < 0) {
        for (int64_t lane = 0; lane < num_lanes; ++lane) {
            const float inv = 1.0f / sc.l[lane];
#pragma omp simd
            for (int64_t d = 0; d < hd; ++d) sc.orow[lane][d] = o[lane * hd + d] * inv;
        }
        return;
    }
    float* dst = partials + t.partial * kMaxLanes * (hd + 2);
    for (int64_t lane = 0; lane < num_lanes; ++lane) {
        float* pl = dst + lane * (hd + 2);
        std::copy(o + lane * hd, o + (lane + 1) * hd, pl);
        pl[hd] = sc.m[lane];
        pl[hd + 1] = sc.l[lane];
    }
}

// Merges the partial results of the splits of tile t (the first split) into out.
void MergeSplits(const Problem& p, const Tile& t, Scratch& sc, const float* partials) {
    const int64_t hd = p.kv.head_dim;
    const int64_t num_lanes = SetUpLanes(p, t, sc);
    const int64_t lane_stride = hd + 2;
    const int64_t split_stride = kMaxLanes * lane_stride;
    const float* first = partials + t.partial * split_stride;
    for (int64_t lane = 0; lane < num_lanes; ++lane) {
        float m = kNegInf;
        for (int64_t k = 0; k < t.num_splits; ++k) {
            m = std::max(m, first[k * split_stride + lane * lane_stride + hd]);
        }
        float* o = sc.orow[lane];
        std::fill(o, o + hd, 0.0f);
        float l = 0.0f;
        for (int64_t k = 0; k < t.num_splits; ++k) {
            const float* pl = first + k * split_stride + lane * lane_stride;
            // A split wholly before a lane's window saw nothing of it (max -inf, sum 0).
            const float w = pl[hd] == kNegInf ? 0.0f : ExpFast(pl[hd] - m);
            l += w * pl[hd + 1];
            Axpy(w, pl, o, hd);
        }
        const float inv = 1.0f / l;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
    }
}

}  // namespace

void PagedAttentionBatched(const float* q, int64_t q_stride, const PagedKvLayer& kv,
                           const PagedAttentionBatch& batch, float* out, int64_t num_heads,
                           const int32_t* kv_head_of_q) {
    const int64_t num_kv_heads = kv.num_kv_heads;
    const int64_t hd = kv.head_dim;
    KV_CHECK_GE(q_stride, num_heads * hd);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    Problem p{q, q_stride, kv, batch, out, num_heads, scale, {}, {}};
    // Query heads grouped by the KV head they read.
    p.group_starts.assign(static_cast<size_t>(num_kv_heads + 1), 0);
    if (kv_head_of_q == nullptr) {
        KV_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0)
            << "num_heads=" << num_heads << " num_kv_heads=" << num_kv_heads;
        const int64_t group = num_heads / num_kv_heads;
        for (int64_t g = 0; g <= num_kv_heads; ++g) {
            p.group_starts[g] = static_cast<int32_t>(g * group);
        }
        for (int64_t h = 0; h < num_heads; ++h) p.heads.push_back(static_cast<int32_t>(h));
    } else {
        for (int64_t h = 0; h < num_heads; ++h) {
            KV_CHECK(kv_head_of_q[h] >= 0 && kv_head_of_q[h] < num_kv_heads)
                << "query head " << h << " maps to KV head " << kv_head_of_q[h] << " of "
                << num_kv_heads;
            ++p.group_starts[kv_head_of_q[h] + 1];
        }
        for (int64_t g = 0; g < num_kv_heads; ++g) p.group_starts[g + 1] += p.group_starts[g];
        p.heads.resize(static_cast<size_t>(num_heads));
        std::vector<int32_t> fill(p.group_starts.begin(), p.group_starts.end() - 1);
        for (int64_t h = 0; h < num_heads; ++h) {
            p.heads[fill[kv_head_of_q[h]]++] = static_cast<int32_t>(h);
        }
    }
    KV_CHECK_EQ(batch.query_starts[0], 0);
    for (int64_t s = 0; s < batch.num_seqs; ++s) {
        const int64_t rows = batch.query_starts[s + 1] - batch.query_starts[s];
        const int64_t blocks = batch.block_table_starts[s + 1] - batch.block_table_starts[s];
        KV_CHECK(rows >= 0 && rows <= batch.context_lens[s])
            << "sequence " << s << ": " << rows << " rows, context " << batch.context_lens[s];
        KV_CHECK_LE(batch.context_lens[s], blocks * kv.block_size) << "sequence " << s;
    }

    const int threads = omp_get_max_threads();
    // The plan and the splits' partial results, reused by the calling thread from call to call.
    thread_local std::vector<Tile> tiles;
    thread_local std::vector<float> partials;
    tiles.clear();
    const int64_t num_partials = PlanTiles(p, threads, tiles);
    const auto partial_floats = static_cast<size_t>(num_partials * kMaxLanes * (hd + 2));
    if (partials.size() < partial_floats) partials.resize(partial_floats);
    int64_t work = 0;
    for (const Tile& t : tiles) work += t.cost;
    // About 20 µs of work on one core; below that the OpenMP fork/join costs more than it saves.
    const bool parallel = tiles.size() > 1 && work * hd >= (1 << 16);
    const int64_t num_tiles = static_cast<int64_t>(tiles.size());
    // The calling thread's: inside the region a thread_local name would be each thread's own.
    const Tile* const plan = tiles.data();
    float* const partial_data = partials.data();
#pragma omp parallel if (parallel)
    {
        thread_local Scratch sc;
        sc.Reserve(hd);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tiles; ++i) RunTile(p, plan[i], sc, partial_data);
        if (num_partials > 0) {
            // nowait: the end of the parallel region is the barrier.
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t i = 0; i < num_tiles; ++i) {
                const Tile& t = plan[i];
                // The first split merges the tile it was split from.
                if (t.num_splits > 1 && t.split == 0) {
                    MergeSplits(p, t, sc, partial_data);
                }
            }
        }
    }
}

}  // namespace kvshard::cpu
