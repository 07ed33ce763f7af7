#include "kernels/backend.h"

#include <utility>
#include <vector>

#include "common/build_config.h"
#include "common/check.h"
#include "kernels/cpu_backend.h"
#include "kernels/cpu_ops.h"
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

Result<BackendBuffer> Backend::Allocate(size_t bytes, BufferUse use) {
    if (bytes == 0) return BackendBuffer(this, nullptr, 0);
    KV_ASSIGN_OR_RETURN(void* data, AllocateRaw(bytes));
    AdviseUse(data, bytes, use);
    return BackendBuffer(this, data, bytes);
}

namespace {

// Floats of backend memory copied to the host.
std::vector<float> ToHost(Backend& b, const float* src, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    KV_CHECK(b.CopyToHost(out.data(), src, out.size() * sizeof(float)).ok());
    KV_CHECK(b.Synchronize().ok());
    return out;
}

void FromHost(Backend& b, float* dst, const std::vector<float>& src) {
    KV_CHECK(b.CopyToDevice(dst, src.data(), src.size() * sizeof(float)).ok());
    KV_CHECK(b.Synchronize().ok());
}

}  // namespace

void Backend::GeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out) {
    const std::vector<float> in = ToHost(*this, gate_up, rows * 2 * dim);
    std::vector<float> result(static_cast<size_t>(rows * dim));
    cpu::GeluTanhMulFused(in.data(), result.data(), rows, dim);
    FromHost(*this, out, result);
}

void Backend::AddBias(float* x, const float* bias, int64_t rows, int64_t dim) {
    std::vector<float> h = ToHost(*this, x, rows * dim);
    const std::vector<float> b = ToHost(*this, bias, dim);
    cpu::AddBias(h.data(), b.data(), rows, dim);
    FromHost(*this, x, h);
}

void Backend::HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                          int64_t head_dim, const float* weight, float eps) {
    if (rows == 0) return;
    std::vector<float> h = ToHost(*this, x, (rows - 1) * row_stride + num_heads * head_dim);
    const std::vector<float> w = ToHost(*this, weight, head_dim);
    cpu::HeadRmsNorm(h.data(), row_stride, rows, num_heads, head_dim, w.data(), eps);
    FromHost(*this, x, h);
}

void Backend::Scale(float* x, float s, int64_t n) {
    std::vector<float> h = ToHost(*this, x, n);
    cpu::Scale(h.data(), s, n);
    FromHost(*this, x, h);
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
