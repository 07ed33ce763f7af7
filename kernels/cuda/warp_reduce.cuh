// Warp-level reductions shared by the kernels of kernels/cuda/ (device code only).
#pragma once

namespace kvshard::cuda {

constexpr int kWarpSize = 32;

// Every lane gets the sum (max) of `v` over the warp's 32 lanes.
__device__ inline float WarpSum(float v) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

__device__ inline float WarpMax(float v) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

}  // namespace kvshard::cuda
