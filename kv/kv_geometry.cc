#include "kv/kv_geometry.h"

#include <string>

namespace kvshard::kv {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

std::string_view KvDtypeName(KvDtype dtype) {
    switch (dtype) {
        case KvDtype::kFp32:
            return "fp32";
        case KvDtype::kFp16:
            return "fp16";
        case KvDtype::kBf16:
            return "bf16";
        case KvDtype::kFp8:
            return "fp8";
        case KvDtype::kInt8:
            return "int8";
    }
    return "?";
}

Result<KvDtype> ParseKvDtype(std::string_view name) {
    if (name == "fp32" || name == "float32") return KvDtype::kFp32;
    if (name == "fp16" || name == "float16") return KvDtype::kFp16;
    if (name == "bf16" || name == "bfloat16") return KvDtype::kBf16;
    if (name == "fp8" || name == "fp8_e4m3") return KvDtype::kFp8;
    if (name == "int8") return KvDtype::kInt8;
    return InvalidArgument("unknown KV dtype '" + std::string(name) +
                           "' (expected fp32, fp16, bf16, fp8 or int8)");
}

int64_t KvDtypeBytes(KvDtype dtype) {
    switch (dtype) {
        case KvDtype::kFp32:
            return 4;
        case KvDtype::kFp16:
            return 2;
        case KvDtype::kBf16:
            return 2;
        case KvDtype::kFp8:
            return 1;
        case KvDtype::kInt8:
            return 1;
    }
    return 0;
}

int64_t KvScaleBytes(KvDtype dtype) {
    switch (dtype) {
        case KvDtype::kFp32:
        case KvDtype::kFp16:
        case KvDtype::kBf16:
        case KvDtype::kFp8:
            return 0;
        case KvDtype::kInt8:
            return 4;
    }
    return 0;
}

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
    KV_RETURN_IF_ERROR(positive("dtype_bytes", dtype_bytes));
    KV_RETURN_IF_ERROR(positive("block_size", block_size));
    if (scale_bytes < 0) {
        return InvalidArgument("KV geometry: scale_bytes must be >= 0, got " + Str(scale_bytes));
    }
    return Status::Ok();
}

int64_t KvGeometry::BytesPerTokenPerLayer() const {
    return 2 * num_kv_heads * (head_dim * dtype_bytes + scale_bytes);
}

std::string KvGeometry::ToString() const {
    return "layers=" + Str(num_layers) + " kv_heads=" + Str(num_kv_heads) +
           " head_dim=" + Str(head_dim) + " dtype_bytes=" + Str(dtype_bytes) +
           " scale_bytes=" + Str(scale_bytes) + " block_size=" + Str(block_size) +
           " bytes_per_block=" + Str(BytesPerBlock());
}

Result<HeadRange> LocalKvHeadRange(int64_t num_kv_heads, int64_t tp, int64_t rank) {
    if (num_kv_heads <= 0)
        return InvalidArgument("num_kv_heads must be positive, got " + Str(num_kv_heads));
    if (tp <= 0) return InvalidArgument("tp must be positive, got " + Str(tp));
    if (rank < 0 || rank >= tp) {
        return InvalidArgument("rank " + Str(rank) + " is outside tp " + Str(tp));
    }
    if (tp <= num_kv_heads) {
        if (num_kv_heads % tp != 0) {
            return InvalidArgument(Str(num_kv_heads) + " KV heads cannot be split evenly over tp " +
                                   Str(tp) + " (kv heads must be a multiple of tp)");
        }
        const int64_t per_rank = num_kv_heads / tp;
        return HeadRange{rank * per_rank, (rank + 1) * per_rank};
    }
    if (tp % num_kv_heads != 0) {
        return InvalidArgument("tp " + Str(tp) + " is larger than the " + Str(num_kv_heads) +
                               " KV heads and not a multiple of them, so they cannot be replicated "
                               "evenly");
    }
    const int64_t head = rank / (tp / num_kv_heads);
    return HeadRange{head, head + 1};
}

Result<int64_t> LocalKvHeads(int64_t num_kv_heads, int64_t tp) {
    KV_ASSIGN_OR_RETURN(HeadRange r, LocalKvHeadRange(num_kv_heads, tp, 0));
    return r.size();
}

Result<KvGeometry> MakeKvGeometry(const ModelSpec& spec, int64_t tp, KvDtype dtype,
                                  int64_t block_size) {
    KV_ASSIGN_OR_RETURN(int64_t local_heads, LocalKvHeads(spec.num_kv_heads, tp));
    KvGeometry g;
    g.num_layers = spec.num_layers;
    g.num_kv_heads = local_heads;
    g.head_dim = spec.head_dim;
    g.dtype_bytes = KvDtypeBytes(dtype);
    g.scale_bytes = KvScaleBytes(dtype);
    g.block_size = block_size;
    KV_RETURN_IF_ERROR(g.Validate());
    return g;
}

}  // namespace kvshard::kv
