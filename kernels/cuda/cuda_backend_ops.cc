// CudaBackend (kernels/cuda/cuda_backend.h): the ops that each check their shapes and queue one
// kernel of kernels/cuda/backend_kernels.cu or rope_kv_write.cu on the backend's stream — norms,
// elementwise ops, RoPE, the KV write (plain and fused with RoPE), block copies and row gathers.
// Memory, copies, graphs, the products and attention are in cuda_backend.cc.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.h"
#include "kernels/cuda/backend_kernels.h"
#include "kernels/cuda/cuda_backend.h"

namespace kvshard::cuda {

void CudaBackend::RmsNorm(const float* x, const float* weight, float* out, int64_t rows,
                          int64_t dim, float eps) {
    cudaSetDevice(device_);
    Check(LaunchRmsNorm(x, weight, out, rows, dim, eps, stream_), "RmsNorm");
}

void CudaBackend::AddRmsNorm(float* residual, const float* delta, const float* weight, float* out,
                             int64_t rows, int64_t dim, float eps) {
    cudaSetDevice(device_);
    Check(LaunchAddRmsNorm(residual, delta, weight, out, rows, dim, eps, stream_), "AddRmsNorm");
}

void CudaBackend::Add(float* x, const float* y, int64_t n) {
    cudaSetDevice(device_);
    Check(LaunchAdd(x, y, n, stream_), "Add");
}

void CudaBackend::Rope(float* x, int64_t row_stride, const int32_t* positions, int64_t rows,
                       int64_t num_heads, int64_t head_dim, const float* inv_freq) {
    KV_CHECK_EQ(head_dim % 2, 0);
    cudaSetDevice(device_);
    const int64_t stride = row_stride > 0 ? row_stride : num_heads * head_dim;
    Check(LaunchRope(x, stride, positions, rows, num_heads, head_dim, inv_freq, stream_), "Rope");
}

void CudaBackend::SiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out) {
    cudaSetDevice(device_);
    Check(LaunchSiluMul(gate_up, rows, dim, out, stream_), "SiluMul");
}

void CudaBackend::GeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out) {
    cudaSetDevice(device_);
    Check(LaunchGeluTanhMul(gate_up, rows, dim, out, stream_), "GeluTanhMul");
}

void CudaBackend::AddBias(float* x, const float* bias, int64_t rows, int64_t dim) {
    cudaSetDevice(device_);
    Check(LaunchAddBias(x, bias, rows, dim, stream_), "AddBias");
}

void CudaBackend::HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                              int64_t head_dim, const float* weight, float eps) {
    KV_CHECK(head_dim > 0 && row_stride >= num_heads * head_dim)
        << "head_dim=" << head_dim << " num_heads=" << num_heads << " row_stride=" << row_stride;
    cudaSetDevice(device_);
    Check(LaunchHeadRmsNorm(x, row_stride, rows, num_heads, head_dim, weight, eps, stream_),
          "HeadRmsNorm");
}

void CudaBackend::Scale(float* x, float s, int64_t n) {
    cudaSetDevice(device_);
    Check(LaunchScale(x, s, n, stream_), "Scale");
}

void CudaBackend::KvWrite(const PagedKvLayer& kv, const float* k, const float* v,
                          int64_t row_stride, const int64_t* slots, int64_t n) {
    cudaSetDevice(device_);
    Check(LaunchKvWrite(kv, k, v, row_stride, slots, n, stream_), "KvWrite");
}

void CudaBackend::RopeKvWrite(float* q, float* k, const float* v, int64_t row_stride,
                              const int32_t* positions, const int64_t* slots, int64_t rows,
                              int64_t num_heads, const float* inv_freq, const PagedKvLayer& kv) {
    KV_CHECK(row_stride > 0 && kv.head_dim % 2 == 0)
        << "RopeKvWrite: row_stride " << row_stride << ", head_dim " << kv.head_dim;
    cudaSetDevice(device_);
    Check(LaunchRopeKvWrite(q, k, v, row_stride, positions, slots, rows, num_heads, inv_freq, kv,
                            stream_),
          "RopeKvWrite");
}

void CudaBackend::CopyBlocks(void* pool, int64_t bytes_per_block, const int32_t* src_dst,
                             int64_t num_pairs) {
    cudaSetDevice(device_);
    Check(LaunchCopyBlocks(pool, bytes_per_block, src_dst, num_pairs, stream_), "CopyBlocks");
}

void CudaBackend::GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                             float* out) {
    cudaSetDevice(device_);
    Check(LaunchGatherRows(x, dim, rows, n, out, stream_), "GatherRows");
}

}  // namespace kvshard::cuda
