// The host-staged KV handoff through a Backend (worker/kv_handoff.h): packing copies the
// handed-over parts of a pool's blocks out through Backend::CopyToHost and unpacking copies a piece
// in through Backend::CopyToDevice — so a pool in device memory hands over the same bytes a host
// pool does — with adjacent runs merged into one copy, and the in-process peer copy between two
// backends (PeerCopy) writing exactly what a piece would. Run on the CPU backend behind a wrapper
// that counts the copies and serves peer copies with memcpy, as a GPU's would be served by
// cudaMemcpyPeerAsync.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "worker/kv_handoff.h"
#include "worker/kv_pool.h"

namespace kvshard {
namespace {

// The CPU backend with its copies counted; a peer copy (from another CountingBackend) is a
// memcpy on this backend's "stream" when `peer_copies` is set.
class CountingBackend final : public Backend, public PeerCopy {
  public:
    explicit CountingBackend(bool peer_copies = false) : peer_copies_(peer_copies) {
        Result<std::unique_ptr<Backend>> b = MakeBackend({.kind = BackendKind::kCpu});
        KV_CHECK(b.ok()) << b.status().ToString();
        inner_ = std::move(*b);
    }
    ~CountingBackend() override { buffers_.clear(); }

    int64_t to_host = 0, to_device = 0, peer = 0, syncs = 0;
    int64_t copied_bytes = 0;

    BackendKind kind() const override { return inner_->kind(); }
    std::string Describe() const override { return "counting " + inner_->Describe(); }
    Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
        ++to_device;
        copied_bytes += static_cast<int64_t>(bytes);
        return inner_->CopyToDevice(dst, src, bytes);
    }
    Status CopyToHost(void* dst, const void* src, size_t bytes) override {
        ++to_host;
        copied_bytes += static_cast<int64_t>(bytes);
        return inner_->CopyToHost(dst, src, bytes);
    }
    Status Synchronize() override {
        ++syncs;
        return inner_->Synchronize();
    }
    bool CanCopyFromPeer(const Backend& src) const override {
        return peer_copies_ && dynamic_cast<const CountingBackend*>(&src) != nullptr;
    }
    Status CopyFromPeer(void* dst, const Backend&, const void* src_data, size_t bytes) override {
        ++peer;
        copied_bytes += static_cast<int64_t>(bytes);
        std::memcpy(dst, src_data, bytes);
        return Status::Ok();
    }

    void Embedding(const WeightView& t, int64_t o, const int32_t* ids, int64_t n,
                   float* out) override {
        inner_->Embedding(t, o, ids, n, out);
    }
    void MatMul(const float* x, int64_t m, const WeightView& w, float* y) override {
        inner_->MatMul(x, m, w, y);
    }
    void RmsNorm(const float* x, const float* w, float* out, int64_t r, int64_t d,
                 float eps) override {
        inner_->RmsNorm(x, w, out, r, d, eps);
    }
    void AddRmsNorm(float* res, const float* delta, const float* w, float* out, int64_t r,
                    int64_t d, float eps) override {
        inner_->AddRmsNorm(res, delta, w, out, r, d, eps);
    }
    void Add(float* x, const float* y, int64_t n) override { inner_->Add(x, y, n); }
    void Rope(float* x, int64_t s, const int32_t* p, int64_t r, int64_t h, int64_t d,
              const float* f) override {
        inner_->Rope(x, s, p, r, h, d, f);
    }
    void SiluMul(const float* g, int64_t r, int64_t d, float* out) override {
        inner_->SiluMul(g, r, d, out);
    }
    void KvWrite(const PagedKvLayer& kv, const float* k, const float* v, int64_t s,
                 const int64_t* slots, int64_t n) override {
        inner_->KvWrite(kv, k, v, s, slots, n);
    }
    void PagedAttention(const float* q, int64_t qs, const PagedKvLayer& kv,
                        const PagedAttentionBatch& b, float* out, int64_t h,
                        const int32_t* map) override {
        inner_->PagedAttention(q, qs, kv, b, out, h, map);
    }
    void CopyBlocks(void* pool, int64_t bpb, const int32_t* sd, int64_t n) override {
        inner_->CopyBlocks(pool, bpb, sd, n);
    }
    void GatherRows(const float* x, int64_t d, const int32_t* rows, int64_t n,
                    float* out) override {
        inner_->GatherRows(x, d, rows, n, out);
    }

  protected:
    Result<void*> AllocateRaw(size_t bytes) override {
        KV_ASSIGN_OR_RETURN(BackendBuffer b, inner_->Allocate(bytes));
        void* p = b.data();
        buffers_.emplace(p, std::move(b));
        return p;
    }
    void FreeRaw(void* data, size_t) override { buffers_.erase(data); }

  private:
    bool peer_copies_;
    std::unique_ptr<Backend> inner_;
    std::map<void*, BackendBuffer> buffers_;
};

constexpr int64_t kLayers = 3, kHeads = 4, kHeadDim = 8, kBlockSize = 4, kBlocks = 12;

KvPoolConfig PoolConfig(KvDtype storage, int64_t kv_heads = kHeads) {
    return {.num_blocks = kBlocks,
            .block_size = kBlockSize,
            .num_layers = kLayers,
            .num_kv_heads = kv_heads,
            .head_dim = kHeadDim,
            .storage = storage};
}

ShardLayout Holding(int64_t begin, int64_t end) {
    ShardLayout l;
    l.kv_heads = {begin, end};
    return l;
}

std::unique_ptr<KvPool> MakePool(Backend& b, const KvPoolConfig& c, uint32_t seed) {
    Result<std::unique_ptr<KvPool>> pool = KvPool::Create(c, b);
    KV_CHECK(pool.ok()) << pool.status().ToString();
    std::mt19937 rng(seed);
    for (int64_t blk = 0; blk < c.num_blocks; ++blk) {
        uint8_t* p = (*pool)->MutableBlockData(blk);
        for (int64_t i = 0; i < (*pool)->bytes_per_block(); ++i) p[i] = uint8_t(rng());
    }
    return std::move(*pool);
}

// The bytes of global head `head` of layer `layer` in block `block` (K, V, then the scales of
// 8-bit storage), read straight off the pool's layout (kernels/paged_attention.h).
std::vector<uint8_t> HeadBytes(const KvPool& pool, const ShardLayout& layout, int64_t block,
                               int64_t layer, int64_t head) {
    const KvPoolConfig& c = pool.config();
    const cpu::PagedKvLayer l = cpu::MakePagedKvLayer(nullptr, 0, pool.SlotOfLayer(layer),
                                                      c.storage, c.block_size, c.num_kv_heads,
                                                      c.head_dim);
    const int64_t h = head - layout.kv_heads.begin;
    const int64_t data = c.block_size * c.head_dim * KvDtypeBytes(c.storage);
    const int64_t scale = KvPoolHasScales(c.storage) ? c.block_size * 4 : 0;
    const uint8_t* b = pool.BlockData(block);
    std::vector<uint8_t> out;
    for (int64_t off : {l.k_offset + h * data, l.v_offset + h * data})
        out.insert(out.end(), b + off, b + off + data);
    if (scale > 0) {
        for (int64_t off : {l.k_scale_offset + h * scale, l.v_scale_offset + h * scale})
            out.insert(out.end(), b + off, b + off + scale);
    }
    return out;
}

class KvHandoffBackend : public ::testing::TestWithParam<KvDtype> {};

// All of a rank's heads and layers of consecutive blocks are one contiguous run per stretch of
// consecutive blocks: the handoff of a whole transfer is a handful of copies, not one per
// block-layer-head.
TEST_P(KvHandoffBackend, WholeBlocksMergeIntoOneCopyPerStretch) {
    CountingBackend src_backend, dst_backend;
    auto src = MakePool(src_backend, PoolConfig(GetParam()), 1);
    auto dst = MakePool(dst_backend, PoolConfig(GetParam()), 2);
    const ShardLayout all = Holding(0, kHeads);
    const std::vector<int32_t> from = {2, 3, 4, 9, 10};  // two stretches
    const std::vector<int32_t> to = {7, 0, 1, 5, 6};     // three stretches
    EXPECT_EQ(KvCopyRuns(*src, all, from, 0, kLayers, all.kv_heads).size(), 2u);
    EXPECT_EQ(KvCopyRuns(*dst, all, to, 0, kLayers, all.kv_heads).size(), 3u);
    KvPiece piece;
    ASSERT_TRUE(PackKvPiece(src_backend, *src, all, 7, from, 0, kLayers, all.kv_heads, &piece).ok());
    EXPECT_EQ(src_backend.to_host, 2);
    EXPECT_EQ(src_backend.syncs, 1);
    EXPECT_EQ(src_backend.copied_bytes, int64_t(piece.data.size()));
    ASSERT_TRUE(UnpackKvPiece(dst_backend, piece, *dst, all, to).ok());
    EXPECT_EQ(dst_backend.to_device, 3);
    EXPECT_EQ(dst_backend.syncs, 1);
    for (size_t i = 0; i < from.size(); ++i) {
        EXPECT_EQ(std::memcmp(src->BlockData(from[i]), dst->BlockData(to[i]),
                              size_t(src->bytes_per_block())),
                  0)
            << "block " << from[i] << " -> " << to[i];
    }
}

// Layer-wise pieces of some heads: two copies per block-layer (four with 8-bit scales), and the
// piece's bytes are the pool's for exactly those heads and layers.
TEST_P(KvHandoffBackend, SomeHeadsOfSomeLayersCopyOnlyTheirBytes) {
    CountingBackend backend;
    auto src = MakePool(backend, PoolConfig(GetParam()), 3);
    const ShardLayout all = Holding(0, kHeads);
    const std::vector<int32_t> blocks = {5, 1};
    KvPiece piece;
    ASSERT_TRUE(PackKvPiece(backend, *src, all, 9, blocks, 1, 2, {1, 3}, &piece).ok());
    const int64_t parts = KvPoolHasScales(GetParam()) ? 4 : 2;
    EXPECT_EQ(backend.to_host, int64_t(blocks.size()) * parts);
    EXPECT_EQ(int64_t(piece.data.size()), KvPieceBytes(piece.header));
    // Walk the piece: block, layer, then K of both heads, V of both, then scales.
    size_t at = 0;
    for (int32_t b : blocks) {
        std::vector<std::vector<uint8_t>> heads = {HeadBytes(*src, all, b, 1, 1),
                                                   HeadBytes(*src, all, b, 1, 2)};
        const size_t data = size_t(kBlockSize * kHeadDim * KvDtypeBytes(GetParam()));
        const size_t scale = KvPoolHasScales(GetParam()) ? size_t(kBlockSize * 4) : 0;
        const size_t part_at[4] = {0, data, 2 * data, 2 * data + scale};
        const size_t part_len[4] = {data, data, scale, scale};
        for (int part = 0; part < parts; ++part) {
            for (const auto& h : heads) {
                ASSERT_EQ(std::memcmp(piece.data.data() + at, h.data() + part_at[part],
                                      part_len[part]),
                          0)
                    << "block " << b << " part " << part;
                at += part_len[part];
            }
        }
    }
    EXPECT_EQ(at, piece.data.size());
}

// Re-sharding through the backend: a tp-1 sender's heads split over two receiving ranks (1 -> 2)
// and two senders' heads gathered by one receiver (2 -> 1) land where each head belongs; a
// negative receiving block is skipped.
TEST_P(KvHandoffBackend, ReshardsHeadsBothWays) {
    CountingBackend backend;
    const ShardLayout all = Holding(0, kHeads);
    const ShardLayout low = Holding(0, 2), high = Holding(2, kHeads);
    auto whole = MakePool(backend, PoolConfig(GetParam()), 4);
    auto r0 = MakePool(backend, PoolConfig(GetParam(), 2), 5);
    auto r1 = MakePool(backend, PoolConfig(GetParam(), 2), 6);
    const std::vector<int32_t> from = {3, 8}, to = {1, -1};
    KvPiece piece;
    for (const ShardLayout* dst : {&low, &high}) {
        ASSERT_TRUE(
            PackKvPiece(backend, *whole, all, 1, from, 0, kLayers, dst->kv_heads, &piece).ok());
        ASSERT_TRUE(UnpackKvPiece(backend, piece, dst == &low ? *r0 : *r1, *dst, to).ok());
    }
    for (int64_t l = 0; l < kLayers; ++l) {
        for (int64_t h = 0; h < kHeads; ++h) {
            const KvPool& rank = h < 2 ? *r0 : *r1;
            EXPECT_EQ(HeadBytes(rank, h < 2 ? low : high, 1, l, h), HeadBytes(*whole, all, 3, l, h))
                << "layer " << l << " head " << h;
        }
    }
    // 2 -> 1: each rank sends its own heads into the whole pool's block 0.
    auto gathered = MakePool(backend, PoolConfig(GetParam()), 7);
    const std::vector<int32_t> one = {1}, zero = {0};
    for (const ShardLayout* src : {&low, &high}) {
        ASSERT_TRUE(PackKvPiece(backend, src == &low ? *r0 : *r1, *src, 2, one, 0, kLayers,
                                src->kv_heads, &piece)
                        .ok());
        ASSERT_TRUE(UnpackKvPiece(backend, piece, *gathered, all, zero).ok());
    }
    EXPECT_EQ(std::memcmp(gathered->BlockData(0), whole->BlockData(3),
                          size_t(whole->bytes_per_block())),
              0);
}

// The peer copy between two backends writes what pack + unpack write, with no piece, and
// merges runs the same way (whole blocks: one copy per stretch common to both sides).
TEST_P(KvHandoffBackend, PeerCopyWritesWhatAPieceWould) {
    CountingBackend src_backend, via_piece_backend, peer_backend(/*peer_copies=*/true);
    auto src = MakePool(src_backend, PoolConfig(GetParam()), 8);
    const ShardLayout all = Holding(0, kHeads), high = Holding(2, kHeads);
    const std::vector<int32_t> from = {0, 1, 2, 6}, to = {4, 5, -1, 11};
    for (IndexRange heads : {IndexRange{0, kHeads}, IndexRange{2, kHeads}}) {
        const ShardLayout& dst_layout = heads.begin == 0 ? all : high;
        const int64_t dst_heads = heads.size();
        auto expected = MakePool(via_piece_backend, PoolConfig(GetParam(), dst_heads), 9);
        auto got = MakePool(peer_backend, PoolConfig(GetParam(), dst_heads), 9);
        KvPiece piece;
        ASSERT_TRUE(PackKvPiece(src_backend, *src, all, 3, from, 0, kLayers, heads, &piece).ok());
        ASSERT_TRUE(UnpackKvPiece(via_piece_backend, piece, *expected, dst_layout, to).ok());
        peer_backend.peer = 0;
        const Status st = CopyKvBetweenPools(src_backend, *src, all, from, peer_backend, *got,
                                             dst_layout, to, 0, kLayers, heads);
        ASSERT_TRUE(st.ok()) << st.ToString();
        for (int64_t b = 0; b < kBlocks; ++b) {
            EXPECT_EQ(std::memcmp(expected->BlockData(b), got->BlockData(b),
                                  size_t(got->bytes_per_block())),
                      0)
                << "heads from " << heads.begin << ", block " << b;
        }
        if (heads.begin == 0) {  // {0,1}->{4,5}, {6}->{11}
            EXPECT_EQ(peer_backend.peer, 2);
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Storages, KvHandoffBackend,
                         ::testing::Values(KvDtype::kFp32, KvDtype::kBf16, KvDtype::kInt8,
                                           KvDtype::kFp8),
                         [](const auto& info) { return std::string(KvDtypeName(info.param)); });

TEST(KvHandoffPeer, RefusedWithoutPeerCopiesOrOnAMismatch) {
    CountingBackend a, plain, peer(/*peer_copies=*/true);
    auto src = MakePool(a, PoolConfig(KvDtype::kFp32), 1);
    auto dst = MakePool(plain, PoolConfig(KvDtype::kFp32), 2);
    const ShardLayout all = Holding(0, kHeads);
    const std::vector<int32_t> blocks = {1};
    Status st = CopyKvBetweenPools(a, *src, all, blocks, plain, *dst, all, blocks, 0, kLayers,
                                   all.kv_heads);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("cannot copy from"), std::string::npos) << st.ToString();
    auto bf16 = MakePool(peer, PoolConfig(KvDtype::kBf16), 3);
    const std::vector<uint8_t> before(bf16->BlockData(1), bf16->BlockData(1) + bf16->bytes_per_block());
    st = CopyKvBetweenPools(a, *src, all, blocks, peer, *bf16, all, blocks, 0, kLayers,
                            all.kv_heads);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("dtype"), std::string::npos) << st.ToString();
    EXPECT_EQ(peer.peer, 0);
    EXPECT_EQ(std::memcmp(before.data(), bf16->BlockData(1), before.size()), 0);
    const std::vector<int32_t> outside = {int32_t(kBlocks)};
    st = CopyKvBetweenPools(a, *src, all, outside, peer, *bf16, all, blocks, 0, kLayers,
                            all.kv_heads);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvshard
