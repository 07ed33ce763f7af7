// The paged KV pool as the device kernels of kernels/cuda/ read it: the layer's geometry and a
// K/V tile loader that decodes each storage into fp32 shared memory (device code only).
#pragma once

#include <cstdint>

#include "common/kv_dtype.h"
#include "kernels/cuda/launch_math.h"
#include "kernels/cuda/warp_reduce.cuh"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {

struct KvArgs {
    uint8_t* base;
    int64_t block_stride, k_offset, v_offset, k_scale_offset, v_scale_offset;
    int64_t block_size, num_kv_heads, head_dim;
};

inline KvArgs ToArgs(const cpu::PagedKvLayer& kv) {
    return {kv.base,          kv.block_stride,   kv.k_offset,   kv.v_offset,
            kv.k_scale_offset, kv.v_scale_offset, kv.block_size, kv.num_kv_heads,
            kv.head_dim};
}

// The kernels are instantiated per storage dtype (template <KvDtype>): fp32, the 16-bit
// formats (no scale) and the 8-bit ones (with a per-token-per-head scale).
__host__ __device__ constexpr bool Is16Bit(KvDtype s) {
    return s == KvDtype::kBf16 || s == KvDtype::kFp16;
}

// Every thread gets the max of `v` over the block. REQUIRES: blockDim.x a multiple of 32; called
// by every thread.
__device__ inline float BlockMax(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    v = WarpMax(v);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < static_cast<int>(blockDim.x / kWarpSize) ? partial[lane] : -INFINITY;
    return WarpMax(v);
}

// Where the scale of (kv_head, slot_id) of K (or V) goes: null for storage without scales.
template <KvDtype kStorage>
__device__ float* KvScaleAt(const KvArgs& kv, bool v, int64_t slot_id, int64_t kv_head) {
    if constexpr (kStorage == KvDtype::kInt8 || kStorage == KvDtype::kFp8) {
        return reinterpret_cast<float*>(
            kv.base + KvScaleOffset(kv.block_stride, v ? kv.v_scale_offset : kv.k_scale_offset,
                                    kv.block_size, slot_id, kv_head));
    }
    return nullptr;
}

// Stores one head of one row (`hd` floats at src) at dst in kStorage: fp32 as is, 16-bit rounded
// to nearest even, 8-bit quantized with the head's own scale (amax / 127 or / 448), which goes to
// *scale_dst. The arithmetic of cpu::PagedKvWrite. Called by every thread of the block.
template <KvDtype kStorage>
__device__ void StoreKvHead(const float* src, int64_t hd, uint8_t* dst, float* scale_dst) {
    if constexpr (kStorage == KvDtype::kFp32) {
        for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
            reinterpret_cast<float*>(dst)[d] = src[d];
        }
    } else if constexpr (Is16Bit(kStorage)) {
        for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
            reinterpret_cast<uint16_t*>(dst)[d] =
                kStorage == KvDtype::kBf16 ? Bf16Encode(src[d]) : Fp16Encode(src[d]);
        }
    } else {
        float amax = 0.0f;
        for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) amax = fmaxf(amax, fabsf(src[d]));
        amax = BlockMax(amax);
        const float scale = amax / (kStorage == KvDtype::kInt8 ? 127.0f : 448.0f);
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
            if constexpr (kStorage == KvDtype::kInt8) {
                reinterpret_cast<int8_t*>(dst)[d] = Int8Encode(src[d], inv);
            } else {
                dst[d] = Fp8E4M3Encode(src[d] * inv);
            }
        }
        if (threadIdx.x == 0) *scale_dst = scale;
    }
}

// The K (or V: `data_offset`, `scale_offset` of the layer's region) rows of a tile into shared
// memory, kAttnTileKeys rows TileRowFloats(head_dim) apart, rows from nt on zeroed. row_at[t] and
// scale_at[t] are the bytes from the pool's base to tile row t's head data and scale without the
// region offset (KvElementOffset / KvScaleOffset of its slot). Warp w copies rows w, w + 4, ...,
// its lanes along head_dim (coalesced). Called by every thread of the block.
template <KvDtype kStorage>
__device__ void LoadTile(const KvArgs& kv, int64_t data_offset, int64_t scale_offset,
                         const int64_t* row_at, const int64_t* scale_at, int nt, float* tile) {
    const int hd = static_cast<int>(kv.head_dim);
    const int row = static_cast<int>(TileRowFloats(hd));
    const int lane = threadIdx.x % kWarpSize;
    for (int t = threadIdx.x / kWarpSize; t < kAttnTileKeys; t += blockDim.x / kWarpSize) {
        float* dst = tile + t * row;
        if (t >= nt) {
            for (int d = lane; d < hd; d += kWarpSize) dst[d] = 0.0f;
            continue;
        }
        const uint8_t* src = kv.base + data_offset + row_at[t];
        if constexpr (kStorage == KvDtype::kFp32) {
            for (int d = lane; d < hd; d += kWarpSize) dst[d] = reinterpret_cast<const float*>(src)[d];
        } else if constexpr (Is16Bit(kStorage)) {
            const uint16_t* src16 = reinterpret_cast<const uint16_t*>(src);
            for (int d = lane; d < hd; d += kWarpSize) {
                dst[d] = kStorage == KvDtype::kBf16 ? Bf16Decode(src16[d]) : Fp16Decode(src16[d]);
            }
        } else {
            const float scale =
                *reinterpret_cast<const float*>(kv.base + scale_offset + scale_at[t]);
            for (int d = lane; d < hd; d += kWarpSize) {
                const float x = kStorage == KvDtype::kInt8
                                    ? static_cast<float>(static_cast<int8_t>(src[d]))
                                    : Fp8E4M3Decode(src[d]);
                dst[d] = x * scale;
            }
        }
    }
}

}  // namespace kvshard::cuda
