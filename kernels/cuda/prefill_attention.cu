// The FA2-style prefill attention kernel (kernels/cuda/prefill_attention.h). fp32 FMA tiles; the
// tile walk, the slot → address arithmetic and the masks are kernels/cuda/launch_math.h's, tested
// on the CPU (tests/kernels/cuda_prefill_math_test.cc).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/cuda/kv_tile.cuh"
#include "kernels/cuda/launch_math.h"
#include "kernels/cuda/prefill_args.cuh"
#include "kernels/cuda/prefill_attention.h"
#include "kernels/cuda/warp_reduce.cuh"

namespace kvshard::cuda {
namespace {

static_assert(kPrefillTileKeys == kAttnTileKeys, "LoadTile reads kAttnTileKeys rows");
static_assert(kPrefillTileKeys == kWarpSize, "a tile's scores are one warp's lanes");

constexpr int kWarps = kPrefillThreads / kWarpSize;
// Most devices whose shared-memory opt-in a process remembers.
constexpr int kMaxDevices = 64;

__host__ __device__ constexpr int QueriesOf(int hd_class) {
    return kPrefillAccFloats / hd_class < kPrefillMaxQueries ? kPrefillAccFloats / hd_class
                                                             : kPrefillMaxQueries;
}

// One block takes query tiles w = blockIdx.x, + gridDim.x, ... (PrefillTileOf). Per tile: the
// queries (pre-scaled) in shared memory; per 32-key tile, the K and V rows through the block
// table, decoded to fp32 (LoadTile); warp w scores queries w, w + 4, ... against the tile's keys
// (lane = key), updates their running max and sum and writes the probabilities; then thread t
// rescales and accumulates its kQpt × kDpt outputs (queries t / 16 + 8 i, dims t % 16 + 16 k)
// in registers. kHd: the head-dim class the registers are sized for (head_dim <= kHd).
template <KvDtype kStorage, int kHd>
__global__ void __launch_bounds__(kPrefillThreads, 2) PrefillAttentionKernel(PrefillArgs a) {
    constexpr int kQ = QueriesOf(kHd);
    constexpr int kQpt = kQ / kPrefillQueryLanes;  // output queries a thread holds
    constexpr int kDpt = kHd / kPrefillDimLanes;   // output dims a thread holds
    constexpr int kQpw = kQ / kWarps;              // queries a warp scores
    static_assert(kQ % kPrefillQueryLanes == 0 && kHd % kPrefillDimLanes == 0 && kQ % kWarps == 0);

    const int hd = static_cast<int>(a.kv.head_dim);
    const int row = static_cast<int>(PrefillTileRowFloats(hd));
    const int64_t elem = KvElementBytes(kStorage);
    const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
    const int tq = tid / kPrefillDimLanes, td = tid % kPrefillDimLanes;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    int64_t* row_at = reinterpret_cast<int64_t*>(smem_raw);  // the tile's slots (LoadTile)
    int64_t* scale_at = row_at + kPrefillTileKeys;
    float* sq = reinterpret_cast<float*>(scale_at + kPrefillTileKeys);  // kQ × hd
    float* sk = sq + kQ * hd;                                           // kPrefillTileKeys × row
    float* sv = sk + kPrefillTileKeys * row;
    float* sp = sv + kPrefillTileKeys * row;  // kQ × kPrefillProbRowFloats probabilities
    float* s_max = sp + kQ * kPrefillProbRowFloats;
    float* s_sum = s_max + kQ;
    float* s_alpha = s_sum + kQ;
    __shared__ int group[kAttnMaxHeads];
    __shared__ int counts[kAttnMaxHeads];
    __shared__ int group_size, max_group;

    // The widest GQA group plans the tiles (kv_head_of_q may give groups of unequal sizes).
    if (tid == 0) max_group = WidestGroup(a, counts);
    __syncthreads();
    const PrefillPlan plan = PlanPrefill(max_group, kQ);

    for (int64_t w = blockIdx.x;; w += gridDim.x) {
        const PrefillTile t = PrefillTileOf(plan, w, a.num_seqs, a.kv.num_kv_heads,
                                            a.query_starts, a.context_lens, a.window);
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
        const int64_t pos0 = a.context_lens[t.seq] - n_rows + t.r_begin;  // the tile's first row
        const int nq = static_cast<int>((t.r_end - t.r_begin) * nh);
        const int32_t* table = a.block_tables + a.block_table_starts[t.seq];

        for (int e = tid; e < kQ * hd; e += kPrefillThreads) {
            const int i = e / hd, d = e - i * hd;
            float x = 0.0f;
            if (i < nq) {
                const int64_t r = row0 + t.r_begin + i / nh;
                x = a.q[r * a.q_stride + static_cast<int64_t>(group[h_begin + i % nh]) * hd + d] *
                    a.scale;
            }
            sq[e] = x;
        }
        for (int i = tid; i < kQ; i += kPrefillThreads) {
            s_max[i] = -INFINITY;
            s_sum[i] = 0.0f;
        }
        float acc[kQpt][kDpt];
#pragma unroll
        for (int i = 0; i < kQpt; ++i) {
#pragma unroll
            for (int k = 0; k < kDpt; ++k) acc[i][k] = 0.0f;
        }

        for (int64_t t0 = t.k_begin; t0 < t.k_end; t0 += kPrefillTileKeys) {
            const int nt = static_cast<int>(t.k_end - t0 < kPrefillTileKeys ? t.k_end - t0
                                                                             : kPrefillTileKeys);
            __syncthreads();  // the previous tile's K, V and probabilities are consumed
            if (tid < nt) {
                const int64_t slot = SlotOfPosition(table, a.kv.block_size, t0 + tid);
                row_at[tid] = KvElementOffset(a.kv.block_stride, 0, a.kv.block_size, hd, elem,
                                              slot, t.kv_head, 0);
                scale_at[tid] = KvScaleOffset(a.kv.block_stride, 0, a.kv.block_size, slot, t.kv_head);
            }
            __syncthreads();
            LoadTile<kStorage>(a.kv, a.kv.k_offset, a.kv.k_scale_offset, row_at, scale_at, nt, sk);
            LoadTile<kStorage>(a.kv, a.kv.v_offset, a.kv.v_scale_offset, row_at, scale_at, nt, sv);
            __syncthreads();

            // Scores of warp's queries against key t0 + lane.
            float sc[kQpw];
#pragma unroll
            for (int j = 0; j < kQpw; ++j) sc[j] = 0.0f;
            const float* kr = sk + lane * row;
            for (int d = 0; d < hd; ++d) {
                const float kd = kr[d];
#pragma unroll
                for (int j = 0; j < kQpw; ++j) sc[j] += sq[(warp + kWarps * j) * hd + d] * kd;
            }
            const int64_t key = t0 + lane;
#pragma unroll
            for (int j = 0; j < kQpw; ++j) {
                const int i = warp + kWarps * j;
                // Query i's absolute position; a padding query (i >= nq) sees no key.
                const bool visible =
                    i < nq && lane < nt && KeyVisible(key, pos0 + i / nh, a.window);
                const float v = visible ? sc[j] : -INFINITY;
                const float m_old = s_max[i];
                const float m_new = fmaxf(m_old, WarpMax(v));
                const float p = m_new == -INFINITY ? 0.0f : expf(v - m_new);
                const float sum = WarpSum(p);
                sp[i * kPrefillProbRowFloats + lane] = p;
                if (lane == 0) {
                    const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                    s_alpha[i] = alpha;
                    s_sum[i] = s_sum[i] * alpha + sum;
                    s_max[i] = m_new;
                }
            }
            __syncthreads();

            // Rescale and accumulate this tile's probabilities times V.
#pragma unroll
            for (int i = 0; i < kQpt; ++i) {
                const float alpha = s_alpha[tq + kPrefillQueryLanes * i];
#pragma unroll
                for (int k = 0; k < kDpt; ++k) acc[i][k] *= alpha;
            }
            for (int j = 0; j < nt; ++j) {
                float vv[kDpt];
#pragma unroll
                for (int k = 0; k < kDpt; ++k) {
                    const int d = td + kPrefillDimLanes * k;
                    vv[k] = d < hd ? sv[j * row + d] : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < kQpt; ++i) {
                    const float p = sp[(tq + kPrefillQueryLanes * i) * kPrefillProbRowFloats + j];
#pragma unroll
                    for (int k = 0; k < kDpt; ++k) acc[i][k] += p * vv[k];
                }
            }
        }
        __syncthreads();  // s_sum of the last tile
#pragma unroll
        for (int i = 0; i < kQpt; ++i) {
            const int qi = tq + kPrefillQueryLanes * i;
            if (qi >= nq) continue;
            const float l = s_sum[qi];
            const int64_t r = row0 + t.r_begin + qi / nh;
            const int64_t h = group[h_begin + qi % nh];
            float* o = a.out + (r * a.num_heads + h) * hd;
#pragma unroll
            for (int k = 0; k < kDpt; ++k) {
                const int d = td + kPrefillDimLanes * k;
                if (d < hd) o[d] = l > 0.0f ? acc[i][k] / l : 0.0f;
            }
        }
    }
}

// Queues the kernel of one (storage, head-dim class), opting into the dynamic shared memory its
// widest head_dim needs (above the default 48 KiB) once per device.
template <KvDtype kStorage, int kHd>
int Launch(const PrefillArgs& a, unsigned grid, size_t shared, StreamHandle stream) {
    static std::atomic<bool> configured[kMaxDevices];
    int device = 0;
    if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return static_cast<int>(e);
    if (device < 0 || device >= kMaxDevices || !configured[device].load()) {
        const cudaError_t e = cudaFuncSetAttribute(PrefillAttentionKernel<kStorage, kHd>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(PrefillSharedBytes(kHd)));
        if (e != cudaSuccess) return static_cast<int>(e);
        if (device >= 0 && device < kMaxDevices) configured[device].store(true);
    }
    PrefillAttentionKernel<kStorage, kHd><<<grid, kPrefillThreads, shared, stream>>>(a);
    return static_cast<int>(cudaGetLastError());
}

template <KvDtype kStorage>
int LaunchForStorage(const PrefillArgs& a, unsigned grid, size_t shared, StreamHandle stream) {
    switch (PrefillHeadDimClass(a.kv.head_dim)) {
        case 64:
            return Launch<kStorage, 64>(a, grid, shared, stream);
        case 128:
            return Launch<kStorage, 128>(a, grid, shared, stream);
        case 256:
            return Launch<kStorage, 256>(a, grid, shared, stream);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

int LaunchPrefillAttention(const float* q, int64_t q_stride, const cpu::PagedKvLayer& kv,
                           const cpu::PagedAttentionBatch& batch, float* out, int64_t num_heads,
                           const int32_t* kv_head_of_q, unsigned grid_blocks, StreamHandle stream) {
    if (batch.num_seqs == 0 || num_heads == 0 || kv.num_kv_heads == 0) return 0;
    const PrefillArgs a = MakePrefillArgs(q, q_stride, kv, batch, out, num_heads, kv_head_of_q);
    const unsigned grid = grid_blocks > 0 ? grid_blocks : 1;
    const size_t shared = static_cast<size_t>(PrefillSharedBytes(kv.head_dim));
    switch (kv.storage) {
        case KvDtype::kFp32:
            return LaunchForStorage<KvDtype::kFp32>(a, grid, shared, stream);
        case KvDtype::kFp16:
            return LaunchForStorage<KvDtype::kFp16>(a, grid, shared, stream);
        case KvDtype::kBf16:
            return LaunchForStorage<KvDtype::kBf16>(a, grid, shared, stream);
        case KvDtype::kFp8:
            return LaunchForStorage<KvDtype::kFp8>(a, grid, shared, stream);
        case KvDtype::kInt8:
            return LaunchForStorage<KvDtype::kInt8>(a, grid, shared, stream);
    }
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace kvshard::cuda
