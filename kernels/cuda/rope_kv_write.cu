// RoPE of a step's q and k fused with the KV write (kernels/cuda/backend_kernels.h
// LaunchRopeKvWrite): one kernel where the unfused path takes three (two RopeKernel launches and
// KvWriteKernel). The rotation is RopeKernel's arithmetic and the store is KvWriteKernel's
// (StoreKvHead), so the results are the unfused ones.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/backend_kernels.h"
#include "kernels/cuda/kv_tile.cuh"
#include "kernels/cuda/launch_math.h"

namespace kvshard::cuda {
namespace {

// Grid (rows, num_heads + 2 × num_kv_heads): y < num_heads rotates query head y of row x in
// place; the next num_kv_heads rotate key head y - num_heads in place and store it at the row's
// slot; the last num_kv_heads store value head y - num_heads - num_kv_heads. A row whose slot is
// negative (a padded decode row) is rotated but not stored.
template <KvDtype kStorage>
__global__ void RopeKvWriteKernel(float* q, float* k, const float* v, int64_t row_stride,
                                  const int32_t* positions, const int64_t* slots,
                                  int64_t num_heads, const float* inv_freq, KvArgs kv) {
    const int64_t r = blockIdx.x, y = blockIdx.y;
    const int64_t hd = kv.head_dim, half = hd / 2;
    const bool is_q = y < num_heads;
    const bool is_k = !is_q && y < num_heads + kv.num_kv_heads;
    if (is_q || is_k) {
        float* x = (is_q ? q + y * hd : k + (y - num_heads) * hd) + r * row_stride;
        const float pos = static_cast<float>(positions[r]);
        for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
            const float angle = pos * inv_freq[i];
            const float c = cosf(angle), s = sinf(angle);
            const float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = a * c - b * s;
            x[2 * i + 1] = a * s + b * c;
        }
        if (is_q) return;
        __syncthreads();  // the head's rotated elements, written by other threads, are read below
    }
    const int64_t slot = slots[r];
    if (slot < 0) return;
    const int64_t h = is_k ? y - num_heads : y - num_heads - kv.num_kv_heads;
    const float* src = (is_k ? k : v) + r * row_stride + h * hd;
    uint8_t* dst = kv.base + KvElementOffset(kv.block_stride, is_k ? kv.k_offset : kv.v_offset,
                                             kv.block_size, hd, KvElementBytes(kStorage), slot,
                                             h, 0);
    StoreKvHead<kStorage>(src, hd, dst, KvScaleAt<kStorage>(kv, !is_k, slot, h));
}

int Threads(int64_t head_dim) {
    int t = kWarpSize;
    while (t < 256 && t < head_dim) t *= 2;
    return t;
}

}  // namespace

int LaunchRopeKvWrite(float* q, float* k, const float* v, int64_t row_stride,
                      const int32_t* positions, const int64_t* slots, int64_t rows,
                      int64_t num_heads, const float* inv_freq, const cpu::PagedKvLayer& kv,
                      StreamHandle stream) {
    if (rows == 0 || num_heads + kv.num_kv_heads == 0) return 0;
    const dim3 grid(static_cast<unsigned>(rows),
                    static_cast<unsigned>(num_heads + 2 * kv.num_kv_heads));
    const int threads = Threads(kv.head_dim);
    const KvArgs args = ToArgs(kv);
    switch (kv.storage) {
        case KvDtype::kFp32:
            RopeKvWriteKernel<KvDtype::kFp32><<<grid, threads, 0, stream>>>(
                q, k, v, row_stride, positions, slots, num_heads, inv_freq, args);
            break;
        case KvDtype::kFp16:
            RopeKvWriteKernel<KvDtype::kFp16><<<grid, threads, 0, stream>>>(
                q, k, v, row_stride, positions, slots, num_heads, inv_freq, args);
            break;
        case KvDtype::kBf16:
            RopeKvWriteKernel<KvDtype::kBf16><<<grid, threads, 0, stream>>>(
                q, k, v, row_stride, positions, slots, num_heads, inv_freq, args);
            break;
        case KvDtype::kFp8:
            RopeKvWriteKernel<KvDtype::kFp8><<<grid, threads, 0, stream>>>(
                q, k, v, row_stride, positions, slots, num_heads, inv_freq, args);
            break;
        case KvDtype::kInt8:
            RopeKvWriteKernel<KvDtype::kInt8><<<grid, threads, 0, stream>>>(
                q, k, v, row_stride, positions, slots, num_heads, inv_freq, args);
            break;
    }
    return static_cast<int>(cudaGetLastError());
}

}  // namespace kvshard::cuda
