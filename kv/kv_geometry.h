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
// of `num_layers` layers (every layer, or one KV cache group's). The planner's figures and the
// worker's pool (worker/kv_pool.h) both come from here, so they agree for every dtype.
struct KvGeometry {
    int64_t num_layers = 0;
    int64_t num_kv_heads = 0;  // held by this worker
    int64_t head_dim = 0;
    KvDtype dtype = KvDtype::kBf16;
    int64_t block_size = 16;

    // Every count positive; names the field and value.
    Status Validate() const;
    // K and V of one token in one layer: 2 x heads x KvRowBytes(dtype, head_dim), i.e.
    // 2 x heads x (head_dim x KvDtypeBytes + KvScaleBytes): the 8-bit dtypes' per-token-per-head
    // fp32 scales included, as the pools store them.
    int64_t BytesPerTokenPerLayer() const;
    int64_t BytesPerToken() const { return num_layers * BytesPerTokenPerLayer(); }
    // One block: all layers of `block_size` slots, one contiguous region (DESIGN.md "KV memory").
    int64_t BytesPerBlock() const { return BytesPerToken() * block_size; }
    std::string ToString() const;
};

// A half-open range of head indices [begin, end).
struct HeadRange {
    int64_t begin = 0;
    int64_t end = 0;
    int64_t size() const { return end - begin; }
    friend bool operator==(const HeadRange&, const HeadRange&) = default;
};

// The query heads rank `rank` of a tensor-parallel group of `tp` computes:
// [floor(rank·H/tp), floor((rank+1)·H/tp)), uneven splits allowed. REQUIRES: 0 <= rank < tp.
HeadRange QueryHeadRange(int64_t num_heads, int64_t tp, int64_t rank);

// The one rule for which KV heads a rank holds; the worker's shards (worker/shard.h), its KV
// handoff, serve's pool sizing and the planner all call it. A rank holds every KV head its query
// heads read: [q.begin / group, (q.end - 1) / group + 1), group = num_heads / num_kv_heads. So
// with kv heads a multiple of tp it is the even split [r·kv/tp, (r+1)·kv/tp); with tp a multiple
// of kv heads each rank holds one head, r / (tp / kv), replicated on tp / kv consecutive ranks;
// and a KV head whose group of query heads is split between ranks (SmolLM2: 9 query heads, 3 KV
// heads, tp 2) is held by both. InvalidArgument naming the numbers: non-positive counts,
// num_heads not a multiple of num_kv_heads, rank outside [0, tp), tp > num_heads (a rank without
// a query head).
Result<HeadRange> LocalKvHeadRange(int64_t num_heads, int64_t num_kv_heads, int64_t tp,
                                   int64_t rank);
// The most KV heads one rank holds (what every rank's pool is sized for), or the error above.
Result<int64_t> MaxLocalKvHeads(int64_t num_heads, int64_t num_kv_heads, int64_t tp);
// The planner's stricter requirement (GPU engines shard KV heads evenly): kv heads a multiple of
// tp, or tp a multiple of kv heads; InvalidArgument naming both numbers otherwise. Then every rank
// holds the same number of heads.
Status CheckEvenKvHeadSplit(int64_t num_kv_heads, int64_t tp);
// The KV heads of each rank of an even split: CheckEvenKvHeadSplit, then MaxLocalKvHeads.
Result<int64_t> LocalKvHeads(int64_t num_heads, int64_t num_kv_heads, int64_t tp);

// The geometry of every worker of a `tp`-way group running `spec` (an even split: LocalKvHeads).
Result<KvGeometry> MakeKvGeometry(const ModelSpec& spec, int64_t tp, KvDtype dtype,
                                  int64_t block_size);

}  // namespace kvshard::kv
