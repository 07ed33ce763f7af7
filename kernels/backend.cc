#include "kernels/backend.h"

#include <utility>

#include "common/build_config.h"
#include "kernels/cpu_backend.h"
#if KVSHARD_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace kvshard {

BackendBuffer::~BackendBuffer() { Reset(); }

BackendBuffer::BackendBuffer(BackendBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

BackendBuffer& BackendBuffer::operator=(BackendBuffer&& other) noexcept {
    if (this != &other) {
        Reset();
        owner_ = std::exchange(other.owner_, nullptr);
        data_ = std::exchange(other.data_, nullptr);
        bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
}

void BackendBuffer::Reset() {
    if (owner_ != nullptr && data_ != nullptr) owner_->FreeRaw(data_, bytes_);
    owner_ = nullptr;
    data_ = nullptr;
    bytes_ = 0;
}

DType ResidentWeightFormat(BackendKind kind, DType stored, WeightUse use) {
    if (kind == BackendKind::kCpu || stored == DType::kF32 || stored == DType::kBF16) return stored;
    return use == WeightUse::kMatMul ? DType::kBF16 : DType::kF32;
}

Result<BackendBuffer> Backend::Allocate(size_t bytes) {
    if (bytes == 0) return BackendBuffer(this, nullptr, 0);
    KV_ASSIGN_OR_RETURN(void* data, AllocateRaw(bytes));
    return BackendBuffer(this, data, bytes);
}

std::string_view BackendKindName(BackendKind kind) {
    switch (kind) {
        case BackendKind::kCpu:
            return "cpu";
        case BackendKind::kCuda:
            return "cuda";
    }
    return "?";
}

Result<std::unique_ptr<Backend>> MakeBackend(const BackendConfig& config) {
    switch (config.kind) {
        case BackendKind::kCpu:
            return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(config));
        case BackendKind::kCuda:
#if KVSHARD_WITH_CUDA
            return MakeCudaBackend(config);
#else
            return InvalidArgument(
                "backend: cuda: this kvshard was built without CUDA (KVSHARD_WITH_CUDA=OFF); "
                "use backend cpu");
#endif
    }
    return InvalidArgument("backend: unknown kind");
}

}  // namespace kvshard
