// Plain ids and ops shared by the logical KV layer (kv/), the plans it feeds (comm/'s StepPlan) and
// the worker that executes them. In common/ (namespace kv) so that comm/ needs no arrow to kv/
// (DESIGN.md: comm includes common only).
#pragma once

#include <cstdint>

namespace kvshard::kv {

// A physical KV block: `block_size` token slots for every layer of one worker's KV heads. The
// same id names the same slots on every rank of an instance.
using BlockId = int32_t;
inline constexpr BlockId kNoBlock = -1;

// A sequence (one request, or one of its forks) as the block manager knows it.
using SeqId = int64_t;

// The most KV cache groups (kv/kv_cache_groups.h) a model may have: a block table each.
inline constexpr int64_t kMaxKvCacheGroups = 1024;

// Copy the whole contents of block `src_block` (every layer slot of the block, K and V; a block
// belongs to one KV cache group at a time) to `dst_block`. The worker executes it before it writes
// the KV of the step that carries it (copy-on-write of a shared partial block). The one copy op
// of kv/, the StepPlan and the worker.
struct CopyOp {
    BlockId src_block = kNoBlock;
    BlockId dst_block = kNoBlock;
    friend bool operator==(const CopyOp&, const CopyOp&) = default;
};

}  // namespace kvshard::kv
