#include "common/kv_dtype.h"

#include <string>

namespace kvshard {

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
        case KvDtype::kBf16:
            return 2;
        case KvDtype::kFp8:
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
            return 0;
        case KvDtype::kFp8:
        case KvDtype::kInt8:
            return 4;
    }
    return 0;
}

bool KvPoolHasScales(KvDtype dtype) { return KvScaleBytes(dtype) > 0; }

int64_t KvRowBytes(KvDtype dtype, int64_t width) {
    return width * KvDtypeBytes(dtype) + KvScaleBytes(dtype);
}

}  // namespace kvshard
