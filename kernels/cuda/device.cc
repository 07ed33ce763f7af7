// Device queries and device memory: the host side of kernels/cuda_ops.h.
#include <spdlog/spdlog.h>

#include <utility>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda_ops.h"

namespace kvshard::cuda {

int DeviceCount() {
    int count = 0;
    // Without a driver (cudaErrorInsufficientDriver) or a device (cudaErrorNoDevice) the runtime
    // returns an error instead of a count; both mean "no GPU here", not a failure.
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        cudaGetLastError();  // clear the error so a later, unrelated check does not report it
        return 0;
    }
    return count;
}

void SetDevice(int device) { KV_CUDA_CHECK(cudaSetDevice(device)); }

void Synchronize() { KV_CUDA_CHECK(cudaDeviceSynchronize()); }

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) KV_CUDA_CHECK(cudaMalloc(&data_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
    if (data_ == nullptr) return;
    // Destructors never abort: a failure here is logged. At process exit the runtime may already
    // be unloading, which is not worth a message.
    const cudaError_t err = cudaFree(data_);
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
        spdlog::error("cudaFree of {} bytes failed: {}", bytes_, cudaGetErrorString(err));
    }
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_) {
    other.data_ = nullptr;
    other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
        DeviceBuffer old(std::move(*this));
        data_ = other.data_;
        bytes_ = other.bytes_;
        other.data_ = nullptr;
        other.bytes_ = 0;
    }
    return *this;
}

void DeviceBuffer::CopyFromHost(const void* src, size_t bytes) {
    KV_CHECK_LE(bytes, bytes_);
    if (bytes > 0) KV_CUDA_CHECK(cudaMemcpy(data_, src, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::CopyToHost(void* dst, size_t bytes) const {
    KV_CHECK_LE(bytes, bytes_);
    if (bytes > 0) KV_CUDA_CHECK(cudaMemcpy(dst, data_, bytes, cudaMemcpyDeviceToHost));
}

}  // namespace kvshard::cuda
