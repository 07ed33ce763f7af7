// The index math of the tensor-core prefill attention kernel (kernels/cuda/prefill_attention_tc.cu)
// as __host__ __device__ functions: which lane holds which (row, col) of an mma.sync m16n8k16
// fragment, how a score fragment becomes the A fragment of the P·V product, which key tiles a
// warp's queries see, the shared-memory layout, the ldmatrix addresses, the asynchronous copy's
// chunks, and each lane's online-softmax step. The kernel
// calls them on the device; tests/kernels/cuda_prefill_tc_math_test.cc runs a scalar emulation of
// the kernel's tile loop built from them on the CPU against the CPU attention, and
// tests/kernels/cuda_prefill_tc_ldsm_test.cc emulates ldmatrix over the shared tiles at the
// addresses given here. A plain header: no CUDA includes.
//
// The tiling is FlashAttention-2's (Dao, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", 2023, §3): a block owns a tile of queries, each warp 16 of
// them (no split of K across warps, so no cross-warp reduction), K/V tiles stream through shared
// memory, and the rescale by the running max happens once per key tile in registers.
#pragma once

#include <cstdint>

#include "kernels/cuda/launch_math.h"

// Fully unrolled on the device, so the fragment arrays stay in registers.
#if defined(__CUDACC__)
#define KV_TC_UNROLL _Pragma("unroll")
#else
#define KV_TC_UNROLL
#endif

namespace kvshard::cuda {

// ---- the block ----

constexpr int kTcThreads = 128;
constexpr int kTcLanes = 32;
constexpr int kTcWarps = kTcThreads / kTcLanes;
// mma.sync.aligned.m16n8k16: A is 16×16 (row-major), B 16×8 (column-major), C/D 16×8 fp32.
constexpr int kMmaM = 16, kMmaN = 8, kMmaK = 16;
// Query vectors (rows × heads of a GQA group) of a block: 16 a warp.
constexpr int kTcQueries = kTcWarps * kMmaM;
// Keys of one K/V tile: eight n8 score fragments a warp.
constexpr int kTcTileKeys = 64;
constexpr int kTcScoreTiles = kTcTileKeys / kMmaN;
// Padding of a shared-memory row in bf16 elements: rows 16 bytes longer than a multiple of 128
// put the 8 rows × 4 words one fragment load touches in 32 distinct banks.
constexpr int kTcRowPad = 8;

// Whether the tensor-core kernel is compiled for a head_dim (its registers are sized by it).
KV_HD bool TcHeadDimSupported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }
// bf16 elements from one Q, K or V row to the next in shared memory (V is stored key-major like
// K; the P·V product's B fragments come out of it transposed by ldmatrix.trans).
KV_HD int TcRowHalves(int64_t head_dim) { return static_cast<int>(head_dim) + kTcRowPad; }
// bf16 elements of one K or V tile (kTcTileKeys rows) in shared memory.
KV_HD int TcTileHalves(int64_t head_dim) { return kTcTileKeys * TcRowHalves(head_dim); }
// The tiles' shared memory, in bf16 elements from its start: two stages of a K and a V tile (the
// next key tile is copied into one while the warps compute on the other), K then V, stage 0 then
// 1. The Q tile (kTcQueries rows) overlaps stage 1's K tile: the warps hold Q in registers before
// stage 1 is first written.
KV_HD int TcKTileAt(int stage, int64_t head_dim) { return 2 * stage * TcTileHalves(head_dim); }
KV_HD int TcVTileAt(int stage, int64_t head_dim) { return (2 * stage + 1) * TcTileHalves(head_dim); }
KV_HD int TcQTileAt(int64_t head_dim) { return TcKTileAt(1, head_dim); }
static_assert(kTcQueries <= kTcTileKeys, "the Q tile fits in a K tile's place");
// Dynamic shared memory of a block: the tile's kTcTileKeys slot offsets and scale offsets (the
// synchronous load's), then the four tiles (TcKTileAt).
KV_HD int64_t TcSharedBytes(int64_t head_dim) {
    return 2 * kTcTileKeys * static_cast<int64_t>(sizeof(int64_t)) +
           4 * static_cast<int64_t>(TcTileHalves(head_dim)) * 2;
}

// ---- mma.sync m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16") ----
// Lane l is in group g = l / 4 at position t = l % 4. A fragment element e of a lane lives in
// 32-bit register e / 2 (low half for even e).

struct FragCoord {
    int row, col;
};
// A (16×16, bf16): 8 elements a lane.
KV_HD FragCoord MmaAElement(int lane, int e) {
    const int g = lane >> 2, t = lane & 3;
    return {g + 8 * ((e >> 1) & 1), 2 * t + (e & 1) + 8 * (e >> 2)};
}
// B (16×8, bf16): 4 elements a lane; row is k, col is n.
KV_HD FragCoord MmaBElement(int lane, int e) {
    const int g = lane >> 2, t = lane & 3;
    return {2 * t + (e & 1) + 8 * (e >> 1), g};
}
// C/D (16×8, fp32): 4 elements a lane.
KV_HD FragCoord MmaCElement(int lane, int e) {
    const int g = lane >> 2, t = lane & 3;
    return {g + 8 * (e >> 1), 2 * t + (e & 1)};
}
// The P·V product's A fragment of k-step kk (keys 16 kk .. 16 kk + 15 of the tile) is the score
// fragments 2 kk and 2 kk + 1 already in the lane's registers: its element e is element
// TcPElementOf(e) of score fragment TcPTileOf(kk, e) (same row, same key).
KV_HD int TcPTileOf(int kk, int e) { return 2 * kk + (e >> 2); }
KV_HD int TcPElementOf(int e) { return e & 3; }

// ---- the key-tile walk ----

// The positions of the rows warp `warp`'s query vectors (16 warp .. 16 warp + 15 of a tile of
// `nq` vectors, `nh` heads a row, its first row at position pos0) belong to; empty when the warp
// has no query vector.
struct TcWarpSpan {
    bool empty;
    int64_t first_pos, last_pos;
};
KV_HD TcWarpSpan TcWarpPositions(int warp, int nq, int nh, int64_t pos0) {
    const int first = warp * kMmaM;
    if (first >= nq || nh <= 0) return {true, 0, -1};
    const int last = first + kMmaM - 1 < nq - 1 ? first + kMmaM - 1 : nq - 1;
    return {false, pos0 + first / nh, pos0 + last / nh};
}
// What a warp does with keys [t0, t0 + nt): kTcSkip when none is visible to any of its rows,
// kTcAllVisible when every key is visible to every row (no per-element mask), else kTcMasked.
enum class TcTileMask { kSkip, kAllVisible, kMasked };
KV_HD TcTileMask TcKeyTileMask(int64_t t0, int nt, const TcWarpSpan& w, int64_t window) {
    if (w.empty || nt <= 0) return TcTileMask::kSkip;
    const int64_t last_key = t0 + nt - 1;
    // The last row sees the latest keys, the first row's window starts earliest.
    if (t0 > w.last_pos || last_key < WindowStart(w.first_pos, window)) return TcTileMask::kSkip;
    if (nt == kTcTileKeys && last_key <= w.first_pos && t0 >= WindowStart(w.last_pos, window)) {
        return TcTileMask::kAllVisible;
    }
    return TcTileMask::kMasked;
}
// A tile load's unit: chunk c of a K/V tile is 2 elements, key c / (head_dim / 2) of the tile,
// dims 2 (c % (head_dim / 2)) and one more.
KV_HD int TcChunkKey(int c, int head_dim) { return c / (head_dim / 2); }
KV_HD int TcChunkDim(int c, int head_dim) { return 2 * (c % (head_dim / 2)); }
// The asynchronous copy's unit (cp.async of 16 bytes, bf16 pools): chunk c of a K/V tile is 8
// elements, key c / (head_dim / 8) of the tile, dims 8 (c % (head_dim / 8)) .. + 7.
KV_HD int TcCopyChunkKey(int c, int head_dim) { return c / (head_dim / 8); }
KV_HD int TcCopyChunkDim(int c, int head_dim) { return 8 * (c % (head_dim / 8)); }

// ---- ldmatrix.x4 (PTX ISA, "Warp-level matrix load instruction: ldmatrix") ----
// One ldmatrix.sync.aligned.m8n8.x4 loads four 8×8 b16 matrices: lane l gives the shared address
// of row l % 8 of matrix l / 8 (16 contiguous bytes), and receives in register i row l / 4,
// columns 2 (l % 4) and one more, of matrix i (with .trans: column l / 4, rows 2 (l % 4) and one
// more). These give each lane's address as (row, col) from a 16×16 (or 8×32) corner.
// A 16×16 tile, matrix i at rows 8 (i % 2), cols 8 (i / 2): registers 0..3 are an A fragment (Q
// rows × 16 dims); with .trans over V (16 keys × 16 dims) they are the B fragments of two n8
// tiles of dims (registers 0, 1 the first's, 2, 3 the second's).
KV_HD FragCoord TcLdsmTile16(int lane) { return {(lane & 7) + 8 * ((lane >> 3) & 1), 8 * (lane >> 4)}; }
// An 8×32 strip, matrix i at cols 8 i: over K (8 keys × 32 dims) the B fragments of two k-steps of
// one n8 score tile (registers 0, 1 the first's, 2, 3 the second's).
KV_HD FragCoord TcLdsmStrip8(int lane) { return {lane & 7, 8 * (lane >> 3)}; }

// ---- a lane's online softmax over one key tile ----
// A lane holds two query rows of its warp (MmaCElement rows g and g + 8: index r = e / 2) of the
// tile's scores s[n][e] (n the score fragment), their running max m[r] and its own part of their
// running sum l[r] (the quad's four parts add up at the end: FA2 keeps the sum unreduced), and the
// output fragments o[d][e] (d the n8 tile of head dims).

// The lane's own max of row r's scores (the caller reduces it over the lane's quad).
template <int kN>
KV_HD float TcLaneRowMax(const float (&s)[kN][4], int r) {
    float mx = -INFINITY;
    KV_TC_UNROLL
    for (int n = 0; n < kN; ++n) {
        mx = s[n][2 * r] > mx ? s[n][2 * r] : mx;
        mx = s[n][2 * r + 1] > mx ? s[n][2 * r + 1] : mx;
    }
    return mx;
}
// With row_max[r] the quad's max of row r's scores in this tile: scores become probabilities
// exp(s - m_new) (0 for a masked -inf score, all 0 while a row has seen no key), the running sum
// and the outputs are rescaled by exp(m_old - m_new), and m becomes m_new.
template <int kN, int kD>
KV_HD void TcSoftmaxStep(float (&s)[kN][4], float (&m)[2], float (&l)[2], float (&o)[kD][4],
                         const float (&row_max)[2]) {
    float alpha[2], m_new[2];
    KV_TC_UNROLL
    for (int r = 0; r < 2; ++r) {
        m_new[r] = m[r] > row_max[r] ? m[r] : row_max[r];
        alpha[r] = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new[r]);
        l[r] *= alpha[r];
        m[r] = m_new[r];
    }
    KV_TC_UNROLL
    for (int n = 0; n < kN; ++n) {
        KV_TC_UNROLL
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const float p = m_new[r] == -INFINITY ? 0.0f : expf(s[n][e] - m_new[r]);
            s[n][e] = p;
            l[r] += p;
        }
    }
    KV_TC_UNROLL
    for (int d = 0; d < kD; ++d) {
        KV_TC_UNROLL
        for (int e = 0; e < 4; ++e) o[d][e] *= alpha[e >> 1];
    }
}

}  // namespace kvshard::cuda
