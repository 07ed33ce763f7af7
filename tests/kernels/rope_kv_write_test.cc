// The fused RoPE + KV write (RopeKvWriter, kernels/backend.h) against the ops it replaces: on
// each backend that implements it, RopeKvWrite over a fused QKV step equals Rope (q), Rope (k)
// then KvWrite on the same backend — the rotated q and k and the pool's bytes, every storage,
// padded rows (negative slots) included. The CPU backend always runs; CUDA where a device is.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu_ops.h"
#include "kernels/paged_attention.h"

namespace kvshard {
namespace {

struct Fixture {
    int64_t rows, num_heads, kv_heads, hd, bs = 16, blocks = 12;
    KvDtype storage;
    std::vector<float> qkv;
    std::vector<int32_t> positions;
    std::vector<int64_t> slots;
    std::vector<float> inv_freq;
    int64_t block_bytes() const { return cpu::PagedLayerBytes(storage, bs, kv_heads, hd); }
    int64_t stride() const { return (num_heads + 2 * kv_heads) * hd; }
};

Fixture MakeFixture(int64_t rows, int64_t num_heads, int64_t kv_heads, int64_t hd,
                    KvDtype storage, uint32_t seed) {
    Fixture f{rows, num_heads, kv_heads, hd, 16, 12, storage, {}, {}, {}, {}};
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    f.qkv.resize(static_cast<size_t>(rows * f.stride()));
    for (float& x : f.qkv) x = u(rng);
    std::vector<int64_t> free_slots(static_cast<size_t>(f.blocks * f.bs));
    for (size_t i = 0; i < free_slots.size(); ++i) free_slots[i] = static_cast<int64_t>(i);
    std::shuffle(free_slots.begin(), free_slots.end(), rng);
    for (int64_t r = 0; r < rows; ++r) {
        f.positions.push_back(static_cast<int32_t>(r * 37 % 5000));  // angles past 2π
        f.slots.push_back(r % 7 == 6 ? -1 : free_slots[static_cast<size_t>(r)]);  // padded rows
    }
    f.inv_freq.resize(static_cast<size_t>(hd / 2));
    cpu::RopeInvFreq(hd, 500000.0f, cpu::RopeScalingParams{}, f.inv_freq.data());
    return f;
}

struct Outputs {
    std::vector<float> qkv;
    std::vector<uint8_t> pool;
};

// Runs the step on `backend`, fused or as the three plain ops.
Outputs RunStep(Backend& backend, const Fixture& f, bool fused) {
    auto put = [&](const void* host, size_t bytes) {
        Result<BackendBuffer> buf = backend.Allocate(std::max<size_t>(bytes, 1));
        KV_CHECK(buf.ok()) << buf.status().ToString();
        KV_CHECK(backend.CopyToDevice(buf->data(), host, bytes).ok());
        return std::move(*buf);
    };
    const size_t pool_bytes = static_cast<size_t>(f.blocks * f.block_bytes());
    std::vector<uint8_t> zero_pool(pool_bytes, 0);
    BackendBuffer qkv = put(f.qkv.data(), f.qkv.size() * 4);
    BackendBuffer pos = put(f.positions.data(), f.positions.size() * 4);
    BackendBuffer slots = put(f.slots.data(), f.slots.size() * 8);
    BackendBuffer inv = put(f.inv_freq.data(), f.inv_freq.size() * 4);
    BackendBuffer pool = put(zero_pool.data(), pool_bytes);
    const PagedKvLayer kv = cpu::MakePagedKvLayer(pool.As<uint8_t>(), f.block_bytes(), 0, f.storage,
                                                  f.bs, f.kv_heads, f.hd);
    float* q = qkv.As<float>();
    float* k = q + f.num_heads * f.hd;
    const float* v = k + f.kv_heads * f.hd;
    if (fused) {
        auto* writer = dynamic_cast<RopeKvWriter*>(&backend);
        KV_CHECK(writer != nullptr);
        writer->RopeKvWrite(q, k, v, f.stride(), pos.As<int32_t>(), slots.As<int64_t>(), f.rows,
                            f.num_heads, inv.As<float>(), kv);
    } else {
        backend.Rope(q, f.stride(), pos.As<int32_t>(), f.rows, f.num_heads, f.hd, inv.As<float>());
        backend.Rope(k, f.stride(), pos.As<int32_t>(), f.rows, f.kv_heads, f.hd, inv.As<float>());
        backend.KvWrite(kv, k, v, f.stride(), slots.As<int64_t>(), f.rows);
    }
    Outputs out{std::vector<float>(f.qkv.size()), std::vector<uint8_t>(pool_bytes)};
    KV_CHECK(backend.CopyToHost(out.qkv.data(), qkv.data(), f.qkv.size() * 4).ok());
    KV_CHECK(backend.CopyToHost(out.pool.data(), pool.data(), pool_bytes).ok());
    KV_CHECK(backend.Synchronize().ok());
    return out;
}

void ExpectFusedEqualsPlain(BackendKind kind) {
    Result<std::unique_ptr<Backend>> backend = MakeBackend({.kind = kind});
    if (!backend.ok()) GTEST_SKIP() << backend.status().ToString();
    ASSERT_NE(dynamic_cast<RopeKvWriter*>(backend->get()), nullptr);
    int seed = 0;
    for (KvDtype storage :
         {KvDtype::kFp32, KvDtype::kBf16, KvDtype::kFp16, KvDtype::kInt8, KvDtype::kFp8}) {
        // Llama-3-8B's group (32 on 8), SmolLM2's (9 on 3), MHA; row counts across the CPU's
        // 64-row blocks.
        for (auto [rows, heads, kv_heads, hd] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 32, 8, 128},
                                                 {70, 9, 3, 64},
                                                 {130, 4, 4, 32}}) {
            const Fixture f = MakeFixture(rows, heads, kv_heads, hd, storage, 100 + seed++);
            const Outputs plain = RunStep(**backend, f, false);
            const Outputs fused = RunStep(**backend, f, true);
            ASSERT_EQ(fused.qkv.size(), plain.qkv.size());
            for (size_t i = 0; i < plain.qkv.size(); ++i) {
                ASSERT_EQ(fused.qkv[i], plain.qkv[i])
                    << "storage " << int(storage) << " rows " << rows << " float " << i;
            }
            ASSERT_EQ(fused.pool, plain.pool) << "storage " << int(storage) << " rows " << rows;
            // Something was stored, and the padded rows' slots were not.
            size_t nonzero = 0;
            for (uint8_t b : fused.pool) nonzero += b != 0;
            EXPECT_GT(nonzero, 0u);
        }
    }
}

TEST(RopeKvWrite, CpuFusedEqualsRopeThenKvWrite) { ExpectFusedEqualsPlain(BackendKind::kCpu); }

TEST(RopeKvWrite, CudaFusedEqualsRopeThenKvWrite_Gpu) {
    ExpectFusedEqualsPlain(BackendKind::kCuda);
}

// The rotation really is applied (the fused op is not a copy): position 0 leaves a head as it
// is, another position turns each pair by pos × inv_freq.
TEST(RopeKvWrite, RotatesPairsByPositionTimesFrequency) {
    Result<std::unique_ptr<Backend>> backend = MakeBackend({.kind = BackendKind::kCpu});
    ASSERT_TRUE(backend.ok());
    Fixture f = MakeFixture(2, 2, 1, 8, KvDtype::kFp32, 7);
    f.positions = {0, 3};
    const Outputs out = RunStep(**backend, f, true);
    for (int64_t i = 0; i < 2 * f.hd; ++i) EXPECT_EQ(out.qkv[i], f.qkv[i]);  // row 0's q
    const float* q1 = f.qkv.data() + f.stride();
    for (int64_t p = 0; p < f.hd / 2; ++p) {
        const float a = 3.0f * f.inv_freq[p];
        EXPECT_NEAR(out.qkv[f.stride() + 2 * p], q1[2 * p] * std::cos(a) - q1[2 * p + 1] * std::sin(a), 1e-5);
    }
}

}  // namespace
}  // namespace kvshard
