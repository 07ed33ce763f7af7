// common/device.h over the CUDA runtime (builds with KVSHARD_WITH_CUDA).
#include "common/device.h"

#include <cuda_runtime.h>

#include <string>
#include <string_view>
#include <utility>

#include "common/device_peer.h"
#include "common/logging.h"

namespace kvshard {
namespace {

// Unavailable with the call, the error's number, name and text; Ok for cudaSuccess. The error is
// cleared, so that a later, unrelated check does not report it again.
Status CudaStatus(cudaError_t err, std::string_view call) {
    if (err == cudaSuccess) return Status::Ok();
    cudaGetLastError();
    return Unavailable(std::string(call) + " failed: CUDA error " +
                       std::to_string(static_cast<int>(err)) + " (" + cudaGetErrorName(err) +
                       "): " + cudaGetErrorString(err));
}

// Logs a failure to release a handle; at process exit the runtime may already be unloading,
// which is not worth a message.
void LogReleaseError(cudaError_t err, std::string_view call) {
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
        spdlog::error("{}", CudaStatus(err, call).message());
    }
}

Status CheckCopy(std::string_view what, size_t bytes, size_t capacity) {
    if (bytes <= capacity) return Status::Ok();
    return InvalidArgument(std::string(what) + " of " + std::to_string(bytes) + " bytes with a " +
                           std::to_string(capacity) + "-byte device buffer");
}

}  // namespace

int DeviceCount() {
    int count = 0;
    // Without a driver (cudaErrorInsufficientDriver) or a device (cudaErrorNoDevice) the runtime
    // returns an error instead of a count; both mean "no GPU here", not a failure.
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
}

DeviceQuery QueryDevices() {
    DeviceQuery q;
    int count = 0;
    if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
        cudaGetLastError();
        q.error = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err) + ": " +
                  cudaGetErrorString(err);
        return q;
    }
    if (count == 0) {
        q.error = "cudaGetDeviceCount: 0 devices";
        return q;
    }
    int current = 0;
    cudaGetDevice(&current);
    for (int d = 0; d < count; ++d) {
        cudaDeviceProp prop{};
        size_t free_b = 0, total_b = 0;
        cudaError_t err = cudaGetDeviceProperties(&prop, d);
        if (err == cudaSuccess) err = cudaSetDevice(d);
        if (err == cudaSuccess) err = cudaMemGetInfo(&free_b, &total_b);
        if (err != cudaSuccess) {
            q.error = CudaStatus(err, "querying CUDA device " + std::to_string(d)).message();
            q.devices.clear();
            break;
        }
        q.devices.push_back({.ordinal = d,
                             .name = prop.name,
                             .cc_major = prop.major,
                             .cc_minor = prop.minor,
                             .total_bytes = static_cast<int64_t>(total_b),
                             .free_bytes = static_cast<int64_t>(free_b)});
    }
    cudaSetDevice(current);
    return q;
}

bool DevicesCanAccessPeer(int device, int peer) {
    const int count = DeviceCount();
    if (device < 0 || peer < 0 || device >= count || peer >= count) return false;
    if (device == peer) return true;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return can != 0;
}

Status SetDevice(int device) {
    const cudaError_t err = cudaSetDevice(device);
    if (err == cudaSuccess) return Status::Ok();
    const int count = DeviceCount();
    if (device < 0 || device >= count) {
        cudaGetLastError();
        return InvalidArgument("CUDA device " + std::to_string(device) + " does not exist (" +
                               std::to_string(count) + " visible)");
    }
    return CudaStatus(err, "cudaSetDevice(" + std::to_string(device) + ")");
}

Status SynchronizeDevice() { return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

Status SynchronizeStream(StreamHandle stream) {
    return CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

Result<bool> StreamIsDone(StreamHandle stream) {
    const cudaError_t err = cudaStreamQuery(stream);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    return CudaStatus(err, "cudaStreamQuery");
}

Result<DeviceStream> DeviceStream::Create() {
    cudaStream_t stream = nullptr;
    KV_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags"));
    return DeviceStream(stream);
}

DeviceStream::~DeviceStream() {
    if (stream_ != nullptr) LogReleaseError(cudaStreamDestroy(stream_), "cudaStreamDestroy");
}

DeviceStream::DeviceStream(DeviceStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

DeviceStream& DeviceStream::operator=(DeviceStream&& other) noexcept {
    if (this != &other) {
        DeviceStream old(std::move(*this));
        stream_ = std::exchange(other.stream_, nullptr);
    }
    return *this;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
    if (bytes == 0) return DeviceBuffer();
    void* data = nullptr;
    KV_RETURN_IF_ERROR(
        CudaStatus(cudaMalloc(&data, bytes), "cudaMalloc(" + std::to_string(bytes) + " bytes)"));
    return DeviceBuffer(data, bytes);
}

DeviceBuffer::~DeviceBuffer() {
    if (data_ != nullptr) LogReleaseError(cudaFree(data_), "cudaFree");
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
        DeviceBuffer old(std::move(*this));
        data_ = std::exchange(other.data_, nullptr);
        bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
}

Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes) {
    KV_RETURN_IF_ERROR(CheckCopy("CopyFromHost", bytes, bytes_));
    if (bytes == 0) return Status::Ok();
    return CudaStatus(cudaMemcpy(data_, src, bytes, cudaMemcpyHostToDevice),
                      "cudaMemcpy to device");
}

Status DeviceBuffer::CopyToHost(void* dst, size_t bytes) const {
    KV_RETURN_IF_ERROR(CheckCopy("CopyToHost", bytes, bytes_));
    if (bytes == 0) return Status::Ok();
    return CudaStatus(cudaMemcpy(dst, data_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

}  // namespace kvshard
