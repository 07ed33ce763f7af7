// Backend: the compute seam under the ModelRunner (DESIGN.md "Key interfaces"). One backend
// object serves one worker (one device: a GPU, or the CPU cores of a rank thread) and owns its
// memory and its stream. The runner allocates every buffer of a step through it, copies the
// step's packed inputs in once, queues the ops of the forward pass and copies the logits out;
// nothing of the forward pass runs outside these calls.
//
// Ops are queued on the backend's one stream in call order; pointers passed to them are backend
// memory (from Allocate, or offsets into it). On the CPU the stream is the calling thread: ops
// run when called and Synchronize() only reports. Op arguments that break the stated REQUIRES
// are broken invariants (checked, not returned): the runner validates a plan before it queues
// anything. Errors that can happen at run time on a device (out of memory, a lost device) come
// back from Allocate, the copies and Synchronize.
//
// Optional, fused ops are separate opt-in interfaces a backend may also implement (found with
// dynamic_cast), never methods that throw "not implemented".
//
// Thread-safety: a backend is used by one thread at a time (its worker's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/dtype.h"
#include "common/status.h"
#include "kernels/paged_attention.h"

namespace kvshard {

class Backend;

// Backend memory. Ownership: owns its allocation and returns it to the backend that made it,
// which must outlive it. Movable, not copyable.
class BackendBuffer {
  public:
    BackendBuffer() = default;
    ~BackendBuffer();
    BackendBuffer(BackendBuffer&& other) noexcept;
    BackendBuffer& operator=(BackendBuffer&& other) noexcept;
    BackendBuffer(const BackendBuffer&) = delete;
    BackendBuffer& operator=(const BackendBuffer&) = delete;

    void* data() const { return data_; }
    size_t bytes() const { return bytes_; }
    template <typename T>
    T* As() const {
        return static_cast<T*>(data_);
    }

  private:
    friend class Backend;
    BackendBuffer(Backend* owner, void* data, size_t bytes)
        : owner_(owner), data_(data), bytes_(bytes) {}
    void Reset();

    Backend* owner_ = nullptr;
    void* data_ = nullptr;
    size_t bytes_ = 0;
};

// A weight matrix {rows, cols} kept in its stored format in backend memory: row r at
// data + r * RowBytes(dtype, cols). Vectors (norm weights) are F32 matrices of one row.
// `decode_copy`: a second copy in a backend-private layout that its single-row products read
// (DecodeWeightPacker); nullptr when there is none.
struct WeightView {
    DType dtype = DType::kF32;
    const void* data = nullptr;
    int64_t rows = 0;
    int64_t cols = 0;
    const void* decode_copy = nullptr;
};

// One layer of a paged KV pool in backend memory (layout in kernels/paged_attention.h) and the
// layout of a whole step's attention: the same structs on every backend.
using PagedKvLayer = cpu::PagedKvLayer;
using PagedAttentionBatch = cpu::PagedAttentionBatch;

enum class BackendKind { kCpu, kCuda };
std::string_view BackendKindName(BackendKind kind);

// What the forward pass reads a weight for: products, the embedding gather, or both (an embedding
// tied to the classifier).
enum class WeightUse { kMatMul, kEmbedding, kEmbeddingAndMatMul };

// The format a backend of `kind` keeps a weight stored as `stored` in, so that its ops read it
// without a conversion of their own (LoadWeights converts at load, on the host, and keeps only
// that form). The CPU reads every stored format. CUDA multiplies F32 (the oracle path) and BF16
// rows, every other format as BF16 (the CPU dequantizer, then round to nearest even); it gathers
// F32 and BF16 embeddings, every other format as F32 (exactly the CPU's values); a tied
// quantized embedding becomes F32 for both uses.
DType ResidentWeightFormat(BackendKind kind, DType stored, WeightUse use);

struct BackendConfig {
    BackendKind kind = BackendKind::kCpu;
    int device = 0;  // the GPU ordinal (kCuda)
    // Threads of this worker's ops (kCpu): the OpenMP team of the calling thread; 0 leaves it.
    int num_threads = 0;
};

class Backend {
  public:
    virtual ~Backend() = default;

    virtual BackendKind kind() const = 0;
    // e.g. "cpu (avx512, 2 threads)".
    virtual std::string Describe() const = 0;

    // ---- memory and stream ----
    // What a buffer holds, so the backend can place it: kResident for large buffers read in
    // full, over and over, for the model's life (weights, their copies, the KV pool); kScratch for
    // the rest (the step workspace, step inputs, staging), which a step may touch only in part.
    // The CPU backend backs kResident buffers with transparent huge pages (a 2 MiB page committed
    // for any byte touched in it); kScratch keeps 4 KiB pages, committed only where written.
    enum class BufferUse { kScratch, kResident };
    // `bytes` of backend memory, aligned to 64 bytes; contents undefined (on the CPU, pages are
    // committed as they are first written). ResourceExhausted when it cannot be had.
    Result<BackendBuffer> Allocate(size_t bytes, BufferUse use = BufferUse::kScratch);
    // Queued copies between host memory and backend memory. The host side must stay valid until
    // Synchronize() returns.
    virtual Status CopyToDevice(void* dst, const void* src, size_t bytes) = 0;
    virtual Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;
    // Waits for everything queued; returns the first error of queued work.
    virtual Status Synchronize() = 0;

    // ---- the ops of a step ----
    // out[i, :] = row ids[i] - row_offset of `table` (dequantized) when inside the table, else
    // zeros (a rank holding a slice of the vocabulary).
    virtual void Embedding(const WeightView& table, int64_t row_offset, const int32_t* ids,
                           int64_t n, float* out) = 0;
    // y[m, w.rows] = x[m, w.cols] · W^T against the weight in its stored format.
    virtual void MatMul(const float* x, int64_t m, const WeightView& w, float* y) = 0;
    // out = x / rms(x) * weight, row by row (out may equal x).
    virtual void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                         float eps) = 0;
    // residual += delta, then out = RmsNorm(residual): the residual add and the next norm.
    virtual void AddRmsNorm(float* residual, const float* delta, const float* weight, float* out,
                            int64_t rows, int64_t dim, float eps) = 0;
    // x += y over n floats.
    virtual void Add(float* x, const float* y, int64_t n) = 0;
    // Rotary embedding on interleaved pairs of `num_heads` heads that start each row of x (rows
    // `row_stride` floats apart), in place; inv_freq: head_dim/2 floats (scaling applied).
    virtual void Rope(float* x, int64_t row_stride, const int32_t* positions, int64_t rows,
                      int64_t num_heads, int64_t head_dim, const float* inv_freq) = 0;
    // out[r, i] = silu(gate_up[r, i]) * gate_up[r, dim + i]: gate and up fused in one row.
    virtual void SiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out) = 0;
    // ---- the ops of the architectures past Llama (Qwen, Gemma) ----
    // Each has a portable default here that copies its operands to the host, computes there
    // (kernels/cpu_ops.h) and copies the result back, synchronizing: correct on any backend,
    // slow on a device; a device backend overrides them with kernels of its own.
    // out[r, i] = gelu_tanh(gate_up[r, i]) * gate_up[r, dim + i], GELU's tanh approximation
    // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): Gemma's GeGLU.
    virtual void GeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out);
    // x[r, :] += bias over `rows` rows of `dim` floats (Qwen 2's Q/K/V biases, on the fused row).
    virtual void AddBias(float* x, const float* bias, int64_t rows, int64_t dim);
    // RMSNorm, in place, of each of the `num_heads` heads (head_dim floats, one weight of head_dim
    // for every head) that start each row of x, rows `row_stride` floats apart: the q and k norms
    // of Qwen 3 and Gemma 3 inside the fused QKV row, before RoPE.
    virtual void HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                             int64_t head_dim, const float* weight, float eps);
    // x *= s over n floats (Gemma's embedding scale).
    virtual void Scale(float* x, float s, int64_t n);
    // Whether PagedAttention honours PagedAttentionBatch::window (sliding-window layers). A
    // backend that does not is refused models with a window (MakeModelRunner).
    virtual bool SupportsSlidingWindow() const { return false; }

    // Writes n rows of K and V (row stride row_stride floats) at their slots; a row whose slot
    // is negative (a padded row of a decode step, worker/decode_buckets.h) is not written.
    virtual void KvWrite(const PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                         const int64_t* slots, int64_t n) = 0;
    // The attention of every sequence of the step for one layer (kernels/paged_attention.h),
    // restricted to the last batch.window positions of each query when batch.window > 0.
    virtual void PagedAttention(const float* q, int64_t q_stride, const PagedKvLayer& kv,
                                const PagedAttentionBatch& batch, float* out, int64_t num_heads,
                                const int32_t* kv_head_of_q) = 0;
    // Copies whole blocks of a pool (copy-on-write): src_dst holds num_pairs (src, dst) pairs.
    virtual void CopyBlocks(void* pool, int64_t bytes_per_block, const int32_t* src_dst,
                            int64_t num_pairs) = 0;
    // out[i, :] = x[rows[i], :] over `dim` floats: the rows whose logits a step needs.
    virtual void GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                            float* out) = 0;

  protected:
    virtual Result<void*> AllocateRaw(size_t bytes) = 0;
    virtual void FreeRaw(void* data, size_t bytes) = 0;
    // Called once on memory from AllocateRaw before it is handed out; the default places every
    // use alike.
    virtual void AdviseUse(void* data, size_t bytes, BufferUse use) {
        (void)data, (void)bytes, (void)use;
    }

  private:
    friend class BackendBuffer;
};

// Opt-in (found with dynamic_cast): a backend that records the ops queued on its stream as a
// graph and runs them again later (CUDA graphs). Everything queued between BeginCapture and
// EndCapture is recorded, not run; Replay(id) queues the recorded ops again with the same
// pointers and shapes (the data behind the pointers may have changed). REQUIRES during a
// capture: no allocation, no copy to or from the host, no Synchronize — the caller runs a step
// of the same shape eagerly first, so that whatever the ops make at their first use exists.
// Errors: EndCapture fails when anything inside the capture failed or was refused (nothing ran;
// the backend keeps working eagerly); Replay fails for an id not captured or released.
class GraphCapture {
  public:
    virtual ~GraphCapture() = default;
    virtual Status BeginCapture() = 0;
    virtual Result<int> EndCapture() = 0;
    virtual Status Replay(int graph) = 0;
    // Frees a captured graph; its id is not reused. Unknown ids are ignored.
    virtual void ReleaseGraph(int graph) = 0;
};

// Opt-in (a backend may also implement it; found with dynamic_cast): a second copy of a weight in
// a layout the backend's single-row products (batch-1 decode) read faster than the stored one,
// at the cost of the copy's memory. MatMul with that view then reads the copy when m = 1 and the
// stored rows otherwise; results agree with the stored layout's to fp32 rounding. The CPU
// backend makes one for Q4_1 and Q8_0 weights on AVX-512 (kernels/cpu_matmul.h, kInterleaveRows).
class DecodeWeightPacker {
  public:
    virtual ~DecodeWeightPacker() = default;
    // Makes the copy of *w when the backend has a layout for it and sets w->decode_copy; returns
    // the buffer holding it (empty, w unchanged, when there is none for this weight).
    // Ownership: the caller keeps the buffer as long as *w is used. ResourceExhausted as Allocate.
    virtual Result<BackendBuffer> PackForDecode(WeightView* w) = 0;
};

// Opt-in (found with dynamic_cast): RoPE of a step's queries and keys fused with the KV write,
// one pass over the rows where the plain ops take three:
//   Rope(q, row_stride, positions, rows, num_heads, head_dim, inv_freq);
//   Rope(k, row_stride, positions, rows, kv.num_kv_heads, head_dim, inv_freq);
//   KvWrite(kv, k, v, row_stride, slots, rows);
// with head_dim = kv.head_dim, and the same results: q and k rotated in place, the rotated k and
// v stored at their slots in the pool's storage (a negative slot: rotated, not stored). q, k and
// v may be the three parts of one fused QKV row (rows row_stride > 0 floats apart).
class RopeKvWriter {
  public:
    virtual ~RopeKvWriter() = default;
    virtual void RopeKvWrite(float* q, float* k, const float* v, int64_t row_stride,
                             const int32_t* positions, const int64_t* slots, int64_t rows,
                             int64_t num_heads, const float* inv_freq, const PagedKvLayer& kv) = 0;
};

// Opt-in (found with dynamic_cast): copies from the memory of another backend of this process
// on this backend's stream, without staging on the host — the in-process KV handoff between two
// GPUs (worker/kv_handoff.h CopyKvBetweenPools). The CUDA backend implements it with
// cudaMemcpyPeerAsync (over NVLink or PCIe where the two devices have peer access; the driver
// stages through the host where they have not). `src` may be this backend itself: a copy within
// its own memory on its stream (CUDA: device to device; the KV pair path's staging,
// worker/kv_handoff_pairs_buffers.h).
class PeerCopy {
  public:
    virtual ~PeerCopy() = default;
    // Whether CopyFromPeer can read memory of `src` (a backend of the same kind in this process).
    virtual bool CanCopyFromPeer(const Backend& src) const = 0;
    // Queues a copy of `bytes` from `src_data` (memory of `src`) to `dst` (this backend's
    // memory). REQUIRES: CanCopyFromPeer(src); `src`'s writes of src_data already done (its
    // Synchronize returned), and src_data unchanged until this backend's Synchronize returns.
    // Errors: the device's (a failed copy).
    virtual Status CopyFromPeer(void* dst, const Backend& src, const void* src_data,
                                size_t bytes) = 0;
};

// The backend `config` names. InvalidArgument naming the setting for a kind this build or this
// machine cannot run (kCuda without CUDA, or without a device).
Result<std::unique_ptr<Backend>> MakeBackend(const BackendConfig& config);

}  // namespace kvshard
