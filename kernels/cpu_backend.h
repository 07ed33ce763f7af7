// CpuBackend: the Backend on the CPU cores of one worker thread. Memory is host memory (64-byte
// aligned, committed as written); ops run on the calling thread with its OpenMP team
// (BackendConfig::num_threads) and are done when they return. Matrix products read weights in
// their stored format (kernels/cpu_matmul.h); attention is batched over the step
// (kernels/paged_attention.h). This is the reference other backends are checked against.
// Peer copies (PeerCopy) from another CpuBackend are a memcpy: the peer-copy KV handoff between
// two CPU instances of one process (kv_transfer.path: peer), as a GPU's is cudaMemcpyPeerAsync.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace kvshard {

class CpuBackend final : public Backend,
                         public DecodeWeightPacker,
                         public RopeKvWriter,
                         public PeerCopy {
  public:
    explicit CpuBackend(const BackendConfig& config);

    BackendKind kind() const override { return BackendKind::kCpu; }
    std::string Describe() const override;

    Status CopyToDevice(void* dst, const void* src, size_t bytes) override;
    Status CopyToHost(void* dst, const void* src, size_t bytes) override;
    Status Synchronize() override { return Status::Ok(); }

    bool CanCopyFromPeer(const Backend& src) const override;
    Status CopyFromPeer(void* dst, const Backend& src, const void* src_data, size_t bytes) override;

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

    // The interleaved copy of a Q4_1 or Q8_0 weight of at least kInterleaveRows rows when the
    // active ISA is AVX-512 and activations are fp32 (kernels/cpu_matmul.h), else none.
    Result<BackendBuffer> PackForDecode(WeightView* w) override;

    // Row blocks of kRopeKvWriteRows: the block's rotations, then its KV write, while its rows
    // are in cache; the same arithmetic as Rope and KvWrite (cpu::Rope, cpu::PagedKvWrite).
    void RopeKvWrite(float* q, float* k, const float* v, int64_t row_stride,
                     const int32_t* positions, const int64_t* slots, int64_t rows,
                     int64_t num_heads, const float* inv_freq, const PagedKvLayer& kv) override;
    static constexpr int64_t kRopeKvWriteRows = 64;

  protected:
    Result<void*> AllocateRaw(size_t bytes) override;
    void FreeRaw(void* data, size_t bytes) override;
    // kResident: transparent huge pages over the whole 2 MiB pages of the buffer.
    void AdviseUse(void* data, size_t bytes, BufferUse use) override;

  private:
    // The decode copies share 2 MiB-aligned chunks advised for huge pages (PackForDecode): a
    // layer's copies are 0.2-1.1 MB each, below a huge page, so each alone would stay in 4 KiB
    // pages, and a batch-1 token walks all ~66 MB of them (SmolLM2), thousands of TLB misses.
    struct DecodeArena {
        uint8_t* base = nullptr;
        size_t bytes = 0;
        size_t used = 0;
        int live = 0;  // copies not yet freed; the chunk is freed with the last
    };
    // A copy's room in the current chunk, or in a new one. REQUIRES: arena_mu_ held.
    Result<void*> AllocateInArena(size_t bytes);

    int num_threads_;
    std::mutex arena_mu_;
    std::vector<DecodeArena> arenas_;
};

}  // namespace kvshard
