// RMSNorm on the device: one thread block per row; the sum of squares is reduced with warp
// shuffles, then across warps through shared memory.
#include <limits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/warp_reduce.cuh"
#include "kernels/cuda_ops.h"

namespace kvshard::cuda {
namespace {

constexpr int kMaxThreads = 256;

// Every thread of the block gets the sum of `v` over the block. REQUIRES: blockDim.x is a
// multiple of the warp size.
__device__ float BlockSum(float v) {
    __shared__ float warp_sums[kMaxThreads / kWarpSize];
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    v = WarpSum(v);
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    v = lane < num_warps ? warp_sums[lane] : 0.0f;
    return WarpSum(v);
}

__global__ void RmsNormKernel(const float* x, const float* __restrict__ weight, float* out,
                              int64_t dim, float eps) {
    // x and out may alias (in place): every read of x happens before the barrier in BlockSum,
    // every write after it, and each element is written by the thread that read it.
    const float* xr = x + static_cast<int64_t>(blockIdx.x) * dim;
    float* outr = out + static_cast<int64_t>(blockIdx.x) * dim;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = BlockSum(ss);
    // Correctly rounded sqrt and division (nvcc's defaults), as the CPU op computes it.
    const float scale = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) outr[i] = xr[i] * scale * weight[i];
}

}  // namespace

void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps,
             StreamHandle stream) {
    KV_CHECK(rows >= 0 && rows <= std::numeric_limits<int>::max()) << "rows=" << rows;
    KV_CHECK_GT(dim, 0);
    if (rows == 0) return;
    int threads = kWarpSize;
    while (threads < kMaxThreads && threads < dim) threads *= 2;
    RmsNormKernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, weight, out, dim, eps);
    KV_CUDA_CHECK_LAUNCH();
}

}  // namespace kvshard::cuda
