// CUDA ops and device handles, seen from host code. A plain C++ header: no CUDA types or includes,
// so code outside kernels/ compiles without the CUDA toolkit's headers. The definitions live in
// kernels/cuda/ and exist only in builds with KVSHARD_WITH_CUDA (common/build_config.h).
//
// Every CUDA, cuBLAS and NCCL call behind these functions is checked; a failed call is a broken
// invariant here (out of device memory, a lost device) and aborts with file, line and the error
// string. The one exception is DeviceCount(), which answers 0 on a machine without a driver or a
// device, so that code and tests can ask before touching the GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

// cudaStream_t is `CUstream_st*`; declaring the tag keeps the header free of CUDA includes.
struct CUstream_st;

namespace kvshard::cuda {

using Stream = CUstream_st*;  // nullptr: the legacy default stream

// Number of usable CUDA devices; 0 when there is no driver, no device, or the runtime fails.
int DeviceCount();

// Selects the device the calling thread's later calls use. REQUIRES: 0 <= device < DeviceCount().
void SetDevice(int device);

// Waits for all work on the current device.
void Synchronize();

// Device memory owned by one object (cudaMalloc / cudaFree). Movable, not copyable.
// Thread-safety: none; one owner at a time.
class DeviceBuffer {
  public:
    DeviceBuffer() = default;
    // Allocates `bytes` on the current device (aborts when the allocation fails).
    explicit DeviceBuffer(size_t bytes);
    ~DeviceBuffer();
    DeviceBuffer(DeviceBuffer&& other) noexcept;
    DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    void* data() const { return data_; }
    float* floats() const { return static_cast<float*>(data_); }
    size_t bytes() const { return bytes_; }

    // Synchronous copies of `bytes` (<= bytes()) between this buffer and host memory.
    void CopyFromHost(const void* src, size_t bytes);
    void CopyToHost(void* dst, size_t bytes) const;

  private:
    void* data_ = nullptr;
    size_t bytes_ = 0;
};

// A cuBLAS handle (cublasCreate / cublasDestroy) bound to the device current at construction.
// Pedantic fp32 math: no TF32, so results stay within fp32 rounding of the CPU ops.
// Thread-safety: one thread at a time.
class CublasHandle {
  public:
    CublasHandle();
    ~CublasHandle();
    CublasHandle(const CublasHandle&) = delete;
    CublasHandle& operator=(const CublasHandle&) = delete;

    // Later calls through this handle run on `stream`.
    void SetStream(Stream stream);
    void* get() const { return handle_; }  // the cublasHandle_t

  private:
    void* handle_ = nullptr;
};

// The device counterpart of cpu::RmsNorm. All pointers are device memory; out may equal x.
void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps,
             Stream stream = nullptr);

// The device counterpart of cpu::MatMulWT: y[m, n] (+)= x[m, k] · w[n, k]^T, row-major, on the
// stream of `handle`. All pointers are device memory.
void MatMulWT(CublasHandle& handle, const float* x, const float* w, float* y, int64_t m, int64_t n,
              int64_t k, bool accumulate = false);

// The NCCL library version as ncclGetVersion reports it (e.g. 22703 for 2.27.3).
int NcclVersion();

// Sums `n` floats in place across a single-rank NCCL communicator on device 0 (ncclCommInitAll
// with one device, then ncclAllReduce): exercises the NCCL path end to end with one GPU; the data
// comes back unchanged. Returns Unavailable when there is no device.
Status AllReduceSumSingleRank(float* host_data, int64_t n);

}  // namespace kvshard::cuda
