// CUDA ops, seen from host code. A plain C++ header: no CUDA types or includes, so code outside
// kernels/ compiles without the CUDA toolkit's headers. The definitions live in kernels/cuda/ and
// exist only in builds with KVSHARD_WITH_CUDA (common/build_config.h). Devices, streams and
// device memory are the shared device layer's (common/device.h).
//
// Every CUDA, cuBLAS and NCCL call behind these functions is checked; a failed call is a broken
// invariant here (a bad launch, a lost device) and aborts with file, line and the error string.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/device.h"
#include "common/status.h"

namespace kvshard::cuda {

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
    void SetStream(StreamHandle stream);
    void* get() const { return handle_; }  // the cublasHandle_t

  private:
    void* handle_ = nullptr;
};

// The device counterpart of cpu::RmsNorm. All pointers are device memory; out may equal x.
void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps,
             StreamHandle stream = nullptr);

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
