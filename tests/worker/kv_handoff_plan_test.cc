// The host-side plans of the device KV handoffs (worker/kv_handoff.h): the re-shard plan of a
// point-to-point transport (KvReshardPlan: which sending rank's heads go to which receiving
// rank) against the host-staged handoff's rule (KvHeadsToSend) and against every receiving
// rank's own heads, a handoff driven by the plan through one contiguous buffer per message (as
// NCCL sends it) landing each head's bytes where the receiver holds it, and the pool-to-pool
// copy plan of peer copies (KvPoolToPoolCopies).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "kernels/paged_attention.h"
#include "worker/kv_handoff.h"
#include "worker/kv_pool.h"

namespace kvshard {
namespace {

ModelSpec HeadsSpec(int64_t heads, int64_t kv_heads) {
    ModelSpec s;
    s.num_heads = heads;
    s.num_kv_heads = kv_heads;
    s.head_dim = 8;
    s.hidden_size = heads * 8;
    s.ffn_size = 64;
    s.vocab_size = 32;
    s.num_layers = 2;
    return s;
}

bool Splits(const ModelSpec& spec, int tp) {
    return MakeShardLayout(spec, {.rank = 0, .tp = tp}).ok();
}

struct HeadsCase {
    int64_t heads, kv_heads;
};

// Query/KV heads of the test models and of Llama shapes: equal, grouped, replicated (tp above the
// KV heads), uneven (9 query heads over tp 2: KV head 1 held by both ranks).
const HeadsCase kHeadsCases[] = {{8, 8}, {8, 4}, {8, 2}, {9, 3}, {32, 8}, {6, 6}, {4, 1}};

TEST(KvReshardPlan, AgreesWithTheHostStagedRuleForEveryTpPair) {
    for (const HeadsCase& hc : kHeadsCases) {
        const ModelSpec spec = HeadsSpec(hc.heads, hc.kv_heads);
        for (int s = 1; s <= 8; ++s) {
            for (int d = 1; d <= 8; ++d) {
                if (!Splits(spec, s) || !Splits(spec, d)) continue;
                Result<std::vector<KvReshardMessage>> plan = KvReshardPlan(spec, s, d);
                ASSERT_TRUE(plan.ok()) << plan.status().ToString();
                std::vector<KvReshardMessage> host;
                for (int src = 0; src < s; ++src) {
                    for (int dst = 0; dst < d; ++dst) {
                        const IndexRange h = KvHeadsToSend(spec, src, s, dst, d);
                        if (h.size() > 0) host.push_back({src, dst, h});
                    }
                }
                EXPECT_EQ(*plan, host)
                    << hc.heads << "/" << hc.kv_heads << " tp " << s << " -> " << d;
                // Every receiving rank gets each of its heads exactly once, from a rank that
                // holds it.
                for (int dst = 0; dst < d; ++dst) {
                    const ShardLayout want = *MakeShardLayout(spec, {.rank = dst, .tp = d});
                    std::vector<int> got(static_cast<size_t>(hc.kv_heads), 0);
                    for (const KvReshardMessage& m : *plan) {
                        if (m.dst_rank != dst) continue;
                        const ShardLayout from =
                            *MakeShardLayout(spec, {.rank = m.src_rank, .tp = s});
                        EXPECT_GE(m.heads.begin, from.kv_heads.begin);
                        EXPECT_LE(m.heads.end, from.kv_heads.end);
                        for (int64_t h = m.heads.begin; h < m.heads.end; ++h) got[size_t(h)]++;
                    }
                    for (int64_t h = 0; h < hc.kv_heads; ++h) {
                        EXPECT_EQ(got[size_t(h)], want.kv_heads.Contains(h) ? 1 : 0)
                            << "head " << h << " at rank " << dst << " of tp " << d << " from tp "
                            << s;
                    }
                }
            }
        }
    }
}

TEST(KvReshardPlan, RefusesATpTheModelCannotSplit) {
    EXPECT_EQ(KvReshardPlan(HeadsSpec(8, 2), 16, 1).status().code(), StatusCode::kInvalidArgument);
}

// The regions of global head `head` of `layer` in `block` (K, V, then 8-bit scales), as
// (offset from the pool's start, bytes), straight off the pool layout.
std::vector<std::pair<int64_t, int64_t>> HeadRegions(const KvPool& pool, const ShardLayout& layout,
                                                     int64_t block, int64_t layer, int64_t head) {
    const KvPoolConfig& c = pool.config();
    const cpu::PagedKvLayer l = cpu::MakePagedKvLayer(
        nullptr, 0, pool.SlotOfLayer(layer), c.storage, c.block_size, c.num_kv_heads, c.head_dim);
    const int64_t h = head - layout.kv_heads.begin;
    const int64_t data = c.block_size * c.head_dim * KvDtypeBytes(c.storage);
    const int64_t scale = KvPoolHasScales(c.storage) ? c.block_size * 4 : 0;
    const int64_t at = block * pool.bytes_per_block();
    std::vector<std::pair<int64_t, int64_t>> out = {{at + l.k_offset + h * data, data},
                                                    {at + l.v_offset + h * data, data}};
    if (scale > 0) {
        out.push_back({at + l.k_scale_offset + h * scale, scale});
        out.push_back({at + l.v_scale_offset + h * scale, scale});
    }
    return out;
}

uint8_t Pattern(int64_t block, int64_t layer, int64_t head, int64_t i) {
    return static_cast<uint8_t>(block * 131 + layer * 29 + head * 7 + i * 13 + 1);
}

// A handoff driven by the plan, each message packed into one contiguous buffer with the
// sender's KvCopyRuns and unpacked with the receiver's (the NCCL path's device copies, here
// memcpy on CPU pools): every receiving rank ends up with each of its heads' bytes of the
// sender's blocks in its own blocks, and nothing else written, for every KV storage.
TEST(KvReshardPlan, MessagesThroughOneBufferEachLandEveryHeadWhereItBelongs) {
    Result<std::unique_ptr<Backend>> backend = MakeBackend({.kind = BackendKind::kCpu});
    ASSERT_TRUE(backend.ok());
    const ModelSpec spec = HeadsSpec(8, 4);
    const std::vector<int32_t> src_blocks = {3, 0, 5}, dst_blocks = {1, 4, 2};
    for (KvDtype storage : {KvDtype::kFp32, KvDtype::kBf16, KvDtype::kInt8}) {
        for (auto [s, d] :
             std::vector<std::pair<int, int>>{{1, 2}, {2, 1}, {4, 1}, {1, 8}, {2, 4}}) {
            auto pool_of = [&](int rank, int tp, std::vector<std::unique_ptr<KvPool>>* pools,
                               std::vector<ShardLayout>* layouts) {
                const ShardLayout l = *MakeShardLayout(spec, {.rank = rank, .tp = tp});
                Result<std::unique_ptr<KvPool>> p =
                    KvPool::Create({.num_blocks = 6,
                                    .block_size = 4,
                                    .num_layers = spec.num_layers,
                                    .num_kv_heads = l.num_kv_heads(),
                                    .head_dim = spec.head_dim,
                                    .storage = storage},
                                   **backend);
                KV_CHECK(p.ok()) << p.status().ToString();
                std::memset((*p)->MutableBlockData(0), 0, size_t((*p)->bytes_per_block() * 6));
                pools->push_back(std::move(*p));
                layouts->push_back(l);
            };
            std::vector<std::unique_ptr<KvPool>> src, dst;
            std::vector<ShardLayout> src_l, dst_l;
            for (int r = 0; r < s; ++r) pool_of(r, s, &src, &src_l);
            for (int r = 0; r < d; ++r) pool_of(r, d, &dst, &dst_l);
            // Each sender's heads carry a pattern of (the receiver's block, layer, head): a
            // replicated head holds the same bytes on every rank, as a real step computes it.
            for (int r = 0; r < s; ++r) {
                for (size_t b = 0; b < src_blocks.size(); ++b) {
                    for (int64_t layer = 0; layer < spec.num_layers; ++layer) {
                        for (int64_t h = src_l[r].kv_heads.begin; h < src_l[r].kv_heads.end; ++h) {
                            int64_t i = 0;
                            for (auto [off, n] :
                                 HeadRegions(*src[r], src_l[r], src_blocks[b], layer, h))
                                for (int64_t k = 0; k < n; ++k)
                                    src[r]->MutableBlockData(0)[off + k] =
                                        Pattern(dst_blocks[b], layer, h, i++);
                        }
                    }
                }
            }
            Result<std::vector<KvReshardMessage>> plan = KvReshardPlan(spec, s, d);
            ASSERT_TRUE(plan.ok());
            for (const KvReshardMessage& m : *plan) {
                const auto from = KvCopyRuns(*src[m.src_rank], src_l[m.src_rank], src_blocks, 0,
                                             spec.num_layers, m.heads);
                const auto to = KvCopyRuns(*dst[m.dst_rank], dst_l[m.dst_rank], dst_blocks, 0,
                                           spec.num_layers, m.heads);
                KvPieceHeader h{.layer_begin = 0,
                                .layer_end = int32_t(spec.num_layers),
                                .head_begin = int32_t(m.heads.begin),
                                .head_end = int32_t(m.heads.end),
                                .num_blocks = int32_t(src_blocks.size()),
                                .block_size = 4,
                                .head_dim = int32_t(spec.head_dim),
                                .dtype = storage};
                std::vector<uint8_t> message(static_cast<size_t>(KvPieceBytes(h)), 0);
                int64_t packed = 0, unpacked = 0;
                for (const KvCopyRun& r : from) {
                    std::memcpy(message.data() + r.piece_offset,
                                src[m.src_rank]->BlockData(0) + r.pool_offset, size_t(r.bytes));
                    packed += r.bytes;
                }
                for (const KvCopyRun& r : to) {
                    std::memcpy(dst[m.dst_rank]->MutableBlockData(0) + r.pool_offset,
                                message.data() + r.piece_offset, size_t(r.bytes));
                    unpacked += r.bytes;
                }
                EXPECT_EQ(packed, int64_t(message.size()));
                EXPECT_EQ(unpacked, int64_t(message.size()));
            }
            for (int r = 0; r < d; ++r) {
                std::vector<uint8_t> want(size_t(dst[r]->bytes_per_block() * 6), 0);
                for (int32_t b : dst_blocks) {
                    for (int64_t layer = 0; layer < spec.num_layers; ++layer) {
                        for (int64_t h = dst_l[r].kv_heads.begin; h < dst_l[r].kv_heads.end; ++h) {
                            int64_t i = 0;
                            for (auto [off, n] : HeadRegions(*dst[r], dst_l[r], b, layer, h))
                                for (int64_t k = 0; k < n; ++k)
                                    want[size_t(off + k)] = Pattern(b, layer, h, i++);
                        }
                    }
                }
                EXPECT_EQ(std::memcmp(want.data(), dst[r]->BlockData(0), want.size()), 0)
                    << KvDtypeName(storage) << " tp " << s << " -> " << d << " rank " << r;
            }
        }
    }
}

// Overlaps of the two sides' runs in piece order, merged where adjacent on both sides; bytes of
// the piece only one side covers (a skipped receiving block) are not copied.
TEST(KvPoolToPoolCopies, Table) {
    struct Case {
        const char* name;
        std::vector<KvCopyRun> from, to;
        std::vector<KvPoolCopy> want;
    };
    const Case cases[] = {
        {"same runs",
         {{0, 0, 10}, {50, 10, 5}},
         {{100, 0, 10}, {300, 10, 5}},
         {{0, 100, 10}, {50, 300, 5}}},
        {"sender one run, receiver two",
         {{0, 0, 20}},
         {{100, 0, 8}, {200, 8, 12}},
         {{0, 100, 8}, {8, 200, 12}}},
        {"split runs adjacent on both sides merge",
         {{0, 0, 8}, {8, 8, 8}},
         {{40, 0, 16}},
         {{0, 40, 16}}},
        {"receiver skips the middle",
         {{0, 0, 30}},
         {{100, 0, 10}, {120, 20, 10}},
         {{0, 100, 10}, {20, 120, 10}}},
        {"staggered",
         {{0, 0, 6}, {10, 6, 6}},
         {{50, 0, 4}, {60, 4, 8}},
         {{0, 50, 4}, {4, 60, 2}, {10, 62, 6}}},
        {"empty", {}, {{0, 0, 4}}, {}},
    };
    for (const Case& c : cases) EXPECT_EQ(KvPoolToPoolCopies(c.from, c.to), c.want) << c.name;
}

}  // namespace
}  // namespace kvshard
