// CudaBackend: the Backend (kernels/backend.h) on one CUDA device. Memory is device memory
// (cudaMalloc at load: the runner's weight arena, KV pool, workspace and input buffers, never
// inside a step); every op and copy is queued on the backend's own stream, in call order;
// Synchronize waits for the stream and returns the first error of anything queued (a failed
// launch, an illegal address, a lost device), so a broken device fails the step, not the process.
//
// Activations are fp32 at the interface. Matrix products:
//   - F32 weights (`--weight-format f32`, the reference path): pedantic fp32 cuBLAS SGEMM, the
//     oracle the other paths are checked against;
//   - BF16 weights: cuBLASLt straight from the stored rows;
//   - every other stored format (F16, Q8_0, Q4_*, K-quants): a bf16 copy of the weight made once
//     on the host with the CPU's dequantizer (kernels/cuda/weight_pack.h) and uploaded, then
//     cuBLASLt.
// cuBLASLt runs bf16 × bf16 with fp32 compute into fp32 outputs, the activations converted to bf16
// first; its algorithm is chosen once per shape (GemmAlgoCache) with an explicit workspace.
// Embedding tables in formats the device does not gather directly (anything but F32 and BF16) are
// dequantized once to fp32 the same way, so the embedding matches the CPU's bit for bit.
// LoadWeights (worker/weights.h) already converts at load to the forms these ops read
// (ResidentWeightFormat: BF16 products, F32 embeddings), so loaded weights need no copy here.
// For weights in other formats the bf16/fp32 copies are made by PrepareWeight, or at a weight's
// first use (allocation and a host round trip then, logged once per weight), and freed with the
// allocation holding the stored weight.
//
// Attention reads the paged pool in exactly the CPU layout (kernels/paged_attention.h), fp32 or
// 8-bit with per-token-head scales, written by the same quantization arithmetic as the CPU's.
// Thread-safety: one thread at a time (the worker's); the device is made current on every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "common/device.h"
#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/cuda/prefill_select.h"

namespace kvshard::cuda {

class CudaBackend final : public Backend, public GraphCapture, public RopeKvWriter,
                          public PeerCopy {
  public:
    // Device memory the backend allocates for itself at Create, beside what the runner asks for:
    // the cuBLASLt (and cuBLAS) workspace, the split-KV partial results, and the bf16 copy of a
    // product's activations, which grows to the largest product's rows × columns × 2 (logged).
    static constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
    static constexpr int64_t kPartialFloats = int64_t{8} << 20;
    static constexpr size_t kInitialActivationBytes = size_t{16} << 20;
    static constexpr int64_t kFixedBytes = static_cast<int64_t>(kLtWorkspaceBytes) +
                                           kPartialFloats * 4 +
                                           static_cast<int64_t>(kInitialActivationBytes);

    // Use Create: it checks the device first.
    static Result<std::unique_ptr<CudaBackend>> Create(const BackendConfig& config);
    ~CudaBackend() override;

    BackendKind kind() const override { return BackendKind::kCuda; }
    std::string Describe() const override;

    Status CopyToDevice(void* dst, const void* src, size_t bytes) override;
    Status CopyToHost(void* dst, const void* src, size_t bytes) override;
    Status Synchronize() override;

    void Embedding(const WeightView& table, int64_t row_offset, const int32_t* ids, int64_t n,
                   float* out) override;
    void MatMul(const float* x, int64_t m, const WeightView& w, float* y) override;
    void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                 float eps) override;
    void AddRmsNorm(float* residual, const float* delta, const float* weight, float* out,
                    int64_t rows, int64_t dim, float eps) override;
    void Add(float* x, const float* y, int64_t n) override;
    void Rope(float* x, int64_t row_stride, const int32_t* positions, int64_t rows,
              int64_t num_heads, int64_t head_dim, const float* inv_freq) override;
    void SiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out) override;
    void GeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out) override;
    void AddBias(float* x, const float* bias, int64_t rows, int64_t dim) override;
    void HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                     int64_t head_dim, const float* weight, float eps) override;
    void Scale(float* x, float s, int64_t n) override;
    bool SupportsSlidingWindow() const override { return true; }
    void KvWrite(const PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                 const int64_t* slots, int64_t n) override;
    void PagedAttention(const float* q, int64_t q_stride, const PagedKvLayer& kv,
                        const PagedAttentionBatch& batch, float* out, int64_t num_heads,
                        const int32_t* kv_head_of_q) override;
    void CopyBlocks(void* pool, int64_t bytes_per_block, const int32_t* src_dst,
                    int64_t num_pairs) override;
    void GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                    float* out) override;

    // RopeKvWriter: one kernel (kernels/cuda/rope_kv_write.cu) for Rope, Rope and KvWrite.
    void RopeKvWrite(float* q, float* k, const float* v, int64_t row_stride,
                     const int32_t* positions, const int64_t* slots, int64_t rows,
                     int64_t num_heads, const float* inv_freq, const PagedKvLayer& kv) override;

    // Makes the device copies MatMul (`for_embedding` false) or Embedding (true) reads for `w`
    // now instead of at its first use. Errors: a failed copy or allocation.
    Status PrepareWeight(const WeightView& w, bool for_embedding);

    // CUDA graphs (GraphCapture, kernels/backend.h): the ops queued between BeginCapture and
    // EndCapture are recorded instead of run, and Replay(id) runs them again on the stream (the
    // same pointers and shapes; the data behind them may change). REQUIRES during a capture:
    // nothing allocates, copies to or from the host, or synchronizes — run the step once eagerly
    // first (that makes the weight copies and the cuBLASLt plans). Errors: the CUDA errors of the
    // capture, an op that failed inside it (which fails the capture only: the backend runs
    // eagerly after it), an unknown or released id. A graph stays valid when a later product
    // outgrows the activation copy it was captured with. ReleaseGraph frees a graph's executable.
    Status BeginCapture() override;
    Result<int> EndCapture() override;
    Status Replay(int graph) override;
    void ReleaseGraph(int graph) override;
    // Graphs captured and not released.
    size_t live_graphs() const;

    // Peer copies (PeerCopy, kernels/backend.h): from another CudaBackend of this process, on
    // this backend's stream with cudaMemcpyPeerAsync (the same device: a device-to-device copy).
    // Peer access between the two devices is enabled at the first copy where the devices have it.
    bool CanCopyFromPeer(const Backend& src) const override;
    Status CopyFromPeer(void* dst, const Backend& src, const void* src_data,
                        size_t bytes) override;

    int device() const { return device_; }
    // The stream every op and copy is queued on (an NCCL collective queues on it too).
    StreamHandle stream() const { return stream_; }
    int sm_count() const { return sm_count_; }
    // The prefill kernel setting (kernels/cuda/prefill_select.h; KVSHARD_CUDA_PREFILL at Create).
    PrefillKernel prefill_kernel() const { return prefill_; }
    void set_prefill_kernel(PrefillKernel k) { prefill_ = k; }
    // Distinct matrix-product shapes whose cuBLASLt algorithm has been chosen.
    size_t gemm_plans() const;

  protected:
    Result<void*> AllocateRaw(size_t bytes) override;
    void FreeRaw(void* data, size_t bytes) override;

  private:
    struct Impl;
    explicit CudaBackend(int device);
    // Records the first failure of a queued launch (0: none).
    void Check(int cuda_error, const char* what);
    void Fail(Status status);
    // The device copy of `w` for a product (bf16) or an embedding (fp32); nullptr after an error.
    const void* Converted(const WeightView& w, bool for_embedding);

    int device_;
    int sm_count_ = 0;
    std::string name_;
    int cc_major_ = 0, cc_minor_ = 0;
    StreamHandle stream_ = nullptr;
    PrefillKernel prefill_ = PrefillKernel::kAuto;
    Status first_error_;
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvshard::cuda

namespace kvshard {
// The CUDA backend for MakeBackend (kernels/backend.cc). InvalidArgument naming the setting when
// there is no device, `config.device` names a missing one, or its compute capability is below 8.0.
Result<std::unique_ptr<Backend>> MakeCudaBackend(const BackendConfig& config);
}  // namespace kvshard
