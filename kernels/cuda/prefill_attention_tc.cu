// The tensor-core prefill attention kernel (kernels/cuda/prefill_attention.h,
// LaunchPrefillAttentionTc): Q·Kᵀ and P·V as mma.sync.aligned.m16n8k16 bf16 products with fp32
// accumulation, the online softmax in fp32 registers, FlashAttention-2's tiling (Dao 2023, §3).
// The fragment maps, the tile walk and the per-lane softmax step are
// kernels/cuda/prefill_tc_math.h's, emulated on the CPU by
// tests/kernels/cuda_prefill_tc_math_test.cc.
//
// Inline PTX rather than WMMA: WMMA's fragment layout is unspecified, so the scores could not be
// masked, exponentiated and fed back as the P·V product's A operand in registers (FA2's register
// reuse) without a round trip through shared memory; mma.sync's layout is documented, written
// down in prefill_tc_math.h and tested there.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/cuda/kv_tile.cuh"
#include "kernels/cuda/launch_math.h"
#include "kernels/cuda/prefill_args.cuh"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/prefill_tc_math.h"

namespace kvshard::cuda {
namespace {

static_assert(kTcLanes == kWarpSize, "a warp's lanes");
constexpr int kMaxDevices = 64;

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// d = a · b + d, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8×8 bf16 matrices from shared memory (prefill_tc_math.h TcLdsmTile16 / TcLdsmStrip8 give
// each lane's row address): register i is lane l's row l / 4, columns 2 (l % 4) and one more, of
// matrix i. No "memory" clobber (it would force reloads in the inner loop): every write to the
// tiles is ordered before these reads by a __syncthreads, which volatile asm is not moved across.
__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const __nv_bfloat16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(SharedAddress(p)));
}
// The same, each matrix transposed: register i is column l / 4, rows 2 (l % 4) and one more.
__device__ __forceinline__ void Ldsm4Trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(SharedAddress(p)));
}

// 16 bytes from global to shared memory without a register round trip (sm_80's cp.async, cached
// in L2 only: a block reads each K/V row once).
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Two consecutive elements (d, d + 1) of a K or V row of the pool, decoded to fp32.
template <KvDtype kStorage>
__device__ __forceinline__ float2 LoadPair(const uint8_t* row, const uint8_t* scale_at, int d) {
    if constexpr (kStorage == KvDtype::kBf16) {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(row + 2 * d);
        return make_float2(Bf16Decode(static_cast<uint16_t>(w & 0xffffu)),
                           Bf16Decode(static_cast<uint16_t>(w >> 16)));
    } else {
        const float scale = *reinterpret_cast<const float*>(scale_at);
        if constexpr (kStorage == KvDtype::kInt8) {
            return make_float2(static_cast<float>(static_cast<int8_t>(row[d])) * scale,
                               static_cast<float>(static_cast<int8_t>(row[d + 1])) * scale);
        } else {
            return make_float2(Fp8E4M3Decode(row[d]) * scale, Fp8E4M3Decode(row[d + 1]) * scale);
        }
    }
}

// Starts the copy of key tile [t0, t0 + nt) of a bf16 pool into shared K and V tiles (dk, dv:
// kTcTileKeys rows of TcRowHalves(kHd) elements), 16 bytes a cp.async (TcCopyChunkKey/Dim); rows
// from nt on are zeroed (a masked score's probability is 0, but 0 · NaN is not). Every thread
// computes the slots of its own chunks. Called by every thread; the caller commits the group.
// REQUIRES: the pool's base, block stride and K/V offsets 16-byte aligned (Aligned16).
template <int kHd>
__device__ __forceinline__ void CopyTileAsync(const PrefillArgs& a, const int32_t* table,
                                              int64_t kv_head, int64_t t0, int nt,
                                              __nv_bfloat16* dk, __nv_bfloat16* dv) {
    constexpr int kRow = kHd + kTcRowPad;
    for (int c = threadIdx.x; c < kTcTileKeys * kHd / 8; c += kTcThreads) {
        const int j = TcCopyChunkKey(c, kHd), d = TcCopyChunkDim(c, kHd);
        __nv_bfloat16* k_dst = dk + j * kRow + d;
        __nv_bfloat16* v_dst = dv + j * kRow + d;
        if (j < nt) {
            const int64_t slot = SlotOfPosition(table, a.kv.block_size, t0 + j);
            const int64_t at =
                KvElementOffset(a.kv.block_stride, 0, a.kv.block_size, kHd, 2, slot, kv_head, d);
            CopyAsync16(k_dst, a.kv.base + a.kv.k_offset + at);
            CopyAsync16(v_dst, a.kv.base + a.kv.v_offset + at);
        } else {
            *reinterpret_cast<uint4*>(k_dst) = make_uint4(0u, 0u, 0u, 0u);
            *reinterpret_cast<uint4*>(v_dst) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// One block takes query tiles w = blockIdx.x, + gridDim.x, ... (PrefillTileOf with kTcQueries
// query vectors a tile); warp w owns the tile's query vectors 16 w .. 16 w + 15 as an A fragment
// per 16 head dims. Per kTcTileKeys-key tile: the K and V rows (bf16, key-major) through the block
// table into shared memory; each warp scores its 16 queries against the 64 keys (8 n8 fragments),
// masks what its rows may not see (TcKeyTileMask), takes the online-softmax step (TcSoftmaxStep)
// and adds P·V into its output fragments (kHd / 8 of them). Fragments come out of shared memory
// by ldmatrix (V's transposed by ldmatrix.trans). The K/V tiles alternate between two stages:
// with kAsync (bf16 pools, 16-byte aligned) the next tile's cp.async copy runs while the warps
// compute on this one; otherwise (fp8 and int8 pools, dequantized to bf16 on the way) each tile
// is loaded synchronously into its stage. Either way the arithmetic and its order are the same.
template <KvDtype kStorage, int kHd, bool kAsync>
__global__ void __launch_bounds__(kTcThreads, 2) PrefillAttentionTcKernel(PrefillArgs a) {
    static_assert(!kAsync || kStorage == KvDtype::kBf16, "cp.async copies bf16 rows as stored");
    constexpr int kKSteps = kHd / kMmaK;          // A fragments of Q
    constexpr int kDTiles = kHd / kMmaN;          // output fragments
    constexpr int kPSteps = kTcTileKeys / kMmaK;  // k-steps of P·V
    constexpr int kRow = kHd + kTcRowPad;
    const int64_t elem = KvElementBytes(kStorage);
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    int64_t* row_at = reinterpret_cast<int64_t*>(smem_raw);
    int64_t* scale_at = row_at + kTcTileKeys;
    __nv_bfloat16* tiles = reinterpret_cast<__nv_bfloat16*>(scale_at + kTcTileKeys);
    __nv_bfloat16* sq = tiles + TcQTileAt(kHd);
    __shared__ int group[kAttnMaxHeads];
    __shared__ int counts[kAttnMaxHeads];
    __shared__ int group_size, max_group;

    if (tid == 0) max_group = WidestGroup(a, counts);
    __syncthreads();
    const PrefillPlan plan = PlanPrefill(max_group, kTcQueries);

    for (int64_t w = blockIdx.x;; w += gridDim.x) {
        const PrefillTile t = PrefillTileOf(plan, w, a.num_seqs, a.kv.num_kv_heads, a.query_starts,
                                            a.context_lens, a.window);
        if (t.seq < 0) break;
        __syncthreads();  // the previous tile is done with group[] and the shared arrays
        if (tid == 0) group_size = GroupHeads(a, t.kv_head, group);
        __syncthreads();
        const int g_size = group_size;
        if (t.h_begin >= g_size) continue;  // a pass past this KV head's (smaller) group
        const int h_begin = t.h_begin;
        const int nh = (t.h_end < g_size ? t.h_end : g_size) - h_begin;
        const int64_t row0 = a.query_starts[t.seq];
        const int64_t n_rows = a.query_starts[t.seq + 1] - row0;
        const int64_t pos0 = a.context_lens[t.seq] - n_rows + t.r_begin;
        const int nq = static_cast<int>((t.r_end - t.r_begin) * nh);
        const int32_t* table = a.block_tables + a.block_table_starts[t.seq];
        const int64_t n_tiles = t.k_end > t.k_begin
                                    ? (t.k_end - t.k_begin + kTcTileKeys - 1) / kTcTileKeys
                                    : 0;
        if constexpr (kAsync) {
            // Key tile 0 into stage 0 (not where Q goes) while Q is loaded.
            if (n_tiles > 0) {
                const int nt0 = static_cast<int>(
                    t.k_end - t.k_begin < kTcTileKeys ? t.k_end - t.k_begin : kTcTileKeys);
                CopyTileAsync<kHd>(a, table, t.kv_head, t.k_begin, nt0, tiles + TcKTileAt(0, kHd),
                                   tiles + TcVTileAt(0, kHd));
            }
            CopyAsyncCommit();
        }

        // The tile's queries in bf16, zero past nq (the scale is applied to the fp32 scores).
        for (int c = tid; c < kTcQueries * kHd / 2; c += kTcThreads) {
            const int i = TcChunkKey(c, kHd), d = TcChunkDim(c, kHd);
            float x0 = 0.0f, x1 = 0.0f;
            if (i < nq) {
                const int64_t r = row0 + t.r_begin + i / nh;
                const float* src =
                    a.q + r * a.q_stride + static_cast<int64_t>(group[h_begin + i % nh]) * kHd + d;
                x0 = src[0];
                x1 = src[1];
            }
            *reinterpret_cast<uint32_t*>(sq + i * kRow + d) = PackBf16(x0, x1);
        }
        __syncthreads();
        const TcWarpSpan span = TcWarpPositions(warp, nq, nh, pos0);
        uint32_t qf[kKSteps][4];
        {
            const FragCoord c = TcLdsmTile16(lane);
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
                Ldsm4(qf[kk], sq + (warp * kMmaM + c.row) * kRow + kk * kMmaK + c.col);
            }
        }
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        float o[kDTiles][4];
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o[d][e] = 0.0f;
        }

        for (int64_t i = 0; i < n_tiles; ++i) {
            const int64_t t0 = t.k_begin + i * kTcTileKeys;
            const int nt =
                static_cast<int>(t.k_end - t0 < kTcTileKeys ? t.k_end - t0 : kTcTileKeys);
            const int stage = static_cast<int>(i & 1);
            __nv_bfloat16* sk = tiles + TcKTileAt(stage, kHd);
            __nv_bfloat16* sv = tiles + TcVTileAt(stage, kHd);
            // Every warp is done with the other stage's tiles (read at i - 1) and, at i = 0, with
            // the Q tile in stage 1.
            __syncthreads();
            if constexpr (kAsync) {
                if (i + 1 < n_tiles) {
                    const int64_t t1 = t0 + kTcTileKeys;
                    const int nt1 =
                        static_cast<int>(t.k_end - t1 < kTcTileKeys ? t.k_end - t1 : kTcTileKeys);
                    CopyTileAsync<kHd>(a, table, t.kv_head, t1, nt1,
                                       tiles + TcKTileAt(stage ^ 1, kHd),
                                       tiles + TcVTileAt(stage ^ 1, kHd));
                }
                CopyAsyncCommit();   // (an empty group past the last tile keeps the count)
                CopyAsyncWait<1>();  // this thread's copies of tile i have landed
            } else {
                if (tid < nt) {
                    const int64_t slot = SlotOfPosition(table, a.kv.block_size, t0 + tid);
                    row_at[tid] = KvElementOffset(a.kv.block_stride, 0, a.kv.block_size, kHd,
                                                  elem, slot, t.kv_head, 0);
                    scale_at[tid] =
                        KvScaleOffset(a.kv.block_stride, 0, a.kv.block_size, slot, t.kv_head);
                }
                __syncthreads();
                for (int c = tid; c < kTcTileKeys * kHd / 2; c += kTcThreads) {
                    const int j = TcChunkKey(c, kHd), d = TcChunkDim(c, kHd);
                    float2 k2 = make_float2(0.0f, 0.0f), v2 = k2;
                    if (j < nt) {
                        k2 = LoadPair<kStorage>(a.kv.base + a.kv.k_offset + row_at[j],
                                                a.kv.base + a.kv.k_scale_offset + scale_at[j], d);
                        v2 = LoadPair<kStorage>(a.kv.base + a.kv.v_offset + row_at[j],
                                                a.kv.base + a.kv.v_scale_offset + scale_at[j], d);
                    }
                    *reinterpret_cast<uint32_t*>(sk + j * kRow + d) = PackBf16(k2.x, k2.y);
                    *reinterpret_cast<uint32_t*>(sv + j * kRow + d) = PackBf16(v2.x, v2.y);
                }
            }
            __syncthreads();  // the tile is in shared memory for every warp
            const TcTileMask mask = TcKeyTileMask(t0, nt, span, a.window);
            if (mask == TcTileMask::kSkip) continue;

            float s[kTcScoreTiles][4];
            const FragCoord ks = TcLdsmStrip8(lane);
#pragma unroll
            for (int n = 0; n < kTcScoreTiles; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < kKSteps; kk += 2) {
                    // B(k, n') = K[key 8 n + n'][dim 16 kk + k], k-steps kk and kk + 1.
                    uint32_t b[4];
                    Ldsm4(b, sk + (n * kMmaN + ks.row) * kRow + kk * kMmaK + ks.col);
                    Mma(s[n], qf[kk], b[0], b[1]);
                    Mma(s[n], qf[kk + 1], b[2], b[3]);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const FragCoord c = MmaCElement(lane, e);
                    float x = s[n][e] * a.scale;
                    if (mask == TcTileMask::kMasked) {
                        const int qi = warp * kMmaM + c.row, j = n * kMmaN + c.col;
                        const bool visible =
                            qi < nq && j < nt && KeyVisible(t0 + j, pos0 + qi / nh, a.window);
                        x = visible ? x : -INFINITY;
                    }
                    s[n][e] = x;
                }
            }
            float row_max[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = TcLaneRowMax(s, r);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                row_max[r] = mx;
            }
            TcSoftmaxStep(s, m, l, o, row_max);

#pragma unroll
            for (int kk = 0; kk < kPSteps; ++kk) {
                uint32_t pf[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int e = 2 * r;
                    pf[r] = PackBf16(s[TcPTileOf(kk, e)][TcPElementOf(e)],
                                     s[TcPTileOf(kk, e + 1)][TcPElementOf(e + 1)]);
                }
                const FragCoord vs = TcLdsmTile16(lane);
#pragma unroll
                for (int d = 0; d < kDTiles; d += 2) {
                    // B(k, n) = V[key 16 kk + k][dim 8 d + n], dim tiles d and d + 1.
                    uint32_t b[4];
                    Ldsm4Trans(b, sv + (kk * kMmaK + vs.row) * kRow + d * kMmaN + vs.col);
                    Mma(o[d], pf, b[0], b[1]);
                    Mma(o[d + 1], pf, b[2], b[3]);
                }
            }
        }
        if constexpr (kAsync) CopyAsyncWait<0>();  // nothing left in flight into the next Q tile
        if (span.empty) continue;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        }
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const FragCoord c = MmaCElement(lane, e);
                const int qi = warp * kMmaM + c.row;
                if (qi >= nq) continue;
                const float lr = l[e >> 1];
                const int64_t r = row0 + t.r_begin + qi / nh;
                const int64_t h = group[h_begin + qi % nh];
                a.out[(r * a.num_heads + h) * kHd + d * kMmaN + c.col] =
                    lr > 0.0f ? o[d][e] / lr : 0.0f;
            }
        }
    }
}

template <KvDtype kStorage, int kHd, bool kAsync>
int Launch(const PrefillArgs& a, unsigned grid, StreamHandle stream) {
    static std::atomic<bool> configured[kMaxDevices];
    const size_t shared = static_cast<size_t>(TcSharedBytes(kHd));
    int device = 0;
    if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return static_cast<int>(e);
    if (device < 0 || device >= kMaxDevices || !configured[device].load()) {
        const cudaError_t e = cudaFuncSetAttribute(PrefillAttentionTcKernel<kStorage, kHd, kAsync>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(shared));
        if (e != cudaSuccess) return static_cast<int>(e);
        if (device >= 0 && device < kMaxDevices) configured[device].store(true);
    }
    PrefillAttentionTcKernel<kStorage, kHd, kAsync><<<grid, kTcThreads, shared, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// Whether cp.async may copy the pool's bf16 rows 16 bytes at a time: each K/V head row starts at
// base + block · block_stride + the K (or V) offset + a multiple of head_dim · 2 bytes.
bool Aligned16(const PrefillArgs& a) {
    const uint64_t bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(a.kv.base)) |
                          static_cast<uint64_t>(a.kv.block_stride) |
                          static_cast<uint64_t>(a.kv.k_offset) | static_cast<uint64_t>(a.kv.v_offset);
    return bits % 16 == 0;
}

template <KvDtype kStorage, int kHd>
int LaunchForHeadDim(const PrefillArgs& a, unsigned grid, StreamHandle stream) {
    if constexpr (kStorage == KvDtype::kBf16) {
        if (Aligned16(a)) return Launch<kStorage, kHd, true>(a, grid, stream);
    }
    return Launch<kStorage, kHd, false>(a, grid, stream);
}

template <KvDtype kStorage>
int LaunchForStorage(const PrefillArgs& a, unsigned grid, StreamHandle stream) {
    if (a.kv.head_dim == 64) return LaunchForHeadDim<kStorage, 64>(a, grid, stream);
    if (a.kv.head_dim == 128) return LaunchForHeadDim<kStorage, 128>(a, grid, stream);
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int LaunchPrefillAttentionTc(const float* q, int64_t q_stride, const cpu::PagedKvLayer& kv,
                             const cpu::PagedAttentionBatch& batch, float* out, int64_t num_heads,
                             const int32_t* kv_head_of_q, unsigned grid_blocks,
                             StreamHandle stream) {
    if (batch.num_seqs == 0 || num_heads == 0 || kv.num_kv_heads == 0) return 0;
    const PrefillArgs a = MakePrefillArgs(q, q_stride, kv, batch, out, num_heads, kv_head_of_q);
    const unsigned grid = grid_blocks > 0 ? grid_blocks : 1;
    switch (kv.storage) {
        case KvDtype::kBf16:
            return LaunchForStorage<KvDtype::kBf16>(a, grid, stream);
        case KvDtype::kFp8:
            return LaunchForStorage<KvDtype::kFp8>(a, grid, stream);
        case KvDtype::kInt8:
            return LaunchForStorage<KvDtype::kInt8>(a, grid, stream);
        case KvDtype::kFp32:
        case KvDtype::kFp16:
            break;
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace kvshard::cuda
