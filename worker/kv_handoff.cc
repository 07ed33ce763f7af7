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

void PackKvPiece(const KvPool& pool, const ShardLayout& layout, uint64_t transfer_id,
                 std::span<const int32_t> blocks, int64_t layer_begin, int64_t layer_end,
                 IndexRange heads, KvPiece* out_piece) {
    const KvPoolConfig& c = pool.config();
    KV_CHECK(heads.begin >= layout.kv_heads.begin && heads.end <= layout.kv_heads.end &&
             heads.size() > 0)
        << "heads [" << heads.begin << ", " << heads.end << ") vs " << layout.ToString();
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
    const int64_t layer_bytes = KvPieceLayerBytes(piece.header);
    const int64_t h0 = heads.begin - layout.kv_heads.begin;
    uint8_t* out = piece.data.data();
    for (int32_t block : blocks) {
        KV_CHECK(pool.ValidBlock(block)) << "block " << block;
        const uint8_t* src = pool.BlockData(block);
        for (int64_t l = layer_begin; l < layer_end; ++l) {
            ForEachRun(PartsOf(pool, l), h0, heads.size(),
                       [&](int64_t pool_at, int64_t piece_at, int64_t n) {
                           std::memcpy(out + piece_at, src + pool_at, static_cast<size_t>(n));
                       });
            out += layer_bytes;
        }
    }
}

Status UnpackKvPiece(const KvPiece& piece, KvPool& pool, const ShardLayout& layout,
                     std::span<const int32_t> blocks) {
    KV_RETURN_IF_ERROR(ValidateKvPiece(piece));
    const KvPieceHeader& h = piece.header;
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
    const int64_t layer_bytes = KvPieceLayerBytes(h);
    const int64_t h0 = h.head_begin - layout.kv_heads.begin;
    const uint8_t* in = piece.data.data();
    for (int32_t block : blocks) {
        if (block < 0) {
            in += layer_bytes * (h.layer_end - h.layer_begin);
            continue;
        }
        uint8_t* dst = pool.MutableBlockData(block);
        for (int64_t l = h.layer_begin; l < h.layer_end; ++l) {
            ForEachRun(PartsOf(pool, l), h0, h.head_end - h.head_begin,
                       [&](int64_t pool_at, int64_t piece_at, int64_t n) {
                           std::memcpy(dst + pool_at, in + piece_at, static_cast<size_t>(n));
                       });
            in += layer_bytes;
        }
    }
    return Status::Ok();
}

}  // namespace kvshard
