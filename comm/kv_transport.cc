// The piece arithmetic and validation shared by every KvTransport (comm/kv_transport.h); the
// transports themselves are in local_kv_transport.cc and tcp_kv_transport.cc.
#include "comm/kv_transport.h"

#include <limits>

#include "comm/kv_staging.h"

namespace kvshard {

namespace {

// Pieces are sized in int64; a header whose product would not fit is rejected before anyone
// multiplies it out (a frame's header comes from the network).
constexpr int64_t kMaxPieceBytes = int64_t{1} << 48;

std::string Field(const char* name, int64_t value) {
    return std::string(name) + "=" + std::to_string(value);
}

}  // namespace

uint8_t KvDtypeWireCode(KvDtype dtype) {
    switch (dtype) {
        case KvDtype::kFp32:
            return 0;
        case KvDtype::kInt8:
            return 1;
        case KvDtype::kFp8:
            return 2;
        case KvDtype::kFp16:
            return 3;
        case KvDtype::kBf16:
            return 4;
    }
    return 0;
}

Result<KvDtype> KvDtypeFromWireCode(uint8_t code) {
    for (KvDtype d :
         {KvDtype::kFp32, KvDtype::kInt8, KvDtype::kFp8, KvDtype::kFp16, KvDtype::kBf16}) {
        if (KvDtypeWireCode(d) == code) return d;
    }
    return InvalidArgument("KV piece: " + Field("dtype", code) + " is not a KV dtype code");
}

int64_t KvPieceLayerBytes(const KvPieceHeader& h) {
    const int64_t heads = int64_t{h.head_end} - h.head_begin;
    const int64_t slots = heads * h.block_size;
    int64_t bytes = 2 * slots * h.head_dim * KvDtypeBytes(h.dtype);
    if (KvPoolHasScales(h.dtype)) bytes += 2 * slots * static_cast<int64_t>(sizeof(float));
    return bytes;
}

int64_t KvPieceBytes(const KvPieceHeader& h) {
    return int64_t{h.num_blocks} * (int64_t{h.layer_end} - h.layer_begin) * KvPieceLayerBytes(h);
}

namespace internal {

Status ValidateKvPieceHeader(const KvPieceHeader& h) {
    if (h.layer_begin < 0)
        return InvalidArgument("KV piece: " + Field("layer_begin", h.layer_begin));
    if (h.layer_end <= h.layer_begin) {
        return InvalidArgument(
            "KV piece: empty or inverted layers: " + Field("layer_begin", h.layer_begin) + ", " +
            Field("layer_end", h.layer_end));
    }
    if (h.head_begin < 0) return InvalidArgument("KV piece: " + Field("head_begin", h.head_begin));
    if (h.head_end <= h.head_begin) {
        return InvalidArgument(
            "KV piece: empty or inverted heads: " + Field("head_begin", h.head_begin) + ", " +
            Field("head_end", h.head_end));
    }
    if (h.num_blocks <= 0) return InvalidArgument("KV piece: " + Field("num_blocks", h.num_blocks));
    if (h.block_size <= 0) return InvalidArgument("KV piece: " + Field("block_size", h.block_size));
    if (h.head_dim <= 0) return InvalidArgument("KV piece: " + Field("head_dim", h.head_dim));
    // Every factor is now positive and below 2^31; multiply in floating point first so that the
    // int64 formulas are only evaluated where they cannot overflow.
    const double bytes = static_cast<double>(h.num_blocks) * (h.layer_end - h.layer_begin) * 2.0 *
                         (static_cast<double>(h.head_end) - h.head_begin) * h.block_size *
                         (static_cast<double>(h.head_dim) * KvDtypeBytes(h.dtype) + 4.0);
    if (bytes > static_cast<double>(kMaxPieceBytes)) {
        return InvalidArgument("KV piece of about " + std::to_string(bytes) +
                               " bytes exceeds the limit of " + std::to_string(kMaxPieceBytes));
    }
    return Status::Ok();
}

}  // namespace internal

namespace {

// A piece holding every layer, head and block of the pool `g` describes.
KvPieceHeader WholePool(const KvReceiveGeometry& g) {
    KvPieceHeader whole;
    whole.layer_end = g.num_layers;
    whole.head_begin = g.head_begin;
    whole.head_end = g.head_end;
    whole.num_blocks = static_cast<int32_t>(g.num_blocks);
    whole.block_size = g.block_size;
    whole.head_dim = g.head_dim;
    whole.dtype = g.dtype;
    return whole;
}

}  // namespace

Status ValidateKvReceiveGeometry(const KvReceiveGeometry& g) {
    if (g.num_layers <= 0)
        return InvalidArgument("KV receive geometry: " + Field("num_layers", g.num_layers));
    if (g.head_begin < 0 || g.head_end <= g.head_begin) {
        return InvalidArgument(
            "KV receive geometry: empty heads: " + Field("head_begin", g.head_begin) + ", " +
            Field("head_end", g.head_end));
    }
    if (g.block_size <= 0)
        return InvalidArgument("KV receive geometry: " + Field("block_size", g.block_size));
    if (g.head_dim <= 0)
        return InvalidArgument("KV receive geometry: " + Field("head_dim", g.head_dim));
    if (g.num_blocks <= 0 || g.num_blocks > std::numeric_limits<int32_t>::max())
        return InvalidArgument("KV receive geometry: " + Field("num_blocks", g.num_blocks));
    return internal::ValidateKvPieceHeader(WholePool(g)).WithContext("KV receive geometry");
}

int64_t KvReceiveGeometryBytes(const KvReceiveGeometry& g) { return KvPieceBytes(WholePool(g)); }

Status ValidateKvPieceFits(const KvPieceHeader& h, const KvReceiveGeometry& g) {
    const std::string what = "KV piece of transfer " + std::to_string(h.transfer_id) + ": ";
    if (h.dtype != g.dtype) {
        return InvalidArgument(what + "dtype=" + std::string(KvDtypeName(h.dtype)) +
                               ", this pool stores " + std::string(KvDtypeName(g.dtype)));
    }
    if (h.block_size != g.block_size) {
        return InvalidArgument(what + Field("block_size", h.block_size) + ", this pool's is " +
                               std::to_string(g.block_size));
    }
    if (h.head_dim != g.head_dim) {
        return InvalidArgument(what + Field("head_dim", h.head_dim) + ", this pool's is " +
                               std::to_string(g.head_dim));
    }
    if (h.layer_begin < 0 || h.layer_end > g.num_layers || h.layer_end <= h.layer_begin) {
        return InvalidArgument(what + "layers [" + std::to_string(h.layer_begin) + ", " +
                               std::to_string(h.layer_end) + ") outside this pool's [0, " +
                               std::to_string(g.num_layers) + ")");
    }
    if (h.head_begin < g.head_begin || h.head_end > g.head_end || h.head_end <= h.head_begin) {
        return InvalidArgument(what + "heads [" + std::to_string(h.head_begin) + ", " +
                               std::to_string(h.head_end) + ") outside this rank's [" +
                               std::to_string(g.head_begin) + ", " + std::to_string(g.head_end) +
                               ")");
    }
    if (h.num_blocks <= 0 || h.num_blocks > g.num_blocks) {
        return InvalidArgument(what + Field("num_blocks", h.num_blocks) + ", this pool has " +
                               std::to_string(g.num_blocks));
    }
    return Status::Ok();
}

Status ValidateKvPiece(const KvPiece& piece) {
    KV_RETURN_IF_ERROR(internal::ValidateKvPieceHeader(piece.header));
    const int64_t expected = KvPieceBytes(piece.header);
    if (static_cast<int64_t>(piece.data.size()) != expected) {
        return InvalidArgument(
            "KV piece: " + Field("data bytes", static_cast<int64_t>(piece.data.size())) +
            ", expected " + std::to_string(expected) + " for its header");
    }
    return Status::Ok();
}

}  // namespace kvshard
