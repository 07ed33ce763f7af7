// Checked calls for the CUDA runtime, cuBLAS and NCCL, private to kernels/cuda/. A failure aborts
// through KV_CHECK's machinery with the file, line, the call and the library's error string.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include "common/check.h"
#include "kernels/cuda/cublas_library.h"

#define KV_CUDA_CHECK(call)                                                                     \
    do {                                                                                        \
        const cudaError_t kv_cuda_err_ = (call);                                                \
        if (kv_cuda_err_ != cudaSuccess) {                                                      \
            ::kvshard::internal::CheckFailure(__FILE__, __LINE__, #call)                        \
                << "CUDA error " << static_cast<int>(kv_cuda_err_) << " ("                      \
                << cudaGetErrorName(kv_cuda_err_) << "): " << cudaGetErrorString(kv_cuda_err_); \
        }                                                                                       \
    } while (0)

// Checks the launch of the kernel just queued (bad configuration, no kernel image for the device).
#define KV_CUDA_CHECK_LAUNCH() KV_CUDA_CHECK(cudaGetLastError())

#define KV_CUBLAS_CHECK(call)                                                                \
    do {                                                                                     \
        const cublasStatus_t kv_cublas_err_ = (call);                                        \
        if (kv_cublas_err_ != CUBLAS_STATUS_SUCCESS) {                                       \
            ::kvshard::internal::CheckFailure(__FILE__, __LINE__, #call)                     \
                << "cuBLAS error " << static_cast<int>(kv_cublas_err_) << " ("               \
                << ::kvshard::cuda::Cublas().cublasGetStatusName(kv_cublas_err_)             \
                << "): " << ::kvshard::cuda::Cublas().cublasGetStatusString(kv_cublas_err_); \
        }                                                                                    \
    } while (0)

#define KV_NCCL_CHECK(call)                                                \
    do {                                                                   \
        const ncclResult_t kv_nccl_err_ = (call);                          \
        if (kv_nccl_err_ != ncclSuccess) {                                 \
            ::kvshard::internal::CheckFailure(__FILE__, __LINE__, #call)   \
                << "NCCL error " << static_cast<int>(kv_nccl_err_) << ": " \
                << ncclGetErrorString(kv_nccl_err_);                       \
        }                                                                  \
    } while (0)
