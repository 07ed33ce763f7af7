#include "worker/kv_handoff.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "common/check.h"

namespace kvshard {
namespace {

IndexRange KvHeadsOf(const ModelSpec& spec, int rank, int tp) {
    Result<ShardLayout> layout = MakeShardLayout(spec, {.rank = rank, .tp = tp});
    KV_CHECK(layout.ok()) << layout.status().ToString();
    return layout->kv_heads;
}

// Byte offsets of the four parts of one layer inside a block, per head, for a pool's geometry.
struct LayerParts {
    int64_t k = 0, v = 0, k_scale = 0, v_scale = 0;  // offsets of head 0 of each part
    int64_t data_bytes_per_head = 0;                 // block_size × head_dim × element bytes
    int64_t scale_bytes_per_head = 0;                // block_size × 4, or 0 for fp32
};

LayerParts PartsOf(const KvPool& pool, int64_t layer) {
    const KvPoolConfig& c = pool.config();
    const cpu::PagedKvLayer l = cpu::MakePagedKvLayer(
        nullptr, 0, pool.SlotOfLayer(layer), c.storage, c.block_size, c.num_kv_heads, c.head_dim);
    LayerParts p;
    p.k = l.k_offset;
    p.v = l.v_offset;
    p.k_scale = l.k_scale_offset;
    p.v_scale = l.v_scale_offset;
    p.data_bytes_per_head = c.block_size * c.head_dim * KvDtypeBytes(c.storage);
    p.scale_bytes_per_head = KvPoolHasScales(c.storage) ? c.block_size * int64_t(sizeof(float)) : 0;
    return p;
}

// Calls fn(pool_offset, piece_offset, bytes) for every contiguous run of one block-layer: K, V
// and (8-bit) the two scale arrays of heads [h0, h0 + n) (local indices).
template <typename Fn>
void ForEachRun(const LayerParts& p, int64_t h0, int64_t n, Fn&& fn) {
    int64_t at = 0;
    for (int64_t part_offset : {p.k, p.v}) {
        fn(part_offset + h0 * p.data_bytes_per_head, at, n * p.data_bytes_per_head);
        at += n * p.data_bytes_per_head;
    }
    if (p.scale_bytes_per_head == 0) return;
    for (int64_t part_offset : {p.k_scale, p.v_scale}) {
        fn(part_offset + h0 * p.scale_bytes_per_head, at, n * p.scale_bytes_per_head);
        at += n * p.scale_bytes_per_head;
    }
}

}  // namespace

IndexRange KvHeadsToSend(const ModelSpec& spec, int src_rank, int src_tp, int dst_rank,
                         int dst_tp) {
    IndexRange owned = KvHeadsOf(spec, src_rank, src_tp);
    if (src_rank > 0)
        owned.begin = std::max(owned.begin, KvHeadsOf(spec, src_rank - 1, src_tp).end);
    const IndexRange wanted = KvHeadsOf(spec, dst_rank, dst_tp);
    IndexRange out{std::max(owned.begin, wanted.begin), std::min(owned.end, wanted.end)};
    if (out.end < out.begin) out.end = out.begin;
    return out;
}

Result<std::vector<KvReshardMessage>> KvReshardPlan(const ModelSpec& spec, int src_tp, int dst_tp) {
    std::vector<ShardLayout> src, dst;
    for (int r = 0; r < src_tp; ++r) {
        KV_ASSIGN_OR_RETURN(ShardLayout l, MakeShardLayout(spec, {.rank = r, .tp = src_tp}));
        src.push_back(std::move(l));
    }
    for (int r = 0; r < dst_tp; ++r) {
        KV_ASSIGN_OR_RETURN(ShardLayout l, MakeShardLayout(spec, {.rank = r, .tp = dst_tp}));
        dst.push_back(std::move(l));
    }
    // By (sender, receiver): the heads, in increasing order, merged when consecutive.
    std::vector<KvReshardMessage> out;
    for (int64_t h = 0; h < spec.num_kv_heads; ++h) {
        int owner = -1;
        for (int s = 0; s < src_tp && owner < 0; ++s) {
            if (src[static_cast<size_t>(s)].kv_heads.Contains(h)) owner = s;
        }
        KV_CHECK(owner >= 0) << "KV head " << h << " held by no rank of tp " << src_tp;
        for (int d = 0; d < dst_tp; ++d) {
            if (!dst[static_cast<size_t>(d)].kv_heads.Contains(h)) continue;
            auto it = std::find_if(out.begin(), out.end(), [&](const KvReshardMessage& m) {
                return m.src_rank == owner && m.dst_rank == d;
            });
            if (it == out.end()) {
                out.push_back({.src_rank = owner, .dst_rank = d, .heads = {h, h + 1}});
            } else {
                KV_CHECK(it->heads.end == h) << "heads of one pair not consecutive";
                it->heads.end = h + 1;
            }
        }
    }
    std::sort(out.begin(), out.end(), [](const KvReshardMessage& a, const KvReshardMessage& b) {
        return a.src_rank != b.src_rank ? a.src_rank < b.src_rank : a.dst_rank < b.dst_rank;
    });
    return out;
}

int64_t FirstHandoffEntry(int64_t num_tokens, int64_t block_size, int64_t window) {
    if (window <= 0) return 0;
    const int64_t first_read = num_tokens - window + 1;
    return first_read <= 0 ? 0 : first_read / block_size;
}

KvReceiveGeometry ReceiveGeometryOf(const KvPool& pool, const ShardLayout& layout) {
    const KvPoolConfig& c = pool.config();
    return {.num_layers = static_cast<int32_t>(c.num_layers),
            .head_begin = static_cast<int32_t>(layout.kv_heads.begin),
            .head_end = static_cast<int32_t>(layout.kv_heads.end),
            .block_size = static_cast<int32_t>(c.block_size),
            .head_dim = static_cast<int32_t>(c.head_dim),
            .dtype = c.storage,
            .num_blocks = c.num_blocks};
}

std::vector<KvCopyRun> KvCopyRuns(const KvPool& pool, const ShardLayout& layout,
                                  std::span<const int32_t> blocks, int64_t layer_begin,
                                  int64_t layer_end, IndexRange heads) {
    KV_CHECK(heads.begin >= layout.kv_heads.begin && heads.end <= layout.kv_heads.end &&
             heads.size() > 0)
        << "heads [" << heads.begin << ", " << heads.end << ") vs " << layout.ToString();
    const int64_t h0 = heads.begin - layout.kv_heads.begin;
    std::vector<KvCopyRun> runs;
    int64_t piece_at = 0;
    for (int32_t block : blocks) {
        const int64_t block_at = int64_t{block} * pool.bytes_per_block();
        for (int64_t l = layer_begin; l < layer_end; ++l) {
            const LayerParts parts = PartsOf(pool, l);
            const int64_t layer_bytes =
                2 * heads.size() * (parts.data_bytes_per_head + parts.scale_bytes_per_head);
            if (block >= 0) {
                KV_CHECK(pool.ValidBlock(block)) << "block " << block;
                ForEachRun(parts, h0, heads.size(), [&](int64_t pool_at, int64_t at, int64_t n) {
                    const KvCopyRun run{block_at + pool_at, piece_at + at, n};
                    if (!runs.empty()) {
                        KvCopyRun& last = runs.back();
                        if (last.pool_offset + last.bytes == run.pool_offset &&
                            last.piece_offset + last.bytes == run.piece_offset) {
                            last.bytes += n;
                            return;
                        }
                    }
                    runs.push_back(run);
                });
            }
            piece_at += layer_bytes;
        }
    }
    return runs;
}

std::vector<KvPoolCopy> KvPoolToPoolCopies(std::span<const KvCopyRun> from,
                                           std::span<const KvCopyRun> to) {
    std::vector<KvPoolCopy> out;
    size_t i = 0, j = 0;
    while (i < from.size() && j < to.size()) {
        const KvCopyRun& a = from[i];
        const KvCopyRun& b = to[j];
        const int64_t lo = std::max(a.piece_offset, b.piece_offset);
        const int64_t hi = std::min(a.piece_offset + a.bytes, b.piece_offset + b.bytes);
        if (lo < hi) {
            const KvPoolCopy c{.src_offset = a.pool_offset + (lo - a.piece_offset),
                               .dst_offset = b.pool_offset + (lo - b.piece_offset),
                               .bytes = hi - lo};
            if (!out.empty() && out.back().src_offset + out.back().bytes == c.src_offset &&
                out.back().dst_offset + out.back().bytes == c.dst_offset) {
                out.back().bytes += c.bytes;
            } else {
                out.push_back(c);
            }
        }
        if (a.piece_offset + a.bytes <= b.piece_offset + b.bytes) {
            ++i;
        } else {
            ++j;
        }
    }
    return out;
}

Status PackKvPiece(Backend& backend, const KvPool& pool, const ShardLayout& layout,
                   uint64_t transfer_id, std::span<const int32_t> blocks, int64_t layer_begin,
                   int64_t layer_end, IndexRange heads, KvPiece* out_piece) {
    const KvPoolConfig& c = pool.config();
    for (int32_t block : blocks) KV_CHECK(pool.ValidBlock(block)) << "block " << block;
    KvPiece& piece = *out_piece;
    piece.header = {.transfer_id = transfer_id,
                    .layer_begin = static_cast<int32_t>(layer_begin),
                    .layer_end = static_cast<int32_t>(layer_end),
                    .head_begin = static_cast<int32_t>(heads.begin),
                    .head_end = static_cast<int32_t>(heads.end),
                    .num_blocks = static_cast<int32_t>(blocks.size()),
                    .block_size = static_cast<int32_t>(c.block_size),
                    .head_dim = static_cast<int32_t>(c.head_dim),
                    .dtype = c.storage};
    piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
    const std::vector<KvCopyRun> runs =
        KvCopyRuns(pool, layout, blocks, layer_begin, layer_end, heads);
    if (runs.empty()) return Status::Ok();
    const uint8_t* base = pool.BlockData(0);
    uint8_t* out = piece.data.data();
    for (const KvCopyRun& r : runs) {
        KV_RETURN_IF_ERROR(backend.CopyToHost(out + r.piece_offset, base + r.pool_offset,
                                              static_cast<size_t>(r.bytes)));
    }
    return backend.Synchronize();
}

namespace {

// The fit checks of a piece (or of a peer copy described as one) against a receiving pool.
Status CheckFits(const KvPieceHeader& h, const KvPool& pool, const ShardLayout& layout,
                 std::span<const int32_t> blocks) {
    const KvPoolConfig& c = pool.config();
    auto mismatch = [&](const std::string& what, int64_t got, int64_t want) {
        return InvalidArgument("KV piece of transfer " + std::to_string(h.transfer_id) + ": " +
                               what + " " + std::to_string(got) + ", this worker has " +
                               std::to_string(want));
    };
    if (h.num_blocks != static_cast<int64_t>(blocks.size()))
        return mismatch("blocks", h.num_blocks, int64_t(blocks.size()));
    if (h.block_size != c.block_size) return mismatch("block_size", h.block_size, c.block_size);
    if (h.head_dim != c.head_dim) return mismatch("head_dim", h.head_dim, c.head_dim);
    if (h.dtype != c.storage)
        return mismatch("dtype", KvDtypeWireCode(h.dtype), KvDtypeWireCode(c.storage));
    if (h.layer_end > c.num_layers) return mismatch("layer_end", h.layer_end, c.num_layers);
    if (h.head_begin < layout.kv_heads.begin || h.head_end > layout.kv_heads.end) {
        return InvalidArgument("KV piece of transfer " + std::to_string(h.transfer_id) +
                               ": KV heads [" + std::to_string(h.head_begin) + ", " +
                               std::to_string(h.head_end) + ") are not all held by this worker (" +
                               layout.ToString() + ")");
    }
    for (int32_t block : blocks) {
        if (block >= 0 && !pool.ValidBlock(block))
            return InvalidArgument("block " + std::to_string(block) + " outside the pool");
    }
    return Status::Ok();
}

}  // namespace

Status UnpackKvPiece(Backend& backend, const KvPiece& piece, KvPool& pool,
                     const ShardLayout& layout, std::span<const int32_t> blocks) {
    KV_RETURN_IF_ERROR(ValidateKvPiece(piece));
    const KvPieceHeader& h = piece.header;
    KV_RETURN_IF_ERROR(CheckFits(h, pool, layout, blocks));
    const std::vector<KvCopyRun> runs = KvCopyRuns(pool, layout, blocks, h.layer_begin,
                                                   h.layer_end, {h.head_begin, h.head_end});
    if (runs.empty()) return Status::Ok();
    uint8_t* base = pool.MutableBlockData(0);
    const uint8_t* in = piece.data.data();
    for (const KvCopyRun& r : runs) {
        KV_RETURN_IF_ERROR(backend.CopyToDevice(base + r.pool_offset, in + r.piece_offset,
                                                static_cast<size_t>(r.bytes)));
    }
    return backend.Synchronize();
}

Result<int64_t> QueueKvPeerCopies(Backend& src, const KvPool& src_pool,
                                  const ShardLayout& src_layout,
                                  std::span<const int32_t> src_blocks, Backend& dst,
                                  KvPool& dst_pool, const ShardLayout& dst_layout,
                                  std::span<const int32_t> dst_blocks, int64_t layer_begin,
                                  int64_t layer_end, IndexRange heads) {
    auto* peer = dynamic_cast<PeerCopy*>(&dst);
    if (peer == nullptr || !peer->CanCopyFromPeer(src)) {
        return InvalidArgument("KV peer copy: the " + dst.Describe() +
                               " backend cannot copy from the " + src.Describe() + " backend");
    }
    const KvPoolConfig& sc = src_pool.config();
    if (layer_begin < 0 || layer_begin >= layer_end || layer_end > sc.num_layers) {
        return InvalidArgument("KV peer copy: layers [" + std::to_string(layer_begin) + ", " +
                               std::to_string(layer_end) + ") outside the sender's " +
                               std::to_string(sc.num_layers));
    }
    if (heads.size() <= 0 || heads.begin < src_layout.kv_heads.begin ||
        heads.end > src_layout.kv_heads.end) {
        return InvalidArgument("KV peer copy: KV heads [" + std::to_string(heads.begin) + ", " +
                               std::to_string(heads.end) + ") are not all held by the sender (" +
                               src_layout.ToString() + ")");
    }
    for (int32_t block : src_blocks) {
        if (!src_pool.ValidBlock(block))
            return InvalidArgument("KV peer copy: block " + std::to_string(block) +
                                   " outside the sender's pool");
    }
    // The receiver's checks are a piece's: the copy writes what that piece would.
    const KvPieceHeader as_piece{.layer_begin = static_cast<int32_t>(layer_begin),
                                 .layer_end = static_cast<int32_t>(layer_end),
                                 .head_begin = static_cast<int32_t>(heads.begin),
                                 .head_end = static_cast<int32_t>(heads.end),
                                 .num_blocks = static_cast<int32_t>(src_blocks.size()),
                                 .block_size = static_cast<int32_t>(sc.block_size),
                                 .head_dim = static_cast<int32_t>(sc.head_dim),
                                 .dtype = sc.storage};
    KV_RETURN_IF_ERROR(CheckFits(as_piece, dst_pool, dst_layout, dst_blocks));
    const std::vector<KvCopyRun> from =
        KvCopyRuns(src_pool, src_layout, src_blocks, layer_begin, layer_end, heads);
    const std::vector<KvCopyRun> to =
        KvCopyRuns(dst_pool, dst_layout, dst_blocks, layer_begin, layer_end, heads);
    const uint8_t* src_base = src_pool.BlockData(0);
    uint8_t* dst_base = dst_pool.MutableBlockData(0);
    int64_t bytes = 0;
    for (const KvPoolCopy& c : KvPoolToPoolCopies(from, to)) {
        KV_RETURN_IF_ERROR(peer->CopyFromPeer(dst_base + c.dst_offset, src, src_base + c.src_offset,
                                              static_cast<size_t>(c.bytes)));
        bytes += c.bytes;
    }
    return bytes;
}

Status CopyKvBetweenPools(Backend& src, const KvPool& src_pool, const ShardLayout& src_layout,
                          std::span<const int32_t> src_blocks, Backend& dst, KvPool& dst_pool,
                          const ShardLayout& dst_layout, std::span<const int32_t> dst_blocks,
                          int64_t layer_begin, int64_t layer_end, IndexRange heads) {
    KV_RETURN_IF_ERROR(src.Synchronize());  // the sender's step wrote the KV on its stream
    KV_ASSIGN_OR_RETURN(int64_t bytes,
                        QueueKvPeerCopies(src, src_pool, src_layout, src_blocks, dst, dst_pool,
                                          dst_layout, dst_blocks, layer_begin, layer_end, heads));
    if (bytes == 0) return Status::Ok();
    return dst.Synchronize();
}

}  // namespace kvshard
