// What the CUDA backend's GPU suites (cuda_backend_test.cc, cuda_prefill_tc_test.cc) share: random
// operands, the relative L2 error they bound, a fixture with a CUDA backend and the CPU backend it
// is checked against (it skips without a device), and sequences laid out in a paged KV pool that
// both backends write the same K/V into.
// CUDA builds only.
#pragma once

#include "common/build_config.h"

#if KVSHARD_WITH_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "common/device.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda_test {

// `n` values uniform in [-scale, scale), the same for the same seed.
inline std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return v;
}

// Relative L2 error of `got` against `want`; infinite when any of `got` is NaN.
inline double RelL2(const std::vector<float>& got, const std::vector<float>& want) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i])) return INFINITY;
        num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        den += double(want[i]) * want[i];
    }
    return std::sqrt(num / den);
}

// Sequences of ctx[s] KV rows, the last news[s] of them queries, in a pool of `bs`-slot blocks
// handed out in reverse (so the tables are not the identity).
struct PagedLayout {
    int64_t total = 0;                  // KV rows of all sequences
    int64_t blocks = 0;                 // blocks of the pool
    std::vector<int32_t> flat;          // the block tables, one after the other
    std::vector<int32_t> table_starts;  // sequence s's table: flat[table_starts[s]...]
    std::vector<int32_t> query_starts;  // sequence s's queries: rows query_starts[s]...
    std::vector<int64_t> slots;         // each KV row's slot, sequence by sequence
};

inline PagedLayout LayOutPaged(const std::vector<int32_t>& ctx, const std::vector<int32_t>& news,
                               int64_t bs) {
    PagedLayout out;
    for (int32_t c : ctx) {
        out.total += c;
        out.blocks += (c + bs - 1) / bs;
    }
    out.table_starts = {0};
    out.query_starts = {0};
    int32_t next = int32_t(out.blocks);
    for (size_t s = 0; s < ctx.size(); ++s) {
        const size_t first = out.flat.size();
        for (int32_t p = 0; p < ctx[s]; p += bs) out.flat.push_back(--next);
        for (int32_t p = 0; p < ctx[s]; ++p) {
            out.slots.push_back(int64_t(out.flat[first + p / bs]) * bs + p % bs);
        }
        out.table_starts.push_back(int32_t(out.flat.size()));
        out.query_starts.push_back(out.query_starts.back() + news[s]);
    }
    return out;
}

// A CUDA backend (gpu_, cuda_) and the CPU backend (cpu_) on the same inputs; device copies of
// host vectors (Put) live as long as the test. Skips without a device.
class CudaGpuTest : public ::testing::Test {
  protected:
    void SetUp() override {
        if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
        Result<std::unique_ptr<Backend>> b = MakeBackend({.kind = BackendKind::kCuda});
        ASSERT_TRUE(b.ok()) << b.status().ToString();
        gpu_ = std::move(*b);
        cuda_ = static_cast<cuda::CudaBackend*>(gpu_.get());
        cpu_ = std::make_unique<CpuBackend>(BackendConfig{});
    }

    template <typename T>
    T* Put(const std::vector<T>& host) {
        Result<BackendBuffer> buf = gpu_->Allocate(std::max<size_t>(64, host.size() * sizeof(T)));
        KV_CHECK(buf.ok()) << buf.status().ToString();
        KV_CHECK(gpu_->CopyToDevice(buf->data(), host.data(), host.size() * sizeof(T)).ok());
        buffers_.push_back(std::move(*buf));
        return buffers_.back().As<T>();
    }
    template <typename T>
    std::vector<T> Get(const T* dev, size_t n) {
        std::vector<T> out(n);
        KV_CHECK(gpu_->CopyToHost(out.data(), dev, n * sizeof(T)).ok());
        const Status st = gpu_->Synchronize();
        KV_CHECK(st.ok()) << st.ToString();
        return out;
    }

    // A pool of `layout`'s blocks on each backend (zeroed, `layers` layers of `storage`; layer 0
    // viewed) and the same K/V rows written into both by their own KvWrite: K uniform in [-2, 2)
    // from `k_seed`, V in [-1, 1) from `v_seed`.
    struct KvPools {
        std::vector<uint8_t> cpu_pool;  // cpu_kv points into it (a move keeps it there)
        uint8_t* gpu_pool = nullptr;
        PagedKvLayer cpu_kv, gpu_kv;
    };
    KvPools WriteSameKv(const PagedLayout& layout, KvDtype storage, int64_t bs, int64_t kv_heads,
                        int64_t hd, uint32_t k_seed, uint32_t v_seed, int64_t layers = 1) {
        KvPools out;
        const int64_t block_bytes = layers * cpu::PagedLayerBytes(storage, bs, kv_heads, hd);
        out.cpu_pool.assign(static_cast<size_t>(layout.blocks * block_bytes), 0);
        out.gpu_pool = Put(out.cpu_pool);
        const int64_t kvw = kv_heads * hd;
        const std::vector<float> k = Random(layout.total * kvw, k_seed, 2.0f),
                                 v = Random(layout.total * kvw, v_seed);
        out.cpu_kv =
            cpu::MakePagedKvLayer(out.cpu_pool.data(), block_bytes, 0, storage, bs, kv_heads, hd);
        out.gpu_kv = cpu::MakePagedKvLayer(out.gpu_pool, block_bytes, 0, storage, bs, kv_heads, hd);
        cpu_->KvWrite(out.cpu_kv, k.data(), v.data(), kvw, layout.slots.data(), layout.total);
        gpu_->KvWrite(out.gpu_kv, Put(k), Put(v), kvw, Put(layout.slots), layout.total);
        return out;
    }

    // The batch of `layout`'s sequences (context lengths `ctx`) on the host, and on the device.
    static PagedAttentionBatch HostBatch(const PagedLayout& layout, const std::vector<int32_t>& ctx,
                                         int64_t window) {
        return {.num_seqs = int64_t(ctx.size()),
                .query_starts = layout.query_starts.data(),
                .context_lens = ctx.data(),
                .block_table_starts = layout.table_starts.data(),
                .block_tables = layout.flat.data(),
                .window = window};
    }
    PagedAttentionBatch DeviceBatch(const PagedLayout& layout, const std::vector<int32_t>& ctx,
                                    int64_t window) {
        return {.num_seqs = int64_t(ctx.size()),
                .query_starts = Put(layout.query_starts),
                .context_lens = Put(ctx),
                .block_table_starts = Put(layout.table_starts),
                .block_tables = Put(layout.flat),
                .window = window};
    }

    std::unique_ptr<Backend> gpu_;
    cuda::CudaBackend* cuda_ = nullptr;
    std::unique_ptr<CpuBackend> cpu_;
    std::vector<BackendBuffer> buffers_;
};

}  // namespace kvshard::cuda_test

#endif  // KVSHARD_WITH_CUDA
