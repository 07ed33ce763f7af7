// The device kernels of CudaBackend (kernels/cuda/backend_kernels.h). fp32 math throughout; the
// index arithmetic is kernels/cuda/launch_math.h's, tested on the CPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/backend_kernels.h"
#include "kernels/cuda/kv_tile.cuh"
#include "kernels/cuda/launch_math.h"
#include "kernels/cuda/prefill_args.cuh"
#include "kernels/cuda/warp_reduce.cuh"

namespace kvshard::cuda {
namespace {

constexpr int kWarp = kWarpSize;
constexpr int kRowThreads = 256;

// Every thread gets the sum (or max) over the block. REQUIRES: blockDim.x a multiple of 32, at
// most kRowThreads; called by every thread.
template <bool kMax>
__device__ float BlockReduce(float v) {
    __shared__ float partial[kRowThreads / kWarp];
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    const int warps = blockDim.x / kWarp;
    v = kMax ? WarpMax(v) : WarpSum(v);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : (kMax ? -INFINITY : 0.0f);
    return kMax ? WarpMax(v) : WarpSum(v);
}

__device__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }

int RowThreads(int64_t dim) {
    int t = kWarp;
    while (t < kRowThreads && t < dim) t *= 2;
    return t;
}

int LastError() { return static_cast<int>(cudaGetLastError()); }

// ---- elementwise and row ops ----

template <typename T>
__device__ float Load(const T* p, int64_t i);
template <>
__device__ float Load<float>(const float* p, int64_t i) {
    return p[i];
}
template <>
__device__ float Load<uint16_t>(const uint16_t* p, int64_t i) {
    return __uint_as_float(static_cast<uint32_t>(p[i]) << 16);
}

template <typename T>
__global__ void EmbeddingKernel(const T* table, int64_t rows, int64_t cols, int64_t row_offset,
                                const int32_t* ids, float* out) {
    const int64_t i = blockIdx.x;
    const int64_t r = static_cast<int64_t>(ids[i]) - row_offset;
    float* o = out + i * cols;
    const bool inside = r >= 0 && r < rows;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        o[c] = inside ? Load(table, r * cols + c) : 0.0f;
    }
}

// x and out may alias: each element is written by the thread that read it, after the barrier.
__global__ void RmsNormKernel(const float* x, const float* weight, float* out, int64_t dim,
                              float eps) {
    const float* xr = x + static_cast<int64_t>(blockIdx.x) * dim;
    float* outr = out + static_cast<int64_t>(blockIdx.x) * dim;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = BlockReduce<false>(ss);
    const float scale = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) outr[i] = xr[i] * scale * weight[i];
}

__global__ void AddRmsNormKernel(float* residual, const float* delta, const float* weight,
                                 float* out, int64_t dim, float eps) {
    float* xr = residual + static_cast<int64_t>(blockIdx.x) * dim;
    const float* dr = delta + static_cast<int64_t>(blockIdx.x) * dim;
    float* outr = out + static_cast<int64_t>(blockIdx.x) * dim;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i] + dr[i];
        xr[i] = v;
        ss += v * v;
    }
    ss = BlockReduce<false>(ss);
    const float scale = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) outr[i] = xr[i] * scale * weight[i];
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        x[i] += y[i];
    }
}

__global__ void RopeKernel(float* x, int64_t row_stride, const int32_t* positions,
                           int64_t num_heads, int64_t head_dim, const float* inv_freq) {
    const int64_t r = blockIdx.x;
    const int64_t half = head_dim / 2;
    const float pos = static_cast<float>(positions[r]);
    float* xr = x + r * row_stride;
    for (int64_t e = threadIdx.x; e < num_heads * half; e += blockDim.x) {
        const int64_t h = e / half, i = e % half;
        const float angle = pos * inv_freq[i];
        const float c = cosf(angle), s = sinf(angle);
        float* v = xr + h * head_dim + 2 * i;
        const float a = v[0], b = v[1];
        v[0] = a * c - b * s;
        v[1] = a * s + b * c;
    }
}

__global__ void SiluMulKernel(const float* gate_up, int64_t rows, int64_t dim, float* out) {
    const int64_t n = rows * dim;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
         e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = e / dim, i = e % dim;
        const float g = gate_up[r * 2 * dim + i];
        out[e] = g / (1.0f + expf(-g)) * gate_up[r * 2 * dim + dim + i];
    }
}

// GELU's tanh approximation times up, the arithmetic of cpu::GeluTanhMulFused.
__global__ void GeluTanhMulKernel(const float* gate_up, int64_t rows, int64_t dim, float* out) {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    const int64_t n = rows * dim;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
         e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t r = e / dim, i = e % dim;
        const float x = gate_up[r * 2 * dim + i];
        const float inner = kSqrt2OverPi * (x + 0.044715f * x * x * x);
        out[e] = 0.5f * x * (1.0f + tanhf(inner)) * gate_up[r * 2 * dim + dim + i];
    }
}

__global__ void AddBiasKernel(float* x, const float* bias, int64_t rows, int64_t dim) {
    const int64_t n = rows * dim;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
         e += int64_t(gridDim.x) * blockDim.x) {
        x[e] += bias[e % dim];
    }
}

// Grid (rows, num_heads): the RMSNorm of one head of one row, in place.
__global__ void HeadRmsNormKernel(float* x, int64_t row_stride, int64_t head_dim,
                                  const float* weight, float eps) {
    float* xh = x + static_cast<int64_t>(blockIdx.x) * row_stride +
                static_cast<int64_t>(blockIdx.y) * head_dim;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) ss += xh[i] * xh[i];
    ss = BlockReduce<false>(ss);
    const float scale = 1.0f / sqrtf(ss / static_cast<float>(head_dim) + eps);
    for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) xh[i] = xh[i] * scale * weight[i];
}

__global__ void ScaleKernel(float* x, float s, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        x[i] *= s;
    }
}

__global__ void F32ToBf16Kernel(const float* x, int64_t n, uint16_t* out) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
    }
}

__global__ void GatherRowsKernel(const float* x, int64_t dim, const int32_t* rows, float* out) {
    const int64_t i = blockIdx.x;
    const float* src = x + static_cast<int64_t>(rows[i]) * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) out[i * dim + c] = src[c];
}

template <typename Word>
__global__ void CopyBlocksKernel(Word* pool, int64_t words_per_block, const int32_t* src_dst) {
    const Word* src = pool + static_cast<int64_t>(src_dst[2 * blockIdx.x]) * words_per_block;
    Word* dst = pool + static_cast<int64_t>(src_dst[2 * blockIdx.x + 1]) * words_per_block;
    for (int64_t w = threadIdx.x; w < words_per_block; w += blockDim.x) dst[w] = src[w];
}

// ---- paged KV ----

// Grid (n, num_kv_heads, 2: K then V): one head of one row; 16-bit storage rounds each element to
// nearest even, 8-bit storage quantizes the head with its own scale.
template <KvDtype kStorage>
__global__ void KvWriteKernel(KvArgs kv, const float* k, const float* v, int64_t row_stride,
                              const int64_t* slots) {
    const int64_t i = blockIdx.x, h = blockIdx.y;
    const bool is_v = blockIdx.z == 1;
    const int64_t hd = kv.head_dim;
    const float* src = (is_v ? v : k) + i * row_stride + h * hd;
    const int64_t slot = slots[i];
    if (slot < 0) return;  // a padded row of a decode step: no KV
    uint8_t* dst =
        kv.base + KvElementOffset(kv.block_stride, is_v ? kv.v_offset : kv.k_offset, kv.block_size,
                                  hd, KvElementBytes(kStorage), slot, h, 0);
    StoreKvHead<kStorage>(src, hd, dst, KvScaleAt<kStorage>(kv, is_v, slot, h));
}

// The prefill kernels' arguments (prefill_args.cuh: the batch, the pool, q, out, the GQA map,
// scale and window), plus the decode kernel's own: its key splits and their partial results.
struct AttnArgs : PrefillArgs {
    int num_splits;
    float* partials;
    bool decode_only;  // leave sequences of more than one row to the prefill kernel
};

constexpr int kAccPerThread = kAttnMaxAccFloats / kAttnThreads;

// Grid (num_seqs, num_kv_heads, num_splits). A block serves the GQA group of one KV head of one
// sequence: the query heads using that KV head read each K/V tile once from the pool into
// shared memory. A decode row (one new token) has its keys split over the grid's z dimension,
// each block writing a partial result merged by MergeSplitsKernel; a prefill chunk's rows are
// dealt out to the z blocks in tiles, each attending causally over the block table, unless
// a.decode_only leaves them to PrefillAttentionKernel (the CUDA backend's path).
// (The launch bound's minimum of one block per SM lets ptxas keep the 16 accumulators and the
// index state in registers: without it, nvcc 13.0 caps the kernel at 64 registers and spills.)
template <KvDtype kStorage>
__global__ void __launch_bounds__(kAttnThreads, 1) PagedAttentionKernel(AttnArgs a) {
    static_assert(kAttnTileKeys == kWarp, "a tile's scores are one warp's lanes");
    const int64_t s = blockIdx.x, kvh = blockIdx.y;
    const int z = blockIdx.z;
    const int64_t hd = a.kv.head_dim;
    const int64_t row0 = a.query_starts[s];
    const int64_t n_rows = a.query_starts[s + 1] - row0;
    if (a.decode_only && n_rows > 1) return;  // a prefill chunk: kernels/cuda/prefill_attention.cu
    const int64_t len = a.context_lens[s];
    const int32_t* table = a.block_tables + a.block_table_starts[s];
    const int qv_max = QueryVectorsPerPass(hd);
    const int64_t kv_row = TileRowFloats(hd);

    extern __shared__ float smem[];
    float* sq = smem;                              // qv_max × hd queries, pre-scaled
    float* skv = sq + qv_max * hd;                 // kAttnTileKeys × kv_row: a K or V tile
    float* ss = skv + kAttnTileKeys * kv_row;      // qv_max × kAttnTileKeys scores, then weights
    float* s_max = ss + qv_max * kAttnTileKeys;    // running max per query vector
    float* s_sum = s_max + qv_max;                 // running sum of weights
    float* s_alpha = s_sum + qv_max;               // this tile's rescale of the accumulators
    __shared__ int group[kAttnMaxHeads];
    __shared__ int group_size;
    __shared__ int q_row[kAttnMaxQueryVectors], q_head[kAttnMaxQueryVectors];
    __shared__ int64_t q_pos[kAttnMaxQueryVectors];
    __shared__ int64_t row_at[kAttnTileKeys], scale_at[kAttnTileKeys];  // the tile's slots
    const int64_t elem = KvElementBytes(kStorage);
    const int hd_i = static_cast<int>(hd);

    if (threadIdx.x == 0) group_size = GroupHeads(a, kvh, group);
    __syncthreads();
    const int g_size = group_size;
    if (g_size == 0) return;

    const AttnPlan plan = PlanAttention(n_rows, g_size, qv_max);
    const bool decode = plan.decode;
    for (int64_t item = FirstItem(plan, z); item < plan.items;
         item += ItemStride(plan, a.num_splits)) {
        const AttnItem work = ItemOf(plan, item, n_rows, len, g_size, a.num_splits, z, a.window);
        const int64_t r_begin = work.r_begin, k_begin = work.k_begin, k_end = work.k_end;
        const int h_begin = work.h_begin;
        const int nh = work.h_end - work.h_begin;
        const int nq = static_cast<int>((work.r_end - work.r_begin) * nh);
        __syncthreads();  // the previous item is done with the shared arrays
        for (int i = threadIdx.x; i < nq; i += blockDim.x) {
            const int64_t r = r_begin + i / nh;
            q_row[i] = static_cast<int>(r);
            q_head[i] = group[h_begin + i % nh];
            q_pos[i] = len - n_rows + r;
            s_max[i] = -INFINITY;
            s_sum[i] = 0.0f;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < nq * hd_i; e += blockDim.x) {
            const int i = e / hd_i, d = e - i * hd_i;
            sq[e] = a.q[(row0 + q_row[i]) * a.q_stride + q_head[i] * hd + d] * a.scale;
        }
        float acc[kAccPerThread];
#pragma unroll
        for (int j = 0; j < kAccPerThread; ++j) acc[j] = 0.0f;

        for (int64_t t0 = k_begin; t0 < k_end; t0 += kAttnTileKeys) {
            const int nt = static_cast<int>(Min64(kAttnTileKeys, k_end - t0));
            __syncthreads();  // the previous tile's V (and its slots) are consumed
            if (static_cast<int>(threadIdx.x) < nt) {
                const int64_t slot_id = SlotOfPosition(table, a.kv.block_size, t0 + threadIdx.x);
                row_at[threadIdx.x] = KvElementOffset(a.kv.block_stride, 0, a.kv.block_size, hd,
                                                      elem, slot_id, kvh, 0);
                scale_at[threadIdx.x] =
                    KvScaleOffset(a.kv.block_stride, 0, a.kv.block_size, slot_id, kvh);
            }
            __syncthreads();
            LoadTile<kStorage>(a.kv, a.kv.k_offset, a.kv.k_scale_offset, row_at, scale_at, nt, skv);
            __syncthreads();
            for (int e = threadIdx.x; e < nq * kAttnTileKeys; e += blockDim.x) {
                const int i = e / kAttnTileKeys, t = e % kAttnTileKeys;
                float sc = -INFINITY;
                if (t < nt && KeyVisible(t0 + t, q_pos[i], a.window)) {
                    const float* qi = sq + i * hd;
                    const float* kt = skv + t * kv_row;
                    float dot = 0.0f;
                    for (int d = 0; d < hd_i; ++d) dot += qi[d] * kt[d];
                    sc = dot;
                }
                ss[e] = sc;
            }
            __syncthreads();
            // Online softmax: warp w updates query vectors w, w + 4, ...; meanwhile the V tile
            // replaces K.
            const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
            for (int i = warp; i < nq; i += kAttnThreads / kWarp) {
                const float v = ss[i * kAttnTileKeys + lane];
                const float m_old = s_max[i];
                const float m_new = fmaxf(m_old, WarpMax(v));
                const float p = m_new == -INFINITY ? 0.0f : expf(v - m_new);
                const float sum = WarpSum(p);
                ss[i * kAttnTileKeys + lane] = p;
                if (lane == 0) {
                    const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
                    s_alpha[i] = alpha;
                    s_sum[i] = s_sum[i] * alpha + sum;
                    s_max[i] = m_new;
                }
            }
            LoadTile<kStorage>(a.kv, a.kv.v_offset, a.kv.v_scale_offset, row_at, scale_at, nt, skv);
            __syncthreads();
#pragma unroll
            for (int j = 0; j < kAccPerThread; ++j) {
                const int e = static_cast<int>(threadIdx.x) + j * kAttnThreads;
                if (e < nq * hd_i) {
                    const int i = e / hd_i, d = e - i * hd_i;
                    const float* w = ss + i * kAttnTileKeys;
                    float x = acc[j] * s_alpha[i];
                    for (int t = 0; t < nt; ++t) x += w[t] * skv[t * kv_row + d];
                    acc[j] = x;
                }
            }
        }
        __syncthreads();  // s_max / s_sum of an empty range were set before the loop
#pragma unroll
        for (int j = 0; j < kAccPerThread; ++j) {
            const int e = static_cast<int>(threadIdx.x) + j * kAttnThreads;
            if (e < nq * hd_i) {
                const int i = e / hd_i, d = e - i * hd_i;
                const int64_t h = q_head[i];
                if (decode && a.num_splits > 1) {
                    float* rec = a.partials + ((s * a.num_heads + h) * a.num_splits + z) * (hd + 2);
                    rec[2 + d] = acc[j];
                    if (d == 0) {
                        rec[0] = s_max[i];
                        rec[1] = s_sum[i];
                    }
                } else {
                    const float l = s_sum[i];
                    a.out[((row0 + q_row[i]) * a.num_heads + h) * hd + d] = l > 0.0f ? acc[j] / l : 0.0f;
                }
            }
        }
    }
}

// Grid (num_seqs, num_heads): the log-sum-exp merge of a decode row's split partial results.
__global__ void MergeSplitsKernel(const int32_t* query_starts, const float* partials,
                                  int num_splits, int64_t num_heads, int64_t hd, float* out) {
    const int64_t s = blockIdx.x, h = blockIdx.y;
    const int64_t row = query_starts[s];
    if (query_starts[s + 1] - row != 1) return;  // a prefill chunk, written directly
    const float* base = partials + (s * num_heads + h) * num_splits * (hd + 2);
    auto at = [base, hd](int z) { return base + z * (hd + 2); };
    for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
        out[(row * num_heads + h) * hd + d] = MergedValue(num_splits, at, d);
    }
}

}  // namespace

const char* CudaErrorText(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

int LaunchEmbeddingF32(const float* table, int64_t rows, int64_t cols, int64_t row_offset,
                       const int32_t* ids, int64_t n, float* out, StreamHandle stream) {
    if (n == 0) return 0;
    EmbeddingKernel<float><<<static_cast<unsigned>(n), RowThreads(cols), 0, stream>>>(
        table, rows, cols, row_offset, ids, out);
    return LastError();
}

int LaunchEmbeddingBf16(const uint16_t* table, int64_t rows, int64_t cols, int64_t row_offset,
                        const int32_t* ids, int64_t n, float* out, StreamHandle stream) {
    if (n == 0) return 0;
    EmbeddingKernel<uint16_t><<<static_cast<unsigned>(n), RowThreads(cols), 0, stream>>>(
        table, rows, cols, row_offset, ids, out);
    return LastError();
}

int LaunchRmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                  float eps, StreamHandle stream) {
    if (rows == 0) return 0;
    RmsNormKernel<<<static_cast<unsigned>(rows), RowThreads(dim), 0, stream>>>(x, weight, out, dim,
                                                                               eps);
    return LastError();
}

int LaunchAddRmsNorm(float* residual, const float* delta, const float* weight, float* out,
                     int64_t rows, int64_t dim, float eps, StreamHandle stream) {
    if (rows == 0) return 0;
    AddRmsNormKernel<<<static_cast<unsigned>(rows), RowThreads(dim), 0, stream>>>(
        residual, delta, weight, out, dim, eps);
    return LastError();
}

int LaunchAdd(float* x, const float* y, int64_t n, StreamHandle stream) {
    if (n == 0) return 0;
    AddKernel<<<GridFor(n, 256), 256, 0, stream>>>(x, y, n);
    return LastError();
}

int LaunchRope(float* x, int64_t row_stride, const int32_t* positions, int64_t rows,
               int64_t num_heads, int64_t head_dim, const float* inv_freq, StreamHandle stream) {
    if (rows == 0) return 0;
    RopeKernel<<<static_cast<unsigned>(rows), RowThreads(num_heads * head_dim / 2), 0, stream>>>(
        x, row_stride, positions, num_heads, head_dim, inv_freq);
    return LastError();
}

int LaunchSiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out,
                  StreamHandle stream) {
    if (rows * dim == 0) return 0;
    SiluMulKernel<<<GridFor(rows * dim, 256), 256, 0, stream>>>(gate_up, rows, dim, out);
    return LastError();
}

int LaunchGeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out,
                      StreamHandle stream) {
    if (rows * dim == 0) return 0;
    GeluTanhMulKernel<<<GridFor(rows * dim, 256), 256, 0, stream>>>(gate_up, rows, dim, out);
    return LastError();
}

int LaunchAddBias(float* x, const float* bias, int64_t rows, int64_t dim, StreamHandle stream) {
    if (rows * dim == 0) return 0;
    AddBiasKernel<<<GridFor(rows * dim, 256), 256, 0, stream>>>(x, bias, rows, dim);
    return LastError();
}

int LaunchHeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                      int64_t head_dim, const float* weight, float eps, StreamHandle stream) {
    if (rows == 0 || num_heads == 0) return 0;
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(num_heads));
    HeadRmsNormKernel<<<grid, RowThreads(head_dim), 0, stream>>>(x, row_stride, head_dim, weight,
                                                                 eps);
    return LastError();
}

int LaunchScale(float* x, float s, int64_t n, StreamHandle stream) {
    if (n == 0) return 0;
    ScaleKernel<<<GridFor(n, 256), 256, 0, stream>>>(x, s, n);
    return LastError();
}

int LaunchF32ToBf16(const float* x, int64_t n, uint16_t* out, StreamHandle stream) {
    if (n == 0) return 0;
    F32ToBf16Kernel<<<GridFor(n, 256), 256, 0, stream>>>(x, n, out);
    return LastError();
}

int LaunchKvWrite(const cpu::PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                  const int64_t* slots, int64_t n, StreamHandle stream) {
    if (n == 0 || kv.num_kv_heads == 0) return 0;
    const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(kv.num_kv_heads), 2);
    const int threads = RowThreads(kv.head_dim);
    const KvArgs args = ToArgs(kv);
    switch (kv.storage) {
        case KvDtype::kFp32:
            KvWriteKernel<KvDtype::kFp32>
                <<<grid, threads, 0, stream>>>(args, k, v, row_stride, slots);
            break;
        case KvDtype::kFp16:
            KvWriteKernel<KvDtype::kFp16>
                <<<grid, threads, 0, stream>>>(args, k, v, row_stride, slots);
            break;
        case KvDtype::kBf16:
            KvWriteKernel<KvDtype::kBf16>
                <<<grid, threads, 0, stream>>>(args, k, v, row_stride, slots);
            break;
        case KvDtype::kFp8:
            KvWriteKernel<KvDtype::kFp8>
                <<<grid, threads, 0, stream>>>(args, k, v, row_stride, slots);
            break;
        case KvDtype::kInt8:
            KvWriteKernel<KvDtype::kInt8>
                <<<grid, threads, 0, stream>>>(args, k, v, row_stride, slots);
            break;
    }
    return LastError();
}

int LaunchPagedAttention(const float* q, int64_t q_stride, const cpu::PagedKvLayer& kv,
                         const cpu::PagedAttentionBatch& batch, float* out, int64_t num_heads,
                         const int32_t* kv_head_of_q, int num_splits, float* partials,
                         bool decode_only, StreamHandle stream) {
    if (batch.num_seqs == 0 || num_heads == 0) return 0;
    const AttnArgs a{MakePrefillArgs(q, q_stride, kv, batch, out, num_heads, kv_head_of_q),
                     num_splits, partials, decode_only};
    const dim3 grid(static_cast<unsigned>(batch.num_seqs), static_cast<unsigned>(kv.num_kv_heads),
                    static_cast<unsigned>(num_splits));
    const size_t shared = static_cast<size_t>(AttentionSharedBytes(kv.head_dim));
    switch (kv.storage) {
        case KvDtype::kFp32:
            PagedAttentionKernel<KvDtype::kFp32><<<grid, kAttnThreads, shared, stream>>>(a);
            break;
        case KvDtype::kFp16:
            PagedAttentionKernel<KvDtype::kFp16><<<grid, kAttnThreads, shared, stream>>>(a);
            break;
        case KvDtype::kBf16:
            PagedAttentionKernel<KvDtype::kBf16><<<grid, kAttnThreads, shared, stream>>>(a);
            break;
        case KvDtype::kFp8:
            PagedAttentionKernel<KvDtype::kFp8><<<grid, kAttnThreads, shared, stream>>>(a);
            break;
        case KvDtype::kInt8:
            PagedAttentionKernel<KvDtype::kInt8><<<grid, kAttnThreads, shared, stream>>>(a);
            break;
    }
    if (const int err = LastError(); err != 0 || num_splits == 1) return err;
    const dim3 merge_grid(static_cast<unsigned>(batch.num_seqs), static_cast<unsigned>(num_heads));
    MergeSplitsKernel<<<merge_grid, RowThreads(kv.head_dim), 0, stream>>>(
        batch.query_starts, partials, num_splits, num_heads, kv.head_dim, out);
    return LastError();
}

int LaunchCopyBlocks(void* pool, int64_t bytes_per_block, const int32_t* src_dst,
                     int64_t num_pairs, StreamHandle stream) {
    if (num_pairs == 0 || bytes_per_block == 0) return 0;
    const unsigned grid = static_cast<unsigned>(num_pairs);
    if (bytes_per_block % 16 == 0 && reinterpret_cast<uintptr_t>(pool) % 16 == 0) {
        CopyBlocksKernel<uint4><<<grid, 256, 0, stream>>>(static_cast<uint4*>(pool),
                                                          bytes_per_block / 16, src_dst);
    } else {
        CopyBlocksKernel<uint8_t><<<grid, 256, 0, stream>>>(static_cast<uint8_t*>(pool),
                                                            bytes_per_block, src_dst);
    }
    return LastError();
}

int LaunchGatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n, float* out,
                     StreamHandle stream) {
    if (n == 0) return 0;
    GatherRowsKernel<<<static_cast<unsigned>(n), RowThreads(dim), 0, stream>>>(x, dim, rows, out);
    return LastError();
}

}  // namespace kvshard::cuda
