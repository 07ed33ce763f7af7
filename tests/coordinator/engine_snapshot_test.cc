// The prefix index an engine publishes (coordinator/engine_snapshot.h) answers the router's two
// questions exactly as the block manager it was built from, through admissions, prefix hits,
// evictions, re-publication under new content ids, pins and their lapse, and a dropped cache,
// with and without sliding-window KV cache groups, updated whole or from the blocks just computed;
// an index once built never changes. The router side is in router_test.cc.
#include "coordinator/engine_snapshot.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kv/block_manager.h"

namespace kvshard {
namespace {

constexpr int64_t kBlockSize = 4;

kv::BlockManagerConfig Config(std::vector<int64_t> group_windows = {}) {
    kv::BlockManagerConfig c;
    c.group_windows = std::move(group_windows);
    c.num_blocks = 48;
    c.block_size = kBlockSize;
    c.watermark = 0.0;
    c.max_pinned_fraction = 0.5;
    c.min_pinned_tokens = 4;
    return c;
}

// Prompts from a few families that share prefixes of several lengths, so that hits, partial
// hits and twins (equal blocks computed twice) all happen.
std::vector<int32_t> Prompt(std::mt19937& rng) {
    const int family = static_cast<int>(rng() % 4);
    const int shared_blocks = static_cast<int>(rng() % 5);
    const int own = 1 + static_cast<int>(rng() % 9);
    std::vector<int32_t> p;
    for (int i = 0; i < shared_blocks * kBlockSize; ++i) p.push_back(100 * family + i);
    for (int i = 0; i < own; ++i) p.push_back(10'000 + static_cast<int32_t>(rng() % 7));
    return p;
}

// Every query the router could make of the families, with and without a tail.
std::vector<std::vector<int32_t>> Queries() {
    std::vector<std::vector<int32_t>> out;
    for (int family = 0; family < 4; ++family) {
        for (int blocks = 1; blocks <= 5; ++blocks) {
            std::vector<int32_t> q;
            for (int i = 0; i < blocks * kBlockSize; ++i) q.push_back(100 * family + i);
            out.push_back(q);
            q.push_back(10'000);
            out.push_back(q);
        }
    }
    return out;
}

void ExpectSameAnswers(const kv::BlockManager& bm, const PrefixIndex& index,
                       const std::vector<std::vector<int32_t>>& queries, const std::string& at) {
    for (size_t i = 0; i < queries.size(); ++i) {
        ASSERT_EQ(index.CachedPrefixTokens(queries[i]), bm.CachedPrefixTokens(queries[i]))
            << at << ", query " << i;
        ASSERT_EQ(index.PinnedPrefixTokens(queries[i]), bm.PinnedPrefixTokens(queries[i]))
            << at << ", query " << i;
    }
    ASSERT_EQ(index.num_blocks(), bm.Stats().num_published_blocks) << at;
}

TEST(PrefixIndex, AnswersAsTheBlockManagerThroughRandomWork) {
    const std::vector<std::vector<int32_t>> queries = Queries();
    // Without KV cache groups, and with a sliding-window group or two beside the full one.
    const std::vector<std::vector<int64_t>> layouts = {{}, {0, 8}, {0, 5, 0}};
    for (uint32_t seed = 1; seed <= 9; ++seed) {
        std::mt19937 rng(seed);
        const std::vector<int64_t>& layout = layouts[seed % layouts.size()];
        kv::BlockManagerConfig config = Config(layout);
        config.num_blocks *= std::max<int64_t>(1, static_cast<int64_t>(layout.size()));
        kv::BlockManager bm(config);
        PrefixIndexBuilder builder;
        // Updated as the engine does: every block only after a pin change, a dropped cache or
        // more evictions than the block manager logs; otherwise only the blocks just computed
        // and those it logged as evicted.
        PrefixIndexBuilder incremental;
        auto changes = [&bm] {
            const kv::BlockManagerStats st = bm.Stats();
            return std::vector<int64_t>{st.num_pins, st.num_pinned_blocks, st.pins_expired,
                                        st.pins_refused};
        };
        std::vector<int64_t> last_changes;
        std::vector<kv::SeqId> live;
        kv::SeqId next = 1;
        Clock::time_point now{};
        // An index kept from early on, with its answers then: it must never change.
        PrefixIndex kept;
        std::vector<int64_t> kept_answers;
        for (int op = 0; op < 400; ++op) {
            const uint32_t what = rng() % 10;
            bool forced = op == 0;  // a Pin call or a dropped cache
            std::vector<kv::BlockId> computed;
            if (what < 5) {
                const std::vector<int32_t> p = Prompt(rng);
                const kv::SequenceRequest req{next, p};
                if (bm.CanAllocate(req)) {
                    bm.Allocate(req);
                    bm.MarkComputed(next, static_cast<int64_t>(p.size()));
                    const auto table = bm.BlockTable(next);
                    computed.assign(table.begin(), table.end());
                    live.push_back(next);
                    ++next;
                } else if (!live.empty()) {
                    bm.Free(live.front());
                    live.erase(live.begin());
                }
            } else if (what < 8 && !live.empty()) {
                const size_t i = rng() % live.size();
                bm.Free(live[i]);
                live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
            } else if (what == 8 && !live.empty()) {
                const kv::SeqId s = live[rng() % live.size()];
                bm.Pin(s, std::max<int64_t>(1, bm.NumTokens(s) - 1),
                       std::chrono::seconds(1 + rng() % 5));
                forced = true;
            } else {
                now += std::chrono::seconds(1 + rng() % 3);
                bm.SetTime(now);
                if (rng() % 20 == 0) {
                    bm.DropCachedBlocks();
                    forced = true;
                }
            }
            const std::string at = "seed " + std::to_string(seed) + " (" +
                                   std::to_string(layout.size()) + " groups), op " +
                                   std::to_string(op);
            const PrefixIndex index = builder.Update(bm);
            ExpectSameAnswers(bm, index, queries, at);
            const std::vector<int64_t> now_changes = changes();
            std::optional<std::vector<kv::BlockId>> uncached = bm.TakeUncachedBlocks();
            if (uncached) computed.insert(computed.end(), uncached->begin(), uncached->end());
            const PrefixIndex inc =
                forced || now_changes != last_changes || !uncached || bm.num_groups() > 1
                    ? incremental.Update(bm)
                    : incremental.UpdateBlocks(bm, computed);
            last_changes = now_changes;
            ExpectSameAnswers(bm, inc, queries, at + " (incremental)");
            if (op == 50) {
                kept = index;
                for (const auto& q : queries) kept_answers.push_back(kept.CachedPrefixTokens(q));
            }
        }
        for (size_t i = 0; i < queries.size(); ++i)
            EXPECT_EQ(kept.CachedPrefixTokens(queries[i]), kept_answers[i]) << "query " << i;
    }
}

TEST(PrefixIndex, EmptyAndDisabled) {
    const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    EXPECT_EQ(PrefixIndex().CachedPrefixTokens(prompt), 0);
    EXPECT_EQ(PrefixIndex().PinnedPrefixTokens(prompt), 0);

    kv::BlockManagerConfig c = Config();
    c.enable_prefix_caching = false;
    kv::BlockManager bm(c);
    bm.Allocate({1, prompt});
    bm.MarkComputed(1, 9);
    PrefixIndexBuilder builder;
    EXPECT_EQ(builder.Update(bm).CachedPrefixTokens(prompt), 0);
}

TEST(PrefixIndex, AnIndexNeverChangesOnceBuilt) {
    kv::BlockManager bm(Config());
    PrefixIndexBuilder builder;
    const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    bm.Allocate({1, a});
    bm.MarkComputed(1, 9);
    const PrefixIndex first = builder.Update(bm);
    EXPECT_EQ(first.CachedPrefixTokens(a), 8);
    // Nothing changed: the same answers.
    const PrefixIndex second = builder.Update(bm);
    EXPECT_EQ(second.CachedPrefixTokens(a), 8);
    bm.Free(1);
    bm.DropCachedBlocks();
    const PrefixIndex third = builder.Update(bm);
    EXPECT_EQ(third.CachedPrefixTokens(a), 0);
    EXPECT_EQ(first.CachedPrefixTokens(a), 8) << "an index never changes once built";
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// The cost of an update follows the blocks that changed, not the blocks cached: a step on a full
// cache of a large GPU (tens of thousands of blocks, every step evicting) must not copy the index.
TEST(PrefixIndex, AnUpdateCopiesOnlyTheShardsItsChangesFallIn) {
    kv::BlockManagerConfig c = Config();
    c.num_blocks = 4096;
    kv::BlockManager bm(c);
    PrefixIndexBuilder builder;
    builder.Update(bm);
    // Fill the cache: 1,024 prompts of 4 full blocks each, freed (cached, evictable).
    kv::SeqId next = 1;
    for (; next <= 1024; ++next) {
        std::vector<int32_t> p(4 * kBlockSize);
        for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<int32_t>(next * 100 + i);
        bm.Allocate({next, p});
        bm.MarkComputed(next, static_cast<int64_t>(p.size()));
        bm.Free(next);
    }
    const PrefixIndex full = builder.Update(bm);
    ASSERT_EQ(full.num_blocks(), 4096);
    EXPECT_GE(full.num_shards(), c.num_blocks / PrefixIndex::kBlocksPerShard);
    ASSERT_TRUE(bm.TakeUncachedBlocks().has_value());
    // One more prompt evicts its 5 blocks' worth and publishes 4 new ones.
    std::vector<int32_t> p(4 * kBlockSize + 1, 7);
    bm.Allocate({next, p});
    bm.MarkComputed(next, static_cast<int64_t>(p.size()));
    std::optional<std::vector<kv::BlockId>> changed = bm.TakeUncachedBlocks();
    ASSERT_TRUE(changed.has_value());
    EXPECT_EQ(changed->size(), 5u) << "every evicted block is logged";
    const auto table = bm.BlockTable(next);
    changed->insert(changed->end(), table.begin(), table.end());
    const PrefixIndex after = builder.UpdateBlocks(bm, *changed);
    EXPECT_EQ(after.CachedPrefixTokens(p), 4 * kBlockSize);
    // 5 hashes out, 4 in: at most 9 shards copied, every other one shared with the index before.
    EXPECT_GE(after.num_shards_shared_with(full), after.num_shards() - 9);
    EXPECT_EQ(after.num_blocks(), builder.Update(bm).num_blocks());
}

// The eviction log is bounded: past num_blocks entries it gives up, and the engine compares all.
TEST(PrefixIndex, TheEvictionLogIsBounded) {
    kv::BlockManagerConfig c = Config();
    kv::BlockManager bm(c);
    for (kv::SeqId s = 1; s <= 200; ++s) {
        std::vector<int32_t> p(4 * kBlockSize + 1);
        for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<int32_t>(s * 100 + i);
        bm.Allocate({s, p});
        bm.MarkComputed(s, static_cast<int64_t>(p.size()));
        bm.Free(s);
    }
    EXPECT_GT(bm.Stats().num_evictions, c.num_blocks);
    EXPECT_FALSE(bm.TakeUncachedBlocks().has_value());
    std::optional<std::vector<kv::BlockId>> next = bm.TakeUncachedBlocks();
    ASSERT_TRUE(next.has_value()) << "a take starts a new log";
    EXPECT_TRUE(next->empty());
}

}  // namespace
}  // namespace kvshard
