// cuBLAS wrappers: the handle and the row-major MatMulWT of kernels/cuda_ops.h.
#include <limits>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda_ops.h"

namespace kvshard::cuda {
namespace {

cublasHandle_t AsCublas(void* handle) { return static_cast<cublasHandle_t>(handle); }

int AsInt(int64_t v, const char* what) {
    KV_CHECK(v >= 0 && v <= std::numeric_limits<int>::max()) << what << "=" << v;
    return static_cast<int>(v);
}

}  // namespace

CublasHandle::CublasHandle() {
    cublasHandle_t handle = nullptr;
    KV_CUBLAS_CHECK(Cublas().cublasCreate(&handle));
    handle_ = handle;
    // Plain fp32 (no TF32 tensor-core rounding), so MatMulWT agrees with the CPU op.
    KV_CUBLAS_CHECK(Cublas().cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH));
}

CublasHandle::~CublasHandle() {
    if (handle_ != nullptr)
        Cublas().cublasDestroy(AsCublas(handle_));  // never aborts in a destructor
}

void CublasHandle::SetStream(StreamHandle stream) {
    KV_CUBLAS_CHECK(Cublas().cublasSetStream(AsCublas(handle_), stream));
}

void MatMulWT(CublasHandle& handle, const float* x, const float* w, float* y, int64_t m, int64_t n,
              int64_t k, bool accumulate) {
    const int mi = AsInt(m, "m"), ni = AsInt(n, "n"), ki = AsInt(k, "k");
    if (mi == 0 || ni == 0) return;
    const float alpha = 1.0f;
    const float beta = accumulate ? 1.0f : 0.0f;
    // cuBLAS is column-major. The row-major y[m, n] is the column-major yᵀ (n × m, ld n), x is
    // xᵀ (k × m, ld k) and w is wᵀ (k × n, ld k). So yᵀ = w · xᵀ = op_T(wᵀ) · op_N(xᵀ).
    KV_CUBLAS_CHECK(Cublas().cublasSgemm(AsCublas(handle.get()), CUBLAS_OP_T, CUBLAS_OP_N, ni, mi,
                                         ki, &alpha, w, ki, x, ki, &beta, y, ni));
}

}  // namespace kvshard::cuda
