// KV handoff between instances (disaggregated prefill/decode): which KV heads each rank of the
// sending instance sends to each rank of the receiving one, and packing pool blocks into KvPieces
// (comm/kv_transport.h) and back.
//
// Pools live in backend memory (a GPU's, or host memory on the CPU backend), so packing and
// unpacking go through the Backend's copies: the sender copies the handed-over parts of its
// blocks into the piece (host memory) and the receiver copies the piece into its blocks — the
// host-staged handoff, which works for any backend and any transport. Each copy is one
// contiguous run, runs adjacent in both the pool and the piece merged (KvCopyRuns): a piece of
// all of a rank's heads is one copy per block (one per run of consecutive whole blocks), a piece
// of some heads two per block-layer (four with 8-bit scales).
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
#include <vector>

#include "comm/kv_transport.h"
#include "common/status.h"
#include "config/model_spec.h"
#include "worker/kv_pool.h"
#include "worker/shard.h"

namespace kvshard {

// The global KV heads rank `src_rank` of a tp-`src_tp` instance sends to rank `dst_rank` of a
// tp-`dst_tp` instance (empty when none). REQUIRES: valid tp for the spec on both sides.
IndexRange KvHeadsToSend(const ModelSpec& spec, int src_rank, int src_tp, int dst_rank, int dst_tp);

// One message of a handoff between a tp-`src_tp` sending instance and a tp-`dst_tp` receiving
// one: sending rank `src_rank` hands receiving rank `dst_rank` global KV heads `heads`.
struct KvReshardMessage {
    int src_rank = 0;
    int dst_rank = 0;
    IndexRange heads;
    friend bool operator==(const KvReshardMessage&, const KvReshardMessage&) = default;
};

// Every message of a handoff, ordered by src_rank, then dst_rank: the re-shard plan of a
// transport that pairs each send with a receive (NCCL point-to-point: a sending rank issues its
// messages in this order, a receiving rank its own, and NCCL matches a pair's in issue order).
// Worked out head by head from the two sides' layouts (each global KV head goes from its owner,
// the lowest sending rank holding it, to every receiving rank holding it; consecutive heads of one
// pair merged), so it agrees with KvHeadsToSend by construction of neither.
// InvalidArgument (MakeShardLayout's) for a tp the spec cannot split.
Result<std::vector<KvReshardMessage>> KvReshardPlan(const ModelSpec& spec, int src_tp, int dst_tp);

// What a rank's pool can receive (KvTransport::SetReceiveGeometry): its layers, block size, head
// dim, dtype and blocks, and the global KV heads the rank holds.
KvReceiveGeometry ReceiveGeometryOf(const KvPool& pool, const ShardLayout& layout);

// KV cache groups: a handoff of the first `num_tokens` positions carries, of a group's table, the
// entries from FirstHandoffEntry (the first block a query at position num_tokens or later reads
// through the group's `window`; 0 without a window) to ceil(num_tokens / block_size). Both sides
// compute the same range, so the entries before it (released by the window: kv::kNoBlock) are
// neither sent nor received. The same rule as kv::BlockManager's window release.
int64_t FirstHandoffEntry(int64_t num_tokens, int64_t block_size, int64_t window);

// One contiguous copy between a pool and a piece: `bytes` at `pool_offset` from the pool's first
// block and at `piece_offset` in the piece's payload.
struct KvCopyRun {
    int64_t pool_offset = 0;
    int64_t piece_offset = 0;
    int64_t bytes = 0;
    friend bool operator==(const KvCopyRun&, const KvCopyRun&) = default;
};

// The copies that move layers [layer_begin, layer_end) of global KV heads `heads` of `blocks`
// between `pool` and a piece laid out as comm/kv_transport.h says (blocks[i] is the piece's i-th
// block; a negative entry has no copies: its bytes in the piece are skipped), in piece order,
// runs adjacent in both merged. REQUIRES: the layers of one KV cache group, heads a subset of
// layout.kv_heads, every non-negative block valid.
std::vector<KvCopyRun> KvCopyRuns(const KvPool& pool, const ShardLayout& layout,
                                  std::span<const int32_t> blocks, int64_t layer_begin,
                                  int64_t layer_end, IndexRange heads);

// One copy from a sending pool to a receiving pool, offsets from each pool's first block.
struct KvPoolCopy {
    int64_t src_offset = 0;
    int64_t dst_offset = 0;
    int64_t bytes = 0;
    friend bool operator==(const KvPoolCopy&, const KvPoolCopy&) = default;
};

// The pool-to-pool copies that write what a piece would: `from` (the sender's KvCopyRuns) and
// `to` (the receiver's, for the same piece) both in piece order; each overlap of a run of one
// and a run of the other is a copy, copies adjacent on both sides merged. Bytes of the piece
// covered by only one side (a receiving block that is skipped) are not copied.
std::vector<KvPoolCopy> KvPoolToPoolCopies(std::span<const KvCopyRun> from,
                                           std::span<const KvCopyRun> to);

// Packs layers [layer_begin, layer_end) (of one KV cache group: `blocks` are that group's) of
// global KV heads `heads` (a subset of layout.kv_heads)
// of `blocks` from `pool` (memory of `backend`) into `out` through backend.CopyToHost, and waits
// for the copies (the step's writes queued before them are in). Reuses out's buffer (a fresh
// multi-MB buffer per piece costs page faults and zero-filling comparable to the copy itself).
// REQUIRES: every block valid. Errors: the backend's (a failed copy, a lost device).
Status PackKvPiece(Backend& backend, const KvPool& pool, const ShardLayout& layout,
                   uint64_t transfer_id, std::span<const int32_t> blocks, int64_t layer_begin,
                   int64_t layer_end, IndexRange heads, KvPiece* out);

// Writes `piece` into `blocks` of `pool` (memory of `backend`) through backend.CopyToDevice and
// waits for the copies, so the piece's buffer may be reused on return (blocks[i] receives the
// piece's i-th block; a negative entry skips that block: the receiver already holds it, e.g. from
// its prefix cache). The piece's layers are of one KV cache group, whose blocks `blocks` are.
// InvalidArgument, before writing anything, when the piece does not fit: block count, block size,
// head_dim, dtype, layers or heads outside this rank's. Otherwise the backend's errors.
Status UnpackKvPiece(Backend& backend, const KvPiece& piece, KvPool& pool,
                     const ShardLayout& layout, std::span<const int32_t> blocks);

// The in-process handoff between two backends without the host: layers [layer_begin, layer_end)
// of global KV heads `heads` of `src_blocks` of `src_pool` (memory of `src`) copied into
// `dst_blocks` of `dst_pool` (memory of `dst`, which copies from `src` through its PeerCopy,
// kernels/backend.h: cudaMemcpyPeerAsync between two GPUs of one process) — what a piece carrying
// them would write, with no piece. Waits for src's queued work first (the step that wrote the
// KV) and for the copies after. InvalidArgument, before copying anything, when the two pools'
// geometry differs (block size, head_dim, dtype, layers), `heads` are not held by both ranks, the
// block lists differ in length or name a block outside a pool, or `dst` cannot copy from `src`.
// CopyKvBetweenPools' checks and copies without its waits, for a caller that copies from several
// senders and waits once: REQUIRES src's writes of the blocks done (its Synchronize returned);
// the copies are queued on dst's stream, so the source blocks must stay unchanged and allocated
// until dst.Synchronize() returns. Returns the bytes queued.
Result<int64_t> QueueKvPeerCopies(Backend& src, const KvPool& src_pool,
                                  const ShardLayout& src_layout,
                                  std::span<const int32_t> src_blocks, Backend& dst,
                                  KvPool& dst_pool, const ShardLayout& dst_layout,
                                  std::span<const int32_t> dst_blocks, int64_t layer_begin,
                                  int64_t layer_end, IndexRange heads);
Status CopyKvBetweenPools(Backend& src, const KvPool& src_pool, const ShardLayout& src_layout,
                          std::span<const int32_t> src_blocks, Backend& dst, KvPool& dst_pool,
                          const ShardLayout& dst_layout, std::span<const int32_t> dst_blocks,
                          int64_t layer_begin, int64_t layer_end, IndexRange heads);

}  // namespace kvshard
