// The device layer comm/ (NCCL) and kernels/ (CUDA) share: how many devices there are, which one
// a thread uses, and streams and device memory as owning handles. A plain header (no CUDA types or
// includes), so any code can hold a stream or a buffer without the CUDA toolkit's headers.
//
// Implementations: common/cuda/device.cc (CUDA runtime) in builds with KVSHARD_WITH_CUDA
// (common/build_config.h); common/cuda/device_stub.cc otherwise, where there is no device:
// DeviceCount() is 0 and anything that needs a device returns Unavailable.
//
// Errors: every call that can fail returns a Status; a failed CUDA call is Unavailable with the
// call, the error's number, name and text (a lost device, out of memory, no such device).
// Destructors never fail: an error releasing a handle is logged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

// cudaStream_t is `CUstream_st*`; declaring the tag keeps this header free of CUDA includes.
struct CUstream_st;

namespace kvshard {

// A CUDA stream (cudaStream_t), not owned; nullptr is the legacy default stream.
using StreamHandle = CUstream_st*;

// Number of usable CUDA devices; 0 when there is no driver, no device, the runtime fails, or the
// build has no CUDA. Never fails, so code and tests can ask before touching a GPU.
int DeviceCount();

// One device as the CUDA runtime reports it.
struct DeviceInfo {
    int ordinal = 0;
    std::string name;
    int cc_major = 0, cc_minor = 0;
    int64_t total_bytes = 0;
    int64_t free_bytes = 0;  // cudaMemGetInfo, after this process's context on it was made
};

// Every usable device, or none with the reason: `error` names what the runtime said (no driver,
// no device, a build without CUDA) when `devices` is empty for lack of a device, and the call that
// failed when a device was found but could not be queried. Never fails otherwise, so `backend:
// auto` can fall back to the CPU. Makes a context on each device (to read its free memory).
struct DeviceQuery {
    std::vector<DeviceInfo> devices;
    std::string error;
};
DeviceQuery QueryDevices();

// Selects the device the calling thread's later CUDA calls use.
// InvalidArgument unless 0 <= device < DeviceCount().
Status SetDevice(int device);

// Waits for all work queued on the current device.
Status SynchronizeDevice();

// Waits until `stream` has run all work queued on it.
Status SynchronizeStream(StreamHandle stream);

// Whether `stream` has run all work queued on it (cudaStreamQuery), without waiting.
Result<bool> StreamIsDone(StreamHandle stream);

// A stream of its own on the device current at creation (cudaStreamNonBlocking: it does not
// synchronize with the legacy default stream). Movable, not copyable; an empty DeviceStream
// (default-constructed or moved from) holds nullptr.
// Thread-safety: none for the object; the stream itself may be used from any thread.
class DeviceStream {
  public:
    DeviceStream() = default;
    static Result<DeviceStream> Create();
    ~DeviceStream();
    DeviceStream(DeviceStream&& other) noexcept;
    DeviceStream& operator=(DeviceStream&& other) noexcept;
    DeviceStream(const DeviceStream&) = delete;
    DeviceStream& operator=(const DeviceStream&) = delete;

    StreamHandle get() const { return stream_; }

  private:
    explicit DeviceStream(StreamHandle stream) : stream_(stream) {}
    StreamHandle stream_ = nullptr;
};

// Device memory owned by one object (cudaMalloc / cudaFree) on the device current at allocation.
// Movable, not copyable; an empty buffer (0 bytes, default-constructed or moved from) holds
// nullptr and needs no device.
// Thread-safety: none; one owner at a time.
class DeviceBuffer {
  public:
    DeviceBuffer() = default;
    // `bytes` of device memory, uninitialized. 0 bytes: an empty buffer, even without a device.
    static Result<DeviceBuffer> Allocate(size_t bytes);
    ~DeviceBuffer();
    DeviceBuffer(DeviceBuffer&& other) noexcept;
    DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    void* data() const { return data_; }
    float* floats() const { return static_cast<float*>(data_); }
    size_t bytes() const { return bytes_; }

    // Synchronous copies of the first `bytes` of this buffer from or to host memory.
    // InvalidArgument when bytes > this->bytes().
    Status CopyFromHost(const void* src, size_t bytes);
    Status CopyToHost(void* dst, size_t bytes) const;

  private:
    DeviceBuffer(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
    void* data_ = nullptr;
    size_t bytes_ = 0;
};

}  // namespace kvshard
