#include "kv/kv_geometry.h"

#include <algorithm>
#include <string>

namespace kvshard::kv {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

Status KvGeometry::Validate() const {
    auto positive = [](const char* name, int64_t v) -> Status {
        if (v <= 0)
            return InvalidArgument(std::string("KV geometry: ") + name + " must be positive, got " +
                                   Str(v));
        return Status::Ok();
    };
    KV_RETURN_IF_ERROR(positive("num_layers", num_layers));
    KV_RETURN_IF_ERROR(positive("num_kv_heads", num_kv_heads));
    KV_RETURN_IF_ERROR(positive("head_dim", head_dim));
    KV_RETURN_IF_ERROR(positive("block_size", block_size));
    return Status::Ok();
}

int64_t KvGeometry::BytesPerTokenPerLayer() const {
    return 2 * num_kv_heads * KvRowBytes(dtype, head_dim);
}

std::string KvGeometry::ToString() const {
    return "layers=" + Str(num_layers) + " kv_heads=" + Str(num_kv_heads) +
           " head_dim=" + Str(head_dim) + " dtype=" + std::string(KvDtypeName(dtype)) +
           " block_size=" + Str(block_size) + " bytes_per_block=" + Str(BytesPerBlock());
}

HeadRange QueryHeadRange(int64_t num_heads, int64_t tp, int64_t rank) {
    return {num_heads * rank / tp, num_heads * (rank + 1) / tp};
}

Result<HeadRange> LocalKvHeadRange(int64_t num_heads, int64_t num_kv_heads, int64_t tp,
                                   int64_t rank) {
    if (num_kv_heads <= 0)
        return InvalidArgument("num_kv_heads must be positive, got " + Str(num_kv_heads));
    if (num_heads <= 0 || num_heads % num_kv_heads != 0) {
        return InvalidArgument(Str(num_heads) + " query heads are not a positive multiple of the " +
                               Str(num_kv_heads) + " KV heads");
    }
    if (tp <= 0) return InvalidArgument("tp must be positive, got " + Str(tp));
    if (rank < 0 || rank >= tp) {
        return InvalidArgument("rank " + Str(rank) + " is outside tp " + Str(tp));
    }
    if (tp > num_heads) {
        return InvalidArgument("tp " + Str(tp) + " exceeds the model's " + Str(num_heads) +
                               " query heads: every rank needs at least one (num_kv_heads " +
                               Str(num_kv_heads) + ")");
    }
    const HeadRange q = QueryHeadRange(num_heads, tp, rank);
    const int64_t group = num_heads / num_kv_heads;
    return HeadRange{q.begin / group, (q.end - 1) / group + 1};
}

Result<int64_t> MaxLocalKvHeads(int64_t num_heads, int64_t num_kv_heads, int64_t tp) {
    int64_t most = 0;
    for (int64_t rank = 0; rank < std::max<int64_t>(tp, 1); ++rank) {
        KV_ASSIGN_OR_RETURN(HeadRange r, LocalKvHeadRange(num_heads, num_kv_heads, tp, rank));
        most = std::max(most, r.size());
    }
    return most;
}

Status CheckEvenKvHeadSplit(int64_t num_kv_heads, int64_t tp) {
    if (num_kv_heads <= 0)
        return InvalidArgument("num_kv_heads must be positive, got " + Str(num_kv_heads));
    if (tp <= 0) return InvalidArgument("tp must be positive, got " + Str(tp));
    if (tp <= num_kv_heads && num_kv_heads % tp != 0) {
        return InvalidArgument(Str(num_kv_heads) + " KV heads cannot be split evenly over tp " +
                               Str(tp) + " (kv heads must be a multiple of tp)");
    }
    if (tp > num_kv_heads && tp % num_kv_heads != 0) {
        return InvalidArgument("tp " + Str(tp) + " is larger than the " + Str(num_kv_heads) +
                               " KV heads and not a multiple of them, so they cannot be replicated "
                               "evenly");
    }
    return Status::Ok();
}

Result<int64_t> LocalKvHeads(int64_t num_heads, int64_t num_kv_heads, int64_t tp) {
    KV_RETURN_IF_ERROR(CheckEvenKvHeadSplit(num_kv_heads, tp));
    return MaxLocalKvHeads(num_heads, num_kv_heads, tp);
}

Result<KvGeometry> MakeKvGeometry(const ModelSpec& spec, int64_t tp, KvDtype dtype,
                                  int64_t block_size) {
    KV_ASSIGN_OR_RETURN(int64_t local_heads, LocalKvHeads(spec.num_heads, spec.num_kv_heads, tp));
    KvGeometry g;
    g.num_layers = spec.num_layers;
    g.num_kv_heads = local_heads;
    g.head_dim = spec.head_dim;
    g.dtype = dtype;
    g.block_size = block_size;
    KV_RETURN_IF_ERROR(g.Validate());
    return g;
}

}  // namespace kvshard::kv
