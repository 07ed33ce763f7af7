#include "kernels/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/check.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_ops.h"

namespace kvshard {
namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;
// The decode copies' chunks: 16 huge pages; a copy that does not fit in what is left of the
// current chunk opens a new one (of its own size if larger). The untouched tail of a chunk is
// address space, not memory.
constexpr size_t kArenaChunkBytes = size_t{32} << 20;
constexpr size_t kArenaAlign = 64;

// The backend whose PackForDecode is running on this thread: its Allocate then takes room in
// the decode arena (AllocateRaw), so the copy is still a BackendBuffer freed through FreeRaw.
thread_local const void* t_packing_for = nullptr;

cpu::StoredMatrix Stored(const WeightView& w) {
    return {.dtype = w.dtype,
            .data = static_cast<const uint8_t*>(w.data),
            .rows = w.rows,
            .cols = w.cols,
            .interleaved = static_cast<const uint8_t*>(w.decode_copy)};
}

}  // namespace

CpuBackend::CpuBackend(const BackendConfig& config) : num_threads_(config.num_threads) {
    if (num_threads_ > 0) cpu::SetThisThreadNumThreads(num_threads_);
}

std::string CpuBackend::Describe() const {
    return "cpu (" + std::string(cpu::KernelIsaName(cpu::ActiveKernelIsa())) + " kernels, " +
           std::to_string(num_threads_ > 0 ? num_threads_ : cpu::NumThreads()) + " threads)";
}

Result<void*> CpuBackend::AllocateInArena(size_t bytes) {
    const size_t rounded = (bytes + kArenaAlign - 1) / kArenaAlign * kArenaAlign;
    if (arenas_.empty() || arenas_.back().bytes - arenas_.back().used < rounded) {
        const size_t chunk = std::max(kArenaChunkBytes, (rounded + kHugePageBytes - 1) /
                                                            kHugePageBytes * kHugePageBytes);
        void* base = std::aligned_alloc(kHugePageBytes, chunk);
        if (base == nullptr) {
            return Status(StatusCode::kResourceExhausted,
                          "cpu backend: cannot allocate " + std::to_string(chunk) +
                              " bytes for the decode copies");
        }
        ::madvise(base, chunk, MADV_HUGEPAGE);
        arenas_.push_back({.base = static_cast<uint8_t*>(base), .bytes = chunk});
    }
    DecodeArena& arena = arenas_.back();
    void* p = arena.base + arena.used;
    arena.used += rounded;
    ++arena.live;
    return p;
}

Result<void*> CpuBackend::AllocateRaw(size_t bytes) {
    if (t_packing_for == this) {
        std::lock_guard<std::mutex> lock(arena_mu_);
        return AllocateInArena(bytes);
    }
    // Buffers of a huge page or more start on a huge page, so that AdviseUse can back them with
    // huge pages (the alignment costs address space, not memory).
    const bool huge = bytes >= kHugePageBytes;
    const size_t align = huge ? kHugePageBytes : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) {
        return Status(StatusCode::kResourceExhausted,
                      "cpu backend: cannot allocate " + std::to_string(bytes) + " bytes");
    }
    return p;
}

void CpuBackend::AdviseUse(void* data, size_t bytes, BufferUse use) {
    // Resident buffers (the weights, their decode copies, the KV pool) get transparent huge
    // pages, which this kind of system grants only on request (/sys/kernel/mm/transparent_hugepage/
    // enabled = madvise): a batch-1 decode streams ~100 MB of weights a token, and in 4 KiB pages
    // every page of it is a TLB miss. Only the whole huge pages inside the buffer are advised: a
    // huge page is committed in full at its first touch, so advising the tail would commit up to
    // 2 MiB past the buffer's end. Scratch (the step workspace) keeps 4 KiB pages: a decode step
    // touches a few KiB of each of its slices, and in huge pages each slice would commit 2 MiB.
    // Advice only: without THP in the kernel the buffer keeps 4 KiB pages.
    if (use != BufferUse::kResident || bytes < kHugePageBytes) return;
    if (reinterpret_cast<uintptr_t>(data) % kHugePageBytes != 0) return;
    ::madvise(data, bytes / kHugePageBytes * kHugePageBytes, MADV_HUGEPAGE);
}

void CpuBackend::FreeRaw(void* data, size_t) {
    {
        std::lock_guard<std::mutex> lock(arena_mu_);
        auto* p = static_cast<uint8_t*>(data);
        for (auto it = arenas_.begin(); it != arenas_.end(); ++it) {
            if (p < it->base || p >= it->base + it->bytes) continue;
            if (--it->live == 0) {
                std::free(it->base);
                arenas_.erase(it);
            }
            return;
        }
    }
    std::free(data);
}

Status CpuBackend::CopyToDevice(void* dst, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return Status::Ok();
}

Status CpuBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return Status::Ok();
}

bool CpuBackend::CanCopyFromPeer(const Backend& src) const {
    return dynamic_cast<const CpuBackend*>(&src) != nullptr;
}

Status CpuBackend::CopyFromPeer(void* dst, const Backend& src, const void* src_data, size_t bytes) {
    if (!CanCopyFromPeer(src)) {
        return InvalidArgument("cpu backend: a peer copy from the " + src.Describe() +
                               " backend (only from another CPU backend)");
    }
    if (bytes > 0) std::memcpy(dst, src_data, bytes);
    return Status::Ok();
}

Result<BackendBuffer> CpuBackend::PackForDecode(WeightView* w) {
    const cpu::StoredMatrix stored = Stored(*w);
    // With 8-bit activations (KVSHARD_MATMUL_ACTIVATIONS=int8) single rows take the int8
    // kernels over the stored rows: a copy would only cost memory.
    const size_t bytes = cpu::QuantizesActivations(w->dtype) ? 0 : cpu::InterleavedBytes(stored);
    if (bytes == 0) return BackendBuffer();
    // In the decode arena (AllocateRaw): huge pages for copies smaller than one.
    t_packing_for = this;
    Result<BackendBuffer> allocated = Allocate(bytes, BufferUse::kResident);
    t_packing_for = nullptr;
    KV_ASSIGN_OR_RETURN(BackendBuffer copy, std::move(allocated));
    cpu::InterleaveRows(stored, copy.As<uint8_t>());
    w->decode_copy = copy.data();
    return copy;
}

void CpuBackend::Embedding(const WeightView& table, int64_t row_offset, const int32_t* ids,
                           int64_t n, float* out) {
    cpu::EmbeddingRows(Stored(table), row_offset, ids, n, out);
}

void CpuBackend::MatMul(const float* x, int64_t m, const WeightView& w, float* y) {
    if (m == 0 || w.rows == 0) return;
    cpu::MatMulStored(x, m, Stored(w), y);
}

void CpuBackend::RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
                         float eps) {
    cpu::RmsNorm(x, weight, out, rows, dim, eps);
}

void CpuBackend::AddRmsNorm(float* residual, const float* delta, const float* weight, float* out,
                            int64_t rows, int64_t dim, float eps) {
    cpu::AddRmsNorm(residual, delta, weight, out, rows, dim, eps);
}

void CpuBackend::Add(float* x, const float* y, int64_t n) { cpu::Add(x, y, x, n); }

void CpuBackend::Rope(float* x, int64_t row_stride, const int32_t* positions, int64_t rows,
                      int64_t num_heads, int64_t head_dim, const float* inv_freq) {
    cpu::Rope(x, positions, rows, num_heads, head_dim, inv_freq, row_stride);
}

void CpuBackend::SiluMul(const float* gate_up, int64_t rows, int64_t dim, float* out) {
    cpu::SiluMulFused(gate_up, out, rows, dim);
}

void CpuBackend::GeluTanhMul(const float* gate_up, int64_t rows, int64_t dim, float* out) {
    cpu::GeluTanhMulFused(gate_up, out, rows, dim);
}

void CpuBackend::AddBias(float* x, const float* bias, int64_t rows, int64_t dim) {
    cpu::AddBias(x, bias, rows, dim);
}

void CpuBackend::HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads,
                             int64_t head_dim, const float* weight, float eps) {
    cpu::HeadRmsNorm(x, row_stride, rows, num_heads, head_dim, weight, eps);
}

void CpuBackend::Scale(float* x, float s, int64_t n) { cpu::Scale(x, s, n); }

void CpuBackend::KvWrite(const PagedKvLayer& kv, const float* k, const float* v, int64_t row_stride,
                         const int64_t* slots, int64_t n) {
    cpu::PagedKvWrite(kv, k, v, row_stride, slots, n);
}

void CpuBackend::RopeKvWrite(float* q, float* k, const float* v, int64_t row_stride,
                             const int32_t* positions, const int64_t* slots, int64_t rows,
                             int64_t num_heads, const float* inv_freq, const PagedKvLayer& kv) {
    KV_CHECK(row_stride > 0) << "RopeKvWrite: row_stride " << row_stride;
    for (int64_t r0 = 0; r0 < rows; r0 += kRopeKvWriteRows) {
        const int64_t n = std::min(kRopeKvWriteRows, rows - r0);
        const int64_t at = r0 * row_stride;
        if (k == q + num_heads * kv.head_dim) {
            // K heads right after the Q heads (a fused QKV row, as the ModelRunner's): one call
            // rotates both and computes each row's cos/sin once, as the separate Rope does.
            cpu::Rope(q + at, positions + r0, n, num_heads + kv.num_kv_heads, kv.head_dim, inv_freq,
                      row_stride);
        } else {
            cpu::Rope(q + at, positions + r0, n, num_heads, kv.head_dim, inv_freq, row_stride);
            cpu::Rope(k + at, positions + r0, n, kv.num_kv_heads, kv.head_dim, inv_freq,
                      row_stride);
        }
        cpu::PagedKvWrite(kv, k + at, v + at, row_stride, slots + r0, n);
    }
}

void CpuBackend::PagedAttention(const float* q, int64_t q_stride, const PagedKvLayer& kv,
                                const PagedAttentionBatch& batch, float* out, int64_t num_heads,
                                const int32_t* kv_head_of_q) {
    cpu::PagedAttentionBatched(q, q_stride, kv, batch, out, num_heads, kv_head_of_q);
}

void CpuBackend::CopyBlocks(void* pool, int64_t bytes_per_block, const int32_t* src_dst,
                            int64_t num_pairs) {
    auto* base = static_cast<uint8_t*>(pool);
    for (int64_t i = 0; i < num_pairs; ++i) {
        const int64_t src = src_dst[2 * i];
        const int64_t dst = src_dst[2 * i + 1];
        std::memcpy(base + dst * bytes_per_block, base + src * bytes_per_block,
                    static_cast<size_t>(bytes_per_block));
    }
}

void CpuBackend::GatherRows(const float* x, int64_t dim, const int32_t* rows, int64_t n,
                            float* out) {
    for (int64_t i = 0; i < n; ++i) {
        std::memcpy(out + i * dim, x + int64_t(rows[i]) * dim, static_cast<size_t>(dim) * 4);
    }
}

}  // namespace kvshard
