// A randomized run of the BlockManager against a fake worker: a pool that stores, for every slot,
// the token id whose KV would be there. The fake writes tokens at the slots the manager returns and
// executes its copy ops, as a worker would. After every operation:
//   - CheckInvariants(): reference counts recomputed from the block tables, free + used + cached
//     == total, no block both free and referenced, cached blocks full and equal to their tokens;
//   - every live sequence reads back its exact token ids through its block table, so a prefix hit
//     served the right tokens, a copy-on-write happened before a shared block was written, and no
//     block in use was evicted or handed to someone else.
// With KV cache groups (sliding windows), every group's table is read back, over the positions
// its window still holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "kv/block_manager.h"

namespace kvshard::kv {
namespace {

struct RandomCase {
    const char* name;
    int64_t num_blocks;
    int64_t block_size;
    bool prefix_caching;
    double watermark;
    std::vector<int64_t> group_windows = {};
};

struct Coverage {
    int64_t allocations = 0;
    int64_t rejected_allocations = 0;
    int64_t prefix_hits = 0;  // allocations served at least one block from the cache
    int64_t appends = 0;
    int64_t copies = 0;
    int64_t forks = 0;
    int64_t frees = 0;
    int64_t preemptions = 0;
    int64_t pins = 0;  // pins made or refreshed
};

class FakeWorker {
  public:
    FakeWorker(int64_t num_blocks, int64_t block_size)
        : block_size_(block_size), pool_(static_cast<size_t>(num_blocks * block_size), -1) {}
    void Write(int64_t slot, int32_t token) { pool_[static_cast<size_t>(slot)] = token; }
    int32_t Read(int64_t slot) const { return pool_[static_cast<size_t>(slot)]; }
    void Copy(const CopyOp& op) {
        std::copy_n(pool_.begin() + op.src_block * block_size_, block_size_,
                    pool_.begin() + op.dst_block * block_size_);
    }

  private:
    int64_t block_size_;
    std::vector<int32_t> pool_;
};

class RandomRun {
  public:
    RandomRun(const RandomCase& c, uint64_t seed)
        : c_(c),
          bm_(WithPins(BlockManagerConfig{c.num_blocks, c.block_size, c.watermark, c.prefix_caching},
                       c.group_windows)),
          worker_(c.num_blocks, c.block_size),
          rng_(seed) {
        // A few shared "system prompts" of 0 to 3 blocks and a bit.
        for (int f = 0; f < 5; ++f) {
            std::vector<int32_t> prefix(static_cast<size_t>(Uniform(0, 3 * c.block_size + 2)));
            for (int32_t& t : prefix) t = static_cast<int32_t>(Uniform(100, 110));
            families_.push_back(prefix);
        }
    }

    Coverage Run(int64_t num_ops) {
        for (int64_t op = 0; op < num_ops; ++op) {
            const int64_t dice = Uniform(0, 99);
            if (dice < 28 || live_.empty()) {
                Allocate();
            } else if (dice < 68) {
                Append();
            } else if (dice < 74) {
                Fork();
            } else if (dice < 80) {
                const SeqId s = Pick();
                bm_.MarkComputed(s, Uniform(0, bm_.NumTokens(s)));
            } else if (dice < 84) {
                PinOrTick();
            } else {
                Free(Pick());
                ++cov_.frees;
            }
            Verify(op);
            if (::testing::Test::HasFatalFailure()) return cov_;
        }
        while (!live_.empty()) {
            Free(live_.back());
            Verify(num_ops);
        }
        // Every pin lapses at its TTL: then nothing is held.
        bm_.SetTime(now_ + std::chrono::hours(1));
        Verify(num_ops);
        EXPECT_EQ(bm_.num_pins(), 0);
        EXPECT_EQ(bm_.num_available_blocks(), c_.num_blocks);
        EXPECT_EQ(bm_.Stats().num_used_blocks, 0);
        return cov_;
    }

    int64_t evictions() const { return bm_.Stats().num_evictions; }
    int64_t window_released() const { return bm_.Stats().num_window_released; }

  private:
    int64_t Uniform(int64_t lo, int64_t hi) {
        return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
    }
    SeqId Pick() { return live_[static_cast<size_t>(Uniform(0, live_.size() - 1))]; }
    // Tokens from a tiny vocabulary, so unrelated sequences often hold equal blocks (twins).
    int32_t RandomToken() { return static_cast<int32_t>(Uniform(0, 2)); }

    std::vector<int32_t> MakePrompt() {
        std::vector<int32_t> p;
        if (!live_.empty() && Uniform(0, 3) == 0) {
            // A follow-up turn: a prefix of a live sequence, prompt and generated tokens.
            std::span<const int32_t> t = bm_.TokenIds(Pick());
            p.assign(t.begin(), t.begin() + Uniform(1, static_cast<int64_t>(t.size())));
        } else {
            p = families_[static_cast<size_t>(Uniform(0, families_.size() - 1))];
        }
        const int64_t suffix = Uniform(p.empty() ? 1 : 0, 2 * c_.block_size);
        for (int64_t i = 0; i < suffix; ++i) p.push_back(RandomToken());
        return p;
    }

    void Allocate() {
        if (live_.size() >= 24) return;
        const std::vector<int32_t> prompt = MakePrompt();
        const SeqId id = next_id_++;
        SequenceRequest r{id, prompt};
        if (!bm_.CanAllocate(r)) {
            ++cov_.rejected_allocations;
            return;
        }
        const int64_t expected = bm_.CachedPrefixTokens(prompt);
        const int64_t cached = bm_.Allocate(r);
        ASSERT_EQ(cached, expected);
        ASSERT_EQ(bm_.NumCachedTokens(id), cached);
        ASSERT_EQ(cached % c_.block_size, 0);
        ASSERT_LT(cached, static_cast<int64_t>(prompt.size()));
        for (int64_t g = 0; g < bm_.num_groups(); ++g) {
            for (int64_t p = HeldFrom(id, g); p < cached; ++p) {
                ASSERT_EQ(worker_.Read(bm_.Slot(id, p, g)), prompt[p])
                    << "hit served wrong KV at " << p << " in group " << g;
            }
            const std::vector<int64_t> slots = bm_.SlotMapping(id, cached, prompt.size(), g);
            for (size_t i = 0; i < slots.size(); ++i) worker_.Write(slots[i], prompt[cached + i]);
        }
        if (Uniform(0, 9) < 7) bm_.MarkComputed(id, static_cast<int64_t>(prompt.size()));
        live_.push_back(id);
        ++cov_.allocations;
        cov_.prefix_hits += cached > 0;
    }

    void Append() {
        const SeqId s = Pick();
        if (bm_.NumTokens(s) > 12 * c_.block_size) {  // finished
            Free(s);
            return;
        }
        std::vector<int32_t> tokens(static_cast<size_t>(Uniform(1, 3)));
        for (int32_t& t : tokens) t = RandomToken();
        if (!bm_.CanAppend(s, static_cast<int64_t>(tokens.size()))) {
            if (!bm_.CanAppend(s, 1)) {
                ASSERT_TRUE(bm_.NeedsPreemption()) << "seq " << s << " cannot grow, no signal";
            }
            Free(Pick());  // preempt someone (recompute later)
            ++cov_.preemptions;
            return;
        }
        const std::vector<BlockId> before(bm_.BlockTable(s).begin(), bm_.BlockTable(s).end());
        const int64_t begin = bm_.NumTokens(s);
        const AppendResult r = bm_.AppendSlots(s, tokens);
        for (const CopyOp& op : r.group_copies) {
            worker_.Copy(op);
            ++cov_.copies;
        }
        if (r.copy) {
            ASSERT_EQ(r.copy->src_block, before.back());
            ASSERT_EQ(bm_.BlockTable(s)[before.size() - 1], r.copy->dst_block);
            ASSERT_GE(bm_.RefCount(r.copy->src_block), 1) << "the other fork keeps the original";
            worker_.Copy(*r.copy);
            ++cov_.copies;
        }
        ASSERT_EQ(r.slots.size(), tokens.size());
        for (size_t i = 0; i < tokens.size(); ++i) worker_.Write(r.slots[i], tokens[i]);
        for (int64_t g = 1; g < bm_.num_groups(); ++g) {
            const std::vector<int64_t> slots = bm_.SlotMapping(s, begin, bm_.NumTokens(s), g);
            for (size_t i = 0; i < tokens.size(); ++i) worker_.Write(slots[i], tokens[i]);
        }
        if (Uniform(0, 1) == 0) bm_.MarkComputed(s, bm_.NumTokens(s));
        ++cov_.appends;
    }

    // Prompt-caching pins: pin a prefix of a live sequence (up to half the pool), let time pass
    // (pins lapse), or let the oldest pin lapse as the scheduler does.
    void PinOrTick() {
        const int64_t dice = Uniform(0, 9);
        if (dice < 6) {
            const SeqId s = Pick();
            const PinResult r = bm_.Pin(s, Uniform(0, bm_.NumTokens(s)),
                                        std::chrono::milliseconds(Uniform(1, 50)));
            ASSERT_EQ(r.pinned_tokens % c_.block_size, 0);
            ASSERT_LE(bm_.num_pinned_blocks(), bm_.max_pinned_blocks());
            cov_.pins += r.pinned_tokens > 0;
        } else if (dice < 9) {
            now_ += std::chrono::milliseconds(Uniform(1, 20));
            bm_.SetTime(now_);
        } else {
            bm_.LapseOldestPin();
        }
    }

    static BlockManagerConfig WithPins(BlockManagerConfig c, std::vector<int64_t> windows) {
        c.max_pinned_fraction = 0.5;
        c.min_pinned_tokens = 0;
        c.group_windows = std::move(windows);
        return c;
    }

    // The first position group g's window still holds for `s`.
    int64_t HeldFrom(SeqId s, int64_t g) const {
        return bm_.NumReleasedBlocks(s, g) * c_.block_size;
    }

    void Fork() {
        if (live_.size() >= 24) return;
        const SeqId child = next_id_++;
        bm_.Fork(Pick(), child);
        live_.push_back(child);
        ++cov_.forks;
    }

    void Free(SeqId s) {
        bm_.Free(s);
        live_.erase(std::find(live_.begin(), live_.end(), s));
    }

    void Verify(int64_t op) {
        const Status st = bm_.CheckInvariants();
        ASSERT_TRUE(st.ok()) << "after op " << op << ": " << st.ToString();
        const BlockManagerStats stats = bm_.Stats();
        ASSERT_EQ(stats.num_free_blocks + stats.num_used_blocks + stats.num_cached_blocks +
                      stats.num_pinned_idle_blocks,
                  c_.num_blocks);
        ASSERT_LE(stats.num_pinned_blocks, bm_.max_pinned_blocks());
        for (SeqId s : live_) {
            std::span<const int32_t> tokens = bm_.TokenIds(s);
            for (int64_t g = 0; g < bm_.num_groups(); ++g) {
                for (int64_t p = HeldFrom(s, g); p < static_cast<int64_t>(tokens.size()); ++p) {
                    ASSERT_EQ(worker_.Read(bm_.Slot(s, p, g)), tokens[p])
                        << "after op " << op << ": seq " << s << " position " << p << " group "
                        << g;
                }
            }
        }
    }

    RandomCase c_;
    BlockManager bm_;
    FakeWorker worker_;
    std::mt19937_64 rng_;
    Clock::time_point now_{};
    std::vector<std::vector<int32_t>> families_;
    std::vector<SeqId> live_;
    SeqId next_id_ = 1;
    Coverage cov_;
};

TEST(BlockManagerRandomTest, InvariantsHoldOverManyOperations) {
    const RandomCase cases[] = {
        {"block 4", 64, 4, true, 0.0},
        {"block 16, watermark", 40, 16, true, 0.05},
        {"block 1", 48, 1, true, 0.0},
        {"block 3", 50, 3, true, 0.02},
        {"block 4, no prefix caching", 64, 4, false, 0.0},
        // Sliding windows: a full group and two windows (the anchor is full), and a windowed
        // anchor alone (Mistral).
        {"block 4, windows 0/6/9", 96, 4, true, 0.0, {0, 6, 9, 6}},
        {"block 3, window 5 only", 36, 3, true, 0.0, {5}},
        {"block 4, windows, no prefix caching", 96, 4, false, 0.0, {0, 7}},
    };
    constexpr int64_t kOps = 100'000;
    uint64_t seed = 20240601;
    for (const RandomCase& c : cases) {
        SCOPED_TRACE(c.name);
        const auto start = std::chrono::steady_clock::now();
        RandomRun run(c, seed++);
        const Coverage cov = run.Run(kOps);
        ASSERT_FALSE(HasFatalFailure());
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::printf(
            "[ %s ] %lld ops in %.2f s: %lld allocations (%lld rejected, %lld with prefix "
            "hits), %lld appends, %lld copies, %lld forks, %lld frees, %lld preemptions, "
            "%lld evictions\n",
            c.name, static_cast<long long>(kOps), seconds, static_cast<long long>(cov.allocations),
            static_cast<long long>(cov.rejected_allocations),
            static_cast<long long>(cov.prefix_hits), static_cast<long long>(cov.appends),
            static_cast<long long>(cov.copies), static_cast<long long>(cov.forks),
            static_cast<long long>(cov.frees), static_cast<long long>(cov.preemptions),
            static_cast<long long>(run.evictions()));
        // The run must have exercised every path, or it proves little.
        EXPECT_GT(cov.allocations, 1000);
        EXPECT_GT(cov.rejected_allocations, 100);
        EXPECT_GT(cov.appends, 10000);
        if (c.block_size > 1) {  // block size 1: nothing is ever partial, so nothing to copy
            EXPECT_GT(cov.copies, 100);
        }
        EXPECT_GT(cov.forks, 1000);
        EXPECT_GT(cov.preemptions, 20);
        if (c.prefix_caching) {
            EXPECT_GT(cov.pins, 100);
            EXPECT_GT(cov.prefix_hits, 1000);
            EXPECT_GT(run.evictions(), 1000);
        } else {
            EXPECT_EQ(cov.prefix_hits, 0);
            EXPECT_EQ(run.evictions(), 0);
        }
        if (!c.group_windows.empty()) {
            EXPECT_GT(run.window_released(), 1000);
        }
    }
}

}  // namespace
}  // namespace kvshard::kv
