// Tensor-parallel sharding of a Llama model: which query heads, KV heads, MLP columns and
// vocabulary rows rank r of a `tp`-rank instance holds (DESIGN.md "Tensor-parallel rules").
//
//   query heads  [floor(r·H/tp), floor((r+1)·H/tp))      H = num_heads; uneven splits allowed
//   KV heads     [q_begin / group, (q_end - 1) / group + 1)   group = H / num_kv_heads
//                (both by kv/kv_geometry.h, the one rule for which heads a rank holds)
//   MLP columns  [f_r, f_{r+1}), f_r = floor(r·F/tp) rounded down to a multiple of 32, f_tp = F
//   vocabulary   [floor(r·V/tp), floor((r+1)·V/tp))      embedding rows and classifier rows
//
// A rank holds every KV head its query heads read. When a KV head's group of query heads is split
// between ranks (SmolLM2: 9 query heads, 3 KV heads, tp 2), both ranks hold that KV head and
// compute it; when tp > num_kv_heads the KV heads are replicated the same way. Deviation from
// DESIGN.md, which refuses indivisible head counts: the default model must run at tp 2. Only
// tp > num_heads (a rank without a query head) is refused.
//
// MLP split points are multiples of kColumnAlign (32, the block of GGUF's Q types), so a column
// slice of a quantized ffn_down row is whole blocks; the same rule for float tensors keeps one
// layout whatever the file's types.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/model_spec.h"

namespace kvshard {

struct ShardSpec {
    int rank = 0;
    int tp = 1;
};

// [begin, end) of some index space.
struct IndexRange {
    int64_t begin = 0;
    int64_t end = 0;
    int64_t size() const { return end - begin; }
    bool Contains(int64_t i) const { return i >= begin && i < end; }
    friend bool operator==(const IndexRange&, const IndexRange&) = default;
};

// The slices of one rank, computed once from the spec (MakeShardLayout).
struct ShardLayout {
    static constexpr int64_t kColumnAlign = 32;

    ShardSpec shard;
    IndexRange q_heads;   // global query head ids
    IndexRange kv_heads;  // global KV head ids
    IndexRange ffn;       // MLP intermediate columns
    IndexRange vocab;     // token ids whose embedding and classifier rows this rank holds
    // ceil(V / tp): every rank's vocabulary slice padded to this many logits for AllGather.
    int64_t vocab_padded = 0;
    // For each local query head, its KV head as an index into this rank's KV heads.
    std::vector<int32_t> kv_head_of_q;

    int64_t num_q_heads() const { return q_heads.size(); }
    int64_t num_kv_heads() const { return kv_heads.size(); }
    std::string ToString() const;
};

// MLP columns and vocabulary of rank `rank` among `tp` (pure functions of the numbers, so any
// rank can compute another's slices); query and KV heads are kv::QueryHeadRange and
// kv::LocalKvHeadRange (kv/kv_geometry.h), the one rule every module uses.
IndexRange FfnRange(int64_t ffn_size, int rank, int tp);
IndexRange VocabRange(int64_t vocab_size, int rank, int tp);

// InvalidArgument, naming the numbers, when tp < 1, rank outside [0, tp) or tp > num_heads.
// REQUIRES: spec.Validate() is OK.
Result<ShardLayout> MakeShardLayout(const ModelSpec& spec, const ShardSpec& shard);

}  // namespace kvshard
