// Which kernel the CUDA backend's prefill chunks take (kernels/cuda/prefill_attention.h): the
// tensor-core kernel where the pool's dtype and head_dim allow, else the fp32 FMA kernel, which
// stays as the tensor-core kernel's oracle. The setting is KVSHARD_CUDA_PREFILL, read when a
// CudaBackend is created (CudaBackend::set_prefill_kernel pins it afterwards, for tests):
//   fp32 (or unset)  the fp32 kernel everywhere
//   auto             tc where TcPrefillSupports, fp32 elsewhere
//   tc               the tensor-core kernel; a layer it cannot read is an error naming the setting
// Unset means fp32 until the tensor-core kernel has run on a device (scripts/gpu-check's
// prefilltc step compares it with the fp32 kernel): it is compiled and its index math tested on
// the CPU only, so serving takes it only when asked.
// A plain host header.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/kv_dtype.h"
#include "common/status.h"

namespace kvshard::cuda {

enum class PrefillKernel { kAuto, kTensorCore, kFp32 };

inline constexpr const char* kPrefillKernelEnv = "KVSHARD_CUDA_PREFILL";

// `value` is the environment's (null: unset). InvalidArgument naming the setting otherwise.
inline Result<PrefillKernel> ParsePrefillKernel(const char* value) {
    if (value == nullptr || std::string_view(value) == "fp32") return PrefillKernel::kFp32;
    if (std::string_view(value) == "auto") return PrefillKernel::kAuto;
    if (std::string_view(value) == "tc") return PrefillKernel::kTensorCore;
    return InvalidArgument(std::string(kPrefillKernelEnv) + "=" + value +
                           " is not auto, tc or fp32");
}

// The setting of this process's environment.
inline Result<PrefillKernel> PrefillKernelFromEnvironment() {
    return ParsePrefillKernel(std::getenv(kPrefillKernelEnv));
}

// Whether the tensor-core kernel reads a layer: bf16 pools, and fp8/int8 ones (dequantized to bf16
// tiles), at head_dim 64 or 128. fp32 and fp16 pools keep the fp32 kernel: bf16 tiles would lose
// precision they store.
inline bool TcPrefillSupports(KvDtype storage, int64_t head_dim) {
    const bool dtype =
        storage == KvDtype::kBf16 || storage == KvDtype::kFp8 || storage == KvDtype::kInt8;
    return dtype && (head_dim == 64 || head_dim == 128);
}

// The kernel (kTensorCore or kFp32) of a layer under `setting`; InvalidArgument naming the
// setting when tc is pinned for a layer the tensor-core kernel cannot read.
inline Result<PrefillKernel> ChoosePrefillKernel(PrefillKernel setting, KvDtype storage,
                                                 int64_t head_dim) {
    const bool tc = TcPrefillSupports(storage, head_dim);
    switch (setting) {
        case PrefillKernel::kAuto:
            return tc ? PrefillKernel::kTensorCore : PrefillKernel::kFp32;
        case PrefillKernel::kTensorCore:
            if (tc) return PrefillKernel::kTensorCore;
            return InvalidArgument(std::string(kPrefillKernelEnv) +
                                   "=tc: the tensor-core prefill kernel reads bf16, fp8 and int8 "
                                   "pools at head_dim 64 or 128, not " +
                                   std::string(KvDtypeName(storage)) + " at head_dim " +
                                   std::to_string(head_dim) + " (use auto or fp32)");
        case PrefillKernel::kFp32:
            return PrefillKernel::kFp32;
    }
    return PrefillKernel::kFp32;
}

}  // namespace kvshard::cuda
