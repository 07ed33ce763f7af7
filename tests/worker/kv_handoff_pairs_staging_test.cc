// The KV pair path's buffers go through the backend (worker/kv_handoff_pairs_buffers.h): every
// rank on a backend that logs its allocations and copies (the CPU backend underneath), a prefill
// instance's offers packed into backend buffers by copies within the backend (PeerCopy with
// itself as the source, never CopyToHost), the channel sending from inside such a buffer, the
// decode ranks receiving into one and unpacking the same way — and their blocks then holding the
// prefill ranks' bytes of their heads, re-sharded tp 2 -> 1 and 1 -> 2. Offer buffers are reused
// by size class, bounded in bytes (an offer past the bound fails and leaves the pair usable) and
// all freed with the handoff; a backend that cannot copy within itself is refused; the links'
// channel makers refuse the backends they cannot send from.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "common/build_config.h"
#include "common/device.h"
#include "kernels/cpu_backend.h"
#include "tests/worker/kv_pair_test_pools.h"
#include "tests/worker/op_log_backend.h"
#include "worker/kv_handoff_nccl_pairs.h"
#include "worker/kv_handoff_pairs.h"

namespace kvshard {
namespace {

constexpr int64_t kLayers = testing::kPairLayers, kBlockSize = testing::kPairBlockSize,
                  kHeadDim = testing::kPairHeadDim, kBlocks = testing::kPairBlocks;

// The CPU backend, logging what the pair path asks of it: allocations (live ones by address),
// host copies, and copies within itself (PeerCopy with itself as the source). With
// self_copies false it has no such copies.
class StagingLogBackend final : public testing::OpLogBackend, public PeerCopy {
  public:
    explicit StagingLogBackend(bool self_copies = true)
        : OpLogBackend(std::make_unique<CpuBackend>(BackendConfig{})), self_copies_(self_copies) {}
    ~StagingLogBackend() override = default;

    int64_t allocations = 0, frees = 0, host_copies = 0, self_copy_bytes = 0;
    std::map<const uint8_t*, size_t> live;

    // Whether [p, p + bytes) lies inside one live allocation.
    bool Owns(const void* p, size_t bytes) const {
        const auto* q = static_cast<const uint8_t*>(p);
        auto it = live.upper_bound(q);
        if (it == live.begin()) return false;
        --it;
        return q + bytes <= it->first + it->second;
    }

    Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
        ++host_copies;
        return OpLogBackend::CopyToDevice(dst, src, bytes);
    }
    Status CopyToHost(void* dst, const void* src, size_t bytes) override {
        ++host_copies;
        return OpLogBackend::CopyToHost(dst, src, bytes);
    }
    bool CanCopyFromPeer(const Backend& src) const override { return self_copies_ && &src == this; }
    Status CopyFromPeer(void* dst, const Backend& src, const void* src_data,
                        size_t bytes) override {
        KV_CHECK(CanCopyFromPeer(src));
        KV_CHECK(Owns(dst, bytes) && Owns(src_data, bytes)) << "a copy outside backend memory";
        self_copy_bytes += static_cast<int64_t>(bytes);
        std::memcpy(dst, src_data, bytes);
        return Status::Ok();
    }

  protected:
    Result<void*> AllocateRaw(size_t bytes) override {
        KV_ASSIGN_OR_RETURN(void* p, OpLogBackend::AllocateRaw(bytes));
        ++allocations;
        live[static_cast<const uint8_t*>(p)] = bytes;
        return p;
    }
    void FreeRaw(void* data, size_t bytes) override {
        ++frees;
        live.erase(static_cast<const uint8_t*>(data));
        OpLogBackend::FreeRaw(data, bytes);
    }

  private:
    const bool self_copies_;
};

ModelSpec Spec() { return testing::PairSpec(); }

struct Rank {
    std::unique_ptr<StagingLogBackend> backend;
    std::unique_ptr<KvPool> pool;
    ShardLayout layout;
};

Rank MakeRank(int rank, int tp, uint32_t seed, bool self_copies = true) {
    Rank r;
    r.backend = std::make_unique<StagingLogBackend>(self_copies);
    r.layout = testing::PairLayout(rank, tp);
    r.pool = testing::RandomPairPool(r.layout, *r.backend, seed);
    return r;
}

// K then V of global head `head`, layer `layer`, block `block`.
std::vector<uint8_t> HeadBytes(const Rank& r, int64_t block, int64_t layer, int64_t head) {
    return testing::PairHeadBytes(*r.pool, r.layout, block, layer, head);
}

// In-memory links keyed by pair id; each channel handed out checks that what it sends from and
// receives into is memory of its rank's backend.
struct Links {
    std::map<std::string, std::unique_ptr<InMemoryKvPairLink>> by_id;
    std::atomic<int64_t> checked{0};  // sends and receives, from both sides' threads

    struct Checked final : KvPairChannel {
        Checked(KvPairChannel* c, StagingLogBackend* b, std::atomic<int64_t>* n)
            : c_(c), b_(b), n_(n) {}
        Status Send(const void* s, size_t n, Clock::time_point d) override {
            EXPECT_TRUE(b_->Owns(s, n)) << "sent from outside the backend's memory";
            ++*n_;
            return c_->Send(s, n, d);
        }
        Status Recv(void* p, size_t n, Clock::time_point d) override {
            EXPECT_TRUE(b_->Owns(p, n)) << "received outside the backend's memory";
            ++*n_;
            return c_->Recv(p, n, d);
        }
        void Abort(const Status& why) override { c_->Abort(why); }
        int rank() const override { return c_->rank(); }
        KvPairChannel* c_;
        StagingLogBackend* b_;
        std::atomic<int64_t>* n_;
    };

    KvNcclRankChannels::MakeChannel Maker(StagingLogBackend* backend) {
        return [this,
                backend](const KvNcclPairAssignment& p) -> Result<std::unique_ptr<KvPairChannel>> {
            auto& link = by_id[p.nccl_unique_id];
            if (link == nullptr) link = std::make_unique<InMemoryKvPairLink>();
            return std::unique_ptr<KvPairChannel>(
                new Checked(link->endpoint(p.nccl_rank), backend, &checked));
        };
    }
};

// Declared so that the handoffs go before the ranks' backends, and those before the links.
struct Cluster {
    Links links;
    std::vector<Rank> prefill, decode;
    std::vector<std::unique_ptr<KvPairHandoff>> send, recv;
};

void Make(Cluster* c, int ptp, int dtp, int64_t max_offer_bytes = kKvPairMaxOfferBytes) {
    int next_id = 0;
    Result<std::vector<KvNcclPair>> pairs = PlanKvNcclPairs(
        Spec(), {{"prefill", ptp}}, {{"decode", dtp}}, [&]() -> Result<std::string> {
            std::string id = std::to_string(next_id++);
            id.resize(kKvNcclUniqueIdBytes, '.');
            return id;
        });
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    for (int r = 0; r < ptp; ++r) c->prefill.push_back(MakeRank(r, ptp, 10 + r));
    for (int r = 0; r < dtp; ++r) c->decode.push_back(MakeRank(r, dtp, 20 + r));
    for (int side = 0; side < 2; ++side) {
        std::vector<Rank>& ranks = side == 0 ? c->prefill : c->decode;
        for (size_t r = 0; r < ranks.size(); ++r) {
            Result<std::unique_ptr<KvPairHandoff>> h = KvPairHandoff::Create(
                KvNcclPairsOfRank(*pairs, side == 0 ? "prefill" : "decode", int(r)),
                c->links.Maker(ranks[r].backend.get()), "in-memory", 2'000,
                {.backend = ranks[r].backend.get(),
                 .pool = ranks[r].pool.get(),
                 .layout = ranks[r].layout,
                 .group_of_layer = {0, 0}},
                max_offer_bytes);
            ASSERT_TRUE(h.ok()) << h.status().ToString();
            (side == 0 ? c->send : c->recv).push_back(std::move(*h));
        }
    }
}

KvSendOp SendOp(uint64_t id) { return testing::PairSendOp(id); }
KvRecvOp RecvOp(uint64_t id) { return testing::PairRecvOp(id); }

class KvPairStagingTp : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(KvPairStagingTp, PackedAndUnpackedByTheBackendByteForByte) {
    const auto [ptp, dtp] = GetParam();
    Cluster c;
    Make(&c, ptp, dtp);
    const std::vector<int32_t> from = {3, 1, 4}, to = {0, 2, 5};
    int64_t offered = 0;
    for (size_t p = 0; p < c.send.size(); ++p) {
        const int64_t allocations = c.prefill[p].backend->allocations;
        Result<int64_t> bytes = c.send[p]->Offer(SendOp(7), {std::span<const int32_t>(from)});
        ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
        EXPECT_GT(*bytes, 0);
        offered += *bytes;
        // Packed into backend memory by copies within the backend, not through the host.
        EXPECT_EQ(c.prefill[p].backend->self_copy_bytes, *bytes);
        EXPECT_EQ(c.prefill[p].backend->host_copies, 0);
        EXPECT_GT(c.prefill[p].backend->allocations, allocations);
    }
    for (auto& s : c.send) s->Ready(7);
    int64_t received = 0;
    for (size_t d = 0; d < c.recv.size(); ++d) {
        Result<int64_t> bytes = c.recv[d]->Receive(RecvOp(7), {std::span<const int32_t>(to)});
        ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
        received += *bytes;
        EXPECT_EQ(c.decode[d].backend->self_copy_bytes, *bytes);
        EXPECT_EQ(c.decode[d].backend->host_copies, 0);
    }
    EXPECT_EQ(received, offered);  // every head once, whatever the split
    EXPECT_GE(c.links.checked.load(), 2 * int64_t(std::max(ptp, dtp)));
    for (const Rank& dst : c.decode) {
        for (int64_t h = dst.layout.kv_heads.begin; h < dst.layout.kv_heads.end; ++h) {
            const Rank* owner = nullptr;
            for (const Rank& p : c.prefill) {
                if (owner == nullptr && p.layout.kv_heads.Contains(h)) owner = &p;
            }
            for (size_t i = 0; i < from.size(); ++i) {
                for (int64_t l = 0; l < kLayers; ++l) {
                    EXPECT_EQ(HeadBytes(dst, to[i], l, h), HeadBytes(*owner, from[i], l, h))
                        << "head " << h << " block " << from[i] << " layer " << l;
                }
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Tps, KvPairStagingTp,
                         ::testing::Values(std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}));

TEST(KvPairStaging, OfferBuffersAreBoundedReusedAndFreed) {
    Cluster c;
    // One transfer of two blocks is 4 KiB here: its size class, 64 KiB, is the whole bound.
    Make(&c, 1, 1, KvPairBufferClass(4096));
    StagingLogBackend& b = *c.prefill[0].backend;
    const std::vector<int32_t> blocks = {2, 3};
    ASSERT_TRUE(c.send[0]->Offer(SendOp(1), {std::span<const int32_t>(blocks)}).ok());
    const int64_t allocations = b.allocations;
    Result<int64_t> over = c.send[0]->Offer(SendOp(2), {std::span<const int32_t>(blocks)});
    ASSERT_FALSE(over.ok());
    EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(over.status().message().find("bound"), std::string::npos) << over.status().message();
    // Dropping the held offer gives its buffer back: the next offer reuses it.
    c.send[0]->Discard(1);
    ASSERT_TRUE(c.send[0]->Offer(SendOp(3), {std::span<const int32_t>(blocks)}).ok());
    EXPECT_EQ(b.allocations, allocations);
    c.send[0]->Ready(3);
    const std::vector<int32_t> into = {0, 4};
    ASSERT_TRUE(c.recv[0]->Receive(RecvOp(3), {std::span<const int32_t>(into)}).ok());
    EXPECT_EQ(HeadBytes(c.decode[0], 4, 1, 3), HeadBytes(c.prefill[0], 3, 1, 3));
    // Every buffer of the pair path is freed with it: only the pool stays.
    const size_t pool_allocations = 1;
    c.send.clear();
    c.recv.clear();
    EXPECT_EQ(b.live.size(), pool_allocations);
    EXPECT_EQ(c.decode[0].backend->live.size(), pool_allocations);
}

TEST(KvPairStaging, ABackendThatCannotCopyWithinItselfIsRefused) {
    Rank r = MakeRank(0, 1, 1, /*self_copies=*/false);
    Links links;
    Result<std::unique_ptr<KvPairHandoff>> h =
        KvPairHandoff::Create({}, links.Maker(r.backend.get()), "in-memory", 1'000,
                              {.backend = r.backend.get(),
                               .pool = r.pool.get(),
                               .layout = r.layout,
                               .group_of_layer = {0, 0}});
    ASSERT_FALSE(h.ok());
    EXPECT_NE(h.status().message().find("cannot copy within its own memory"), std::string::npos)
        << h.status().message();
}

TEST(KvPairBuffers, SizeClasses) {
    const int64_t K = 1024, M = 1024 * K;
    const std::pair<int64_t, int64_t> cases[] = {
        {1, 64 * K},        {64 * K, 64 * K}, {64 * K + 1, 128 * K},      {M, M},
        {M + 1, M + M / 8}, {3 * M, 3 * M},   {3 * M + 1, 3 * M + M / 4},
    };
    for (const auto& [bytes, want] : cases) {
        EXPECT_EQ(KvPairBufferClass(bytes), want) << bytes;
        EXPECT_LE(KvPairBufferClass(bytes), bytes + std::max(64 * K, bytes / 8)) << bytes;
    }
}

TEST(KvPairBuffers, GivenBackFromAnotherThreadAndReusedOnTheOwners) {
    StagingLogBackend backend;
    {
        KvPairBuffers buffers(&backend, 1 << 20);
        Result<KvPairBuffers::Held> a = buffers.Take(5000);
        ASSERT_TRUE(a.ok()) << a.status().ToString();
        EXPECT_EQ(buffers.held_bytes(), KvPairBufferClass(5000));
        const void* first = (*a)->data();
        std::thread sender([held = std::move(*a)]() mutable { held.reset(); });
        sender.join();
        EXPECT_EQ(buffers.held_bytes(), 0);
        EXPECT_EQ(backend.frees, 0);  // given back, not freed, off the owner thread
        Result<KvPairBuffers::Held> b = buffers.Take(6000);  // the same class
        ASSERT_TRUE(b.ok());
        EXPECT_EQ((*b)->data(), first);
        EXPECT_EQ(backend.allocations, 1);
        // A class that does not fit beside the held one is refused; one that fits is made.
        EXPECT_EQ(buffers.Take(1 << 20).status().code(), StatusCode::kResourceExhausted);
        ASSERT_TRUE(buffers.Take(200 << 10).ok());
        EXPECT_EQ(backend.allocations, 2);
    }
    EXPECT_EQ(backend.frees, 2);
    EXPECT_TRUE(backend.live.empty());
}

// At the bound, a kept buffer of a larger class serves a smaller offer as it is: nothing is
// freed on the step thread (a cudaFree would wait for the senders' transfers in flight). Below
// the bound each offer gets its own class.
TEST(KvPairBuffers, AtTheBoundALargerKeptBufferServesBeforeAnyIsFreed) {
    StagingLogBackend backend;
    const int64_t K = 1024;
    {
        KvPairBuffers buffers(&backend, 224 * K);
        Result<KvPairBuffers::Held> big = buffers.Take(190 * K);  // class 192 KiB
        ASSERT_TRUE(big.ok()) << big.status().ToString();
        const void* first = (*big)->data();
        big->reset();  // kept
        // 64 KiB more would pass 224 KiB beside the kept 192: the kept one serves.
        Result<KvPairBuffers::Held> small = buffers.Take(10 * K);
        ASSERT_TRUE(small.ok()) << small.status().ToString();
        EXPECT_EQ((*small)->data(), first);
        EXPECT_EQ(buffers.held_bytes(), 192 * K);
        EXPECT_EQ(backend.allocations, 1);
        EXPECT_EQ(backend.frees, 0);
        small->reset();
        EXPECT_EQ(buffers.held_bytes(), 0);
    }
    EXPECT_EQ(backend.frees, 1);
    // Below the bound an offer gets its own class, the larger kept buffer staying for its own.
    {
        KvPairBuffers buffers(&backend, 512 * K);
        ASSERT_TRUE(buffers.Take(190 * K).ok());  // taken and given back: kept
        Result<KvPairBuffers::Held> small = buffers.Take(10 * K);
        ASSERT_TRUE(small.ok()) << small.status().ToString();
        EXPECT_EQ(buffers.held_bytes(), 64 * K);
        EXPECT_EQ(backend.allocations, 3);
    }
    EXPECT_TRUE(backend.live.empty());
}

TEST(KvPairLinkMaker, EachLinkRefusesTheBackendItCannotSendFrom) {
    Result<KvPairHandoff::MakePairChannel> socket_gpu =
        KvPairHandoff::MakerOf(KvPairLink::kSocket, {.kind = BackendKind::kCuda, .device = 0});
    ASSERT_FALSE(socket_gpu.ok());
    EXPECT_NE(socket_gpu.status().message().find("KVSHARD_KV_PAIR_LINK"), std::string::npos)
        << socket_gpu.status().message();
    EXPECT_TRUE(KvPairHandoff::MakerOf(KvPairLink::kSocket, {.kind = BackendKind::kCpu}).ok());

    Result<KvPairHandoff::MakePairChannel> nccl_cpu =
        KvPairHandoff::MakerOf(KvPairLink::kNccl, {.kind = BackendKind::kCpu});
    ASSERT_FALSE(nccl_cpu.ok());
    EXPECT_NE(nccl_cpu.status().message().find("kv_transfer.path: nccl"), std::string::npos)
        << nccl_cpu.status().message();

    Result<KvPairHandoff::MakePairChannel> nccl_gpu =
        KvPairHandoff::MakerOf(KvPairLink::kNccl, {.kind = BackendKind::kCuda, .device = 0});
    if (!KVSHARD_WITH_CUDA) {
        ASSERT_FALSE(nccl_gpu.ok());
        EXPECT_NE(nccl_gpu.status().message().find("built without CUDA"), std::string::npos);
        return;
    }
    ASSERT_TRUE(nccl_gpu.ok()) << nccl_gpu.status().ToString();
    if (DeviceCount() > 0) return;  // making a channel would wait for a peer
    // No GPU here: the maker reaches MakeNcclKvPairChannel, which names the missing device.
    const KvNcclPairAssignment pair{.peer_instance = "decode",
                                    .peer_rank = 0,
                                    .nccl_rank = 0,
                                    .head_begin = 0,
                                    .head_end = 4,
                                    .nccl_unique_id = std::string(kKvNcclUniqueIdBytes, 'x')};
    Result<std::unique_ptr<KvPairChannel>> made = (*nccl_gpu)(pair, [] { return false; });
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().code(), StatusCode::kUnavailable) << made.status().ToString();
    EXPECT_NE(made.status().message().find("CUDA device 0"), std::string::npos)
        << made.status().message();
}

}  // namespace
}  // namespace kvshard
