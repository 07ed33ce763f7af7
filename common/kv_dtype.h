// KvDtype: the one spelling of "how K and V are stored", shared by the config (kv_cache.dtype), the
// capacity planner and KV geometry (kv/), the paged attention kernels and pools (kernels/,
// worker/) and the KV wire (comm/, which maps it to explicit byte codes: comm/kv_transport.h).
// "auto" is not a dtype: it is a config-level choice (ServerConfig's kv_cache.dtype is an
// std::optional<KvDtype>, empty for auto) resolved by whoever builds the pools.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace kvshard {

// Every dtype is stored by the paged pools of the CPU and CUDA backends (kernels/paged_attention.h)
// and sized by the capacity planner, with the same bytes (KvRowBytes).
enum class KvDtype { kFp32, kFp16, kBf16, kFp8, kInt8 };

// "fp32", "fp16", "bf16", "fp8", "int8".
std::string_view KvDtypeName(KvDtype dtype);
// Accepts the names above and fp32|float32, fp16|float16, bf16|bfloat16, fp8|fp8_e4m3; any other
// name is InvalidArgument listing the accepted ones.
Result<KvDtype> ParseKvDtype(std::string_view name);
// Bytes of one stored element: 4, 2, 2, 1, 1.
int64_t KvDtypeBytes(KvDtype dtype);
// Scale bytes per token, per KV head, for each of K and V: 4 for the 8-bit dtypes (int8 and fp8
// e4m3 keep one fp32 scale per token per head), 0 for fp32, fp16 and bf16.
int64_t KvScaleBytes(KvDtype dtype);
// Whether the paged pools, and so the KV wire that copies them, keep those scales:
// KvScaleBytes(dtype) > 0.
bool KvPoolHasScales(KvDtype dtype);
// The one formula of KV bytes: one token's row of `width` elements (one KV head of K or of V, or
// an MLA latent), width × KvDtypeBytes + KvScaleBytes. kv::KvGeometry (the planner, the worker's
// pool sizing) and the pools' layout (cpu::PagedLayerBytes) are built on it.
int64_t KvRowBytes(KvDtype dtype, int64_t width);

}  // namespace kvshard
