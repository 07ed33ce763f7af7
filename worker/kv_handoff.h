// KV handoff between instances (disaggregated prefill/decode): which KV heads each rank of the
// sending instance sends to each rank of the receiving one, and packing pool blocks into KvPieces
// (comm/kv_transport.h) and back.
//
// Re-sharding: a sending instance of tp S and a receiving one of tp D hold the model's KV heads
// split by worker/shard.h. Receiving rank d needs its heads [a_d, b_d); each global KV head is
// sent by its owner, the lowest sending rank that holds it (a head held by two ranks, as with the
// default model's 9 query / 3 KV heads at tp 2, is computed identically by both). So rank s sends
// to rank d the heads owned(s) ∩ [a_d, b_d) — one contiguous range, possibly empty — and every
// head a receiver needs arrives exactly once, for any S and D.
#pragma once

#include <cstdint>
#include <span>

#include "comm/kv_transport.h"
#include "common/status.h"
#include "config/model_spec.h"
#include "worker/kv_pool.h"
#include "worker/shard.h"

namespace kvshard {

// The global KV heads rank `src_rank` of a tp-`src_tp` instance sends to rank `dst_rank` of a
// tp-`dst_tp` instance (empty when none). REQUIRES: valid tp for the spec on both sides.
IndexRange KvHeadsToSend(const ModelSpec& spec, int src_rank, int src_tp, int dst_rank, int dst_tp);

// What a rank's pool can receive (KvTransport::SetReceiveGeometry): its layers, block size, head
// dim, dtype and blocks, and the global KV heads the rank holds.
KvReceiveGeometry ReceiveGeometryOf(const KvPool& pool, const ShardLayout& layout);

// KV cache groups: a handoff of the first `num_tokens` positions carries, of a group's table, the
// entries from FirstHandoffEntry (the first block a query at position num_tokens or later reads
// through the group's `window`; 0 without a window) to ceil(num_tokens / block_size). Both sides
// compute the same range, so the entries before it (released by the window: kv::kNoBlock) are
// neither sent nor received. The same rule as kv::BlockManager's window release.
int64_t FirstHandoffEntry(int64_t num_tokens, int64_t block_size, int64_t window);

// Packs layers [layer_begin, layer_end) (of one KV cache group: `blocks` are that group's) of
// global KV heads `heads` (a subset of layout.kv_heads)
// of `blocks` from `pool` into `out`, reusing its buffer (a fresh multi-MB buffer per piece costs
// page faults and zero-filling comparable to the copy itself). REQUIRES: every block valid.
void PackKvPiece(const KvPool& pool, const ShardLayout& layout, uint64_t transfer_id,
                 std::span<const int32_t> blocks, int64_t layer_begin, int64_t layer_end,
                 IndexRange heads, KvPiece* out);

// Writes `piece` into `blocks` of `pool` (blocks[i] receives the piece's i-th block; a negative
// entry skips that block: the receiver already holds it, e.g. from its prefix cache). The piece's
// layers are of one KV cache group, whose blocks `blocks` are.
// InvalidArgument, before writing anything, when the piece does not fit: block count, block size,
// head_dim, dtype, layers or heads outside this rank's.
Status UnpackKvPiece(const KvPiece& piece, KvPool& pool, const ShardLayout& layout,
                     std::span<const int32_t> blocks);

}  // namespace kvshard
