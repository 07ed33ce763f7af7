// The KV handoff from device pools on the CUDA backend (skipped without a device; run by
// scripts/gpu-check's handoff step): the host-staged pack and unpack through CudaBackend's copies,
// and the peer copy (CudaBackend's PeerCopy) between two backends — on two GPUs when there are
// two, else two backends of the one GPU — write exactly the bytes the CPU backend's pools hold
// after the same handoff, for whole blocks (equal tp) and for half of the heads (re-sharding);
// and the KV pair path's staging in device buffers packs and unpacks the CPU's bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/device.h"
#include "kernels/backend.h"
#include "worker/kv_handoff.h"
#include "worker/kv_handoff_pairs_buffers.h"
#include "worker/kv_pool.h"

namespace kvshard {
namespace {

constexpr int64_t kLayers = 4, kHeads = 4, kBlocks = 16;

KvPoolConfig Config(int64_t heads) {
    return {.num_blocks = kBlocks, .block_size = 16, .num_layers = kLayers, .num_kv_heads = heads,
            .head_dim = 64, .storage = KvDtype::kInt8};
}

ShardLayout Holding(int64_t begin, int64_t end) {
    ShardLayout l;
    l.kv_heads = {begin, end};
    return l;
}

std::vector<uint8_t> Contents(Backend& b, KvPool& pool) {
    std::vector<uint8_t> host(static_cast<size_t>(pool.num_bytes()));
    KV_CHECK(b.CopyToHost(host.data(), pool.data(), host.size()).ok());
    KV_CHECK(b.Synchronize().ok());
    return host;
}

std::unique_ptr<KvPool> MakePool(Backend& b, int64_t heads) {
    Result<std::unique_ptr<KvPool>> p = KvPool::Create(Config(heads), b);
    KV_CHECK(p.ok()) << p.status().ToString();
    return std::move(*p);
}

void Fill(Backend& b, KvPool& pool, const std::vector<uint8_t>& bytes) {
    KV_CHECK(pool.num_bytes() == int64_t(bytes.size()));
    KV_CHECK(b.CopyToDevice(pool.data(), bytes.data(), bytes.size()).ok());
    KV_CHECK(b.Synchronize().ok());
}

// A pool of `heads` heads on `b` holding `bytes`.
std::unique_ptr<KvPool> PoolHolding(Backend& b, int64_t heads, const std::vector<uint8_t>& bytes) {
    std::unique_ptr<KvPool> pool = MakePool(b, heads);
    Fill(b, *pool, bytes);
    return pool;
}

std::vector<uint8_t> Random(int64_t bytes, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> v(static_cast<size_t>(bytes));
    for (uint8_t& x : v) x = uint8_t(rng());
    return v;
}

TEST(KvHandoffGpu, HostStagedAndPeerCopiesMatchTheCpu) {
    Result<std::unique_ptr<Backend>> src = MakeBackend({.kind = BackendKind::kCuda, .device = 0});
    if (!src.ok()) GTEST_SKIP() << src.status().ToString();
    Result<std::unique_ptr<Backend>> dst =
        MakeBackend({.kind = BackendKind::kCuda, .device = DeviceCount() > 1 ? 1 : 0});
    ASSERT_TRUE(dst.ok()) << dst.status().ToString();
    Result<std::unique_ptr<Backend>> cpu = MakeBackend({.kind = BackendKind::kCpu});
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    ASSERT_NE(dynamic_cast<PeerCopy*>(dst->get()), nullptr);

    const std::vector<int32_t> from = {3, 4, 5, 11}, to = {0, -1, 8, 9};
    const ShardLayout all = Holding(0, kHeads);
    for (IndexRange heads : {IndexRange{0, kHeads}, IndexRange{2, kHeads}}) {
        SCOPED_TRACE("heads from " + std::to_string(heads.begin));
        const ShardLayout recv = Holding(heads.begin, heads.end);
        // The same contents on the CPU and on the GPUs.
        const std::vector<uint8_t> bytes = Random(MakePool(**cpu, kHeads)->num_bytes(), 1);
        auto cpu_src = PoolHolding(**cpu, kHeads, bytes);
        auto gpu_src = PoolHolding(**src, kHeads, bytes);
        const std::vector<uint8_t> before = Random(MakePool(**cpu, heads.size())->num_bytes(), 2);
        auto cpu_dst = PoolHolding(**cpu, heads.size(), before);
        auto staged = PoolHolding(**dst, heads.size(), before);
        auto peer = PoolHolding(**dst, heads.size(), before);

        KvPiece cpu_piece, gpu_piece;
        ASSERT_TRUE(
            PackKvPiece(**cpu, *cpu_src, all, 1, from, 0, kLayers, heads, &cpu_piece).ok());
        ASSERT_TRUE(UnpackKvPiece(**cpu, cpu_piece, *cpu_dst, recv, to).ok());
        Status st = PackKvPiece(**src, *gpu_src, all, 1, from, 0, kLayers, heads, &gpu_piece);
        ASSERT_TRUE(st.ok()) << st.ToString();
        EXPECT_EQ(gpu_piece.header, cpu_piece.header);
        EXPECT_TRUE(gpu_piece.data == cpu_piece.data);
        st = UnpackKvPiece(**dst, gpu_piece, *staged, recv, to);
        ASSERT_TRUE(st.ok()) << st.ToString();
        st = CopyKvBetweenPools(**src, *gpu_src, all, from, **dst, *peer, recv, to, 0, kLayers,
                                heads);
        ASSERT_TRUE(st.ok()) << st.ToString();
        const std::vector<uint8_t> want = Contents(**cpu, *cpu_dst);
        EXPECT_TRUE(Contents(**dst, *staged) == want) << "host-staged";
        EXPECT_TRUE(Contents(**dst, *peer) == want) << "peer copy";
    }
}

// The KV pair path's staging (worker/kv_handoff_pairs_buffers.h) on the CUDA backend: a pair's
// heads packed from a device pool into a device buffer (KvPairBuffers, copies within the backend)
// hold exactly the bytes the CPU backend packs, and unpacked into a device pool of the receiving
// rank's heads write exactly what the CPU writes — whole blocks and half of the heads.
TEST(KvHandoffGpu, PairStagingInDeviceBuffersMatchesTheCpu) {
    Result<std::unique_ptr<Backend>> gpu = MakeBackend({.kind = BackendKind::kCuda, .device = 0});
    if (!gpu.ok()) GTEST_SKIP() << gpu.status().ToString();
    Result<std::unique_ptr<Backend>> cpu = MakeBackend({.kind = BackendKind::kCpu});
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    Result<KvPairStaging> gpu_staging = KvPairStaging::Of(gpu->get());
    ASSERT_TRUE(gpu_staging.ok()) << gpu_staging.status().ToString();
    Result<KvPairStaging> cpu_staging = KvPairStaging::Of(cpu->get());
    ASSERT_TRUE(cpu_staging.ok()) << cpu_staging.status().ToString();
    KvPairBuffers gpu_buffers(gpu->get(), int64_t{1} << 26),
        cpu_buffers(cpu->get(), int64_t{1} << 26);

    const std::vector<int32_t> from = {3, 4, 5, 11}, to = {0, -1, 8, 9};
    const ShardLayout all = Holding(0, kHeads);
    for (IndexRange heads : {IndexRange{0, kHeads}, IndexRange{2, kHeads}}) {
        SCOPED_TRACE("heads from " + std::to_string(heads.begin));
        const ShardLayout recv = Holding(heads.begin, heads.end);
        const std::vector<uint8_t> bytes = Random(MakePool(**cpu, kHeads)->num_bytes(), 3);
        auto cpu_src = PoolHolding(**cpu, kHeads, bytes);
        auto gpu_src = PoolHolding(**gpu, kHeads, bytes);
        const std::vector<uint8_t> before = Random(MakePool(**cpu, heads.size())->num_bytes(), 4);
        auto cpu_dst = PoolHolding(**cpu, heads.size(), before);
        auto gpu_dst = PoolHolding(**gpu, heads.size(), before);

        const std::vector<KvCopyRun> send = KvCopyRuns(*cpu_src, all, from, 0, kLayers, heads);
        const std::vector<KvCopyRun> receive = KvCopyRuns(*cpu_dst, recv, to, 0, kLayers, heads);
        int64_t piece = 0;
        for (const KvCopyRun& r : send) piece = std::max(piece, r.piece_offset + r.bytes);
        Result<KvPairBuffers::Held> gpu_buffer = gpu_buffers.Take(piece);
        ASSERT_TRUE(gpu_buffer.ok()) << gpu_buffer.status().ToString();
        Result<KvPairBuffers::Held> cpu_buffer = cpu_buffers.Take(piece);
        ASSERT_TRUE(cpu_buffer.ok()) << cpu_buffer.status().ToString();

        Status st = gpu_staging->Pack(send, gpu_src->BlockData(0), (*gpu_buffer)->As<uint8_t>());
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_TRUE((*gpu)->Synchronize().ok());
        ASSERT_TRUE(
            cpu_staging->Pack(send, cpu_src->BlockData(0), (*cpu_buffer)->As<uint8_t>()).ok());
        std::vector<uint8_t> packed(static_cast<size_t>(piece));
        ASSERT_TRUE((*gpu)->CopyToHost(packed.data(), (*gpu_buffer)->data(), packed.size()).ok());
        ASSERT_TRUE((*gpu)->Synchronize().ok());
        EXPECT_EQ(std::memcmp(packed.data(), (*cpu_buffer)->data(), packed.size()), 0) << "pack";

        st = gpu_staging->Unpack(receive, (*gpu_buffer)->As<uint8_t>(),
                                 gpu_dst->MutableBlockData(0));
        ASSERT_TRUE(st.ok()) << st.ToString();
        ASSERT_TRUE((*gpu)->Synchronize().ok());
        ASSERT_TRUE(
            cpu_staging->Unpack(receive, (*cpu_buffer)->As<uint8_t>(), cpu_dst->MutableBlockData(0))
                .ok());
        EXPECT_TRUE(Contents(**gpu, *gpu_dst) == Contents(**cpu, *cpu_dst)) << "unpack";
    }
}

}  // namespace
}  // namespace kvshard
