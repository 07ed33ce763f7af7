// KvGeometry: how many bytes the KV cache of one worker takes per token and per block, and which
// KV heads each rank of a tensor-parallel group holds. The worker's KV pool is sized from these
// numbers, and the capacity planner (kv/capacity_planner.h) reports the same ones.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/kv_dtype.h"
#include "common/status.h"
#include "config/model_spec.h"

namespace kvshard::kv {

// The KV of one worker: its `num_kv_heads` heads (after tensor-parallel splitting or replication)
// of every layer.
struct KvGeometry {
    int64_t num_layers = 0;
    int64_t num_kv_heads = 0;  // held by this worker
    int64_t head_dim = 0;
    int64_t dtype_bytes = 2;
    int64_t scale_bytes = 0;  // per token, per head, for each of K and V (KvScaleBytes)
    int64_t block_size = 16;

    // Every field positive (scale_bytes >= 0); names the field and value.
    Status Validate() const;
    // K and V of one token in one layer: 2 x heads x (head_dim x dtype_bytes + scale_bytes).
    int64_t BytesPerTokenPerLayer() const;
    int64_t BytesPerToken() const { return num_layers * BytesPerTokenPerLayer(); }
    // One block: all layers of `block_size` slots, one contiguous region (DESIGN.md "KV memory").
    int64_t BytesPerBlock() const { return BytesPerToken() * block_size; }
    std::string ToString() const;
};

// A half-open range of KV head indices [begin, end).
struct HeadRange {
    int64_t begin = 0;
    int64_t end = 0;
    int64_t size() const { return end - begin; }
    friend bool operator==(const HeadRange&, const HeadRange&) = default;
};

// The KV heads rank `rank` of a tensor-parallel group of `tp` holds. tp <= kv heads: an even split,
// kv_heads / tp heads each (kv_heads must be a multiple of tp). tp > kv heads: each rank holds one
// head, replicated on tp / kv_heads consecutive ranks (tp must be a multiple of kv_heads).
// InvalidArgument naming the numbers otherwise.
Result<HeadRange> LocalKvHeadRange(int64_t num_kv_heads, int64_t tp, int64_t rank);
// The number of KV heads each rank holds (the same on every rank), or the error above.
Result<int64_t> LocalKvHeads(int64_t num_kv_heads, int64_t tp);

// The geometry of every worker of a `tp`-way group running `spec`.
Result<KvGeometry> MakeKvGeometry(const ModelSpec& spec, int64_t tp, KvDtype dtype,
                                  int64_t block_size);

}  // namespace kvshard::kv
