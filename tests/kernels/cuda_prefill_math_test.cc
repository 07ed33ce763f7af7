// The tile walk of the FA2-style prefill kernel (kernels/cuda/prefill_attention.cu), run on the
// CPU: which blocks take which query tiles, which key tiles each walks, and where each key lives
// in the pool, against the CPU attention's rule and the CPU attention itself. No GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/launch_math.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {
namespace {

// A step of mixed sequences: row counts (1: a decode row) and the context each has after it.
struct Step {
    std::vector<int32_t> query_starts{0};
    std::vector<int32_t> context_lens;
    void Add(int32_t rows, int32_t len) {
        query_starts.push_back(query_starts.back() + rows);
        context_lens.push_back(len);
    }
    int64_t num_seqs() const { return static_cast<int64_t>(context_lens.size()); }
};

Step RandomStep(std::mt19937& rng) {
    Step st;
    std::uniform_int_distribution<int> seqs(1, 6), kind(0, 2), rows(2, 150), extra(0, 90);
    for (int s = seqs(rng); s > 0; --s) {
        const int32_t n = kind(rng) == 0 ? 1 : rows(rng);  // a decode row or a prefill chunk
        st.Add(n, n + extra(rng));  // a chunk's rows start at its context offset
    }
    return st;
}

// The blocks of a launch of `grid` blocks, each striding over the items, as the kernel does:
// calls visit(tile) for every tile a block takes and returns how many it took in all.
template <typename Visit>
int64_t WalkPrefill(const PrefillPlan& plan, const Step& st, int64_t kv_heads, int64_t window,
                    unsigned grid, Visit visit) {
    int64_t taken = 0;
    for (unsigned b = 0; b < grid; ++b) {
        for (int64_t w = b;; w += grid) {
            const PrefillTile t = PrefillTileOf(plan, w, st.num_seqs(), kv_heads,
                                                st.query_starts.data(), st.context_lens.data(),
                                                window);
            if (t.seq < 0) break;
            visit(t);
            ++taken;
        }
    }
    return taken;
}

TEST(CudaPrefillMathTest, HeadDimClassesAndSharedMemoryFitTheDevice) {
    EXPECT_EQ(PrefillHeadDimClass(0), 0);
    EXPECT_EQ(PrefillHeadDimClass(16), 64);
    EXPECT_EQ(PrefillHeadDimClass(64), 64);
    EXPECT_EQ(PrefillHeadDimClass(80), 128);
    EXPECT_EQ(PrefillHeadDimClass(128), 128);
    EXPECT_EQ(PrefillHeadDimClass(256), 256);
    EXPECT_EQ(PrefillHeadDimClass(257), 0);
    EXPECT_EQ(PrefillQueriesPerBlock(64), 64);
    EXPECT_EQ(PrefillQueriesPerBlock(128), 64);
    EXPECT_EQ(PrefillQueriesPerBlock(256), 32);
    for (int64_t hd = 1; hd <= 256; ++hd) {
        const int cls = PrefillHeadDimClass(hd);
        const int q = PrefillQueriesPerBlock(cls);
        // The accumulator layout covers the block's queries and dims with its threads exactly.
        ASSERT_EQ(q % kPrefillQueryLanes, 0);
        ASSERT_EQ(cls % kPrefillDimLanes, 0);
        ASSERT_LE(q * cls, kPrefillAccFloats);
        ASSERT_EQ(q % (kPrefillThreads / 32), 0);  // the warps score equal shares
        // sm_80 allows 163 KiB of dynamic shared memory a block (sm_90: 227 KiB): one block fits
        // on both, two a multiprocessor up to head_dim 128.
        ASSERT_LE(PrefillSharedBytes(hd), 163 * 1024) << hd;
        if (hd <= 128) {
            ASSERT_LE(2 * PrefillSharedBytes(hd), 163 * 1024) << hd;
        }
    }
    EXPECT_EQ(PrefillGrid(132, 2), 264u);
    EXPECT_EQ(PrefillGrid(0, 0), 1u);
}

TEST(CudaPrefillMathTest, PlansCoverTheGroupWithinABlocksQueries) {
    for (int queries : {32, 64}) {
        for (int group = 1; group <= 150; ++group) {
            const PrefillPlan p = PlanPrefill(group, queries);
            ASSERT_GE(p.rows_per_tile, 1);
            ASSERT_LE(p.rows_per_tile * p.heads_per_tile, queries);
            ASSERT_GE(int64_t(p.head_passes) * p.heads_per_tile, group);
            ASSERT_LT(int64_t(p.head_passes - 1) * p.heads_per_tile, group);
        }
        EXPECT_EQ(PrefillRowTiles(PlanPrefill(4, queries), 1), 0);  // decode: the split-KV kernel's
        EXPECT_EQ(PrefillRowTiles(PlanPrefill(4, queries), 2), 1);
    }
    EXPECT_EQ(PlanPrefill(4, 64).rows_per_tile, 16);  // Llama-3-8B: 32 heads on 8 KV heads
    EXPECT_EQ(PlanPrefill(1, 64).rows_per_tile, 64);
}

// Every (row, query head, key) pair of every prefill chunk is visited exactly once over all the
// blocks and key tiles, and only the pairs the CPU attention sees (key <= p, key > p - window);
// decode rows take no prefill tile. Each key's slot is the one its block table gives.
TEST(CudaPrefillMathTest, TilesVisitEveryVisibleRowKeyPairOnce) {
    std::mt19937 rng(13);
    for (int trial = 0; trial < 60; ++trial) {
        const Step st = RandomStep(rng);
        const int64_t kv_heads = 1 + trial % 3;
        const int group = std::vector<int>{1, 3, 4, 8, 20}[trial % 5];
        const int64_t num_heads = kv_heads * group;
        const int64_t window = std::vector<int64_t>{0, 1, 7, 40, 300}[(trial / 5) % 5];
        const int queries = PrefillQueriesPerBlock(trial % 2 ? 256 : 128);
        const PrefillPlan plan = PlanPrefill(group, queries);
        const unsigned grid = std::vector<unsigned>{1, 5, 264}[trial % 3];
        // visits of (step row, query head, key)
        int64_t max_len = 0;
        for (int32_t len : st.context_lens) max_len = std::max<int64_t>(max_len, len);
        std::vector<int> seen(static_cast<size_t>(st.query_starts.back() * num_heads * max_len), 0);
        auto at = [&](int64_t s, int64_t r, int64_t h, int64_t key) -> int& {
            return seen[static_cast<size_t>(((st.query_starts[s] + r) * num_heads + h) * max_len + key)];
        };
        int64_t visits = 0;
        const int64_t block_size = 16;
        WalkPrefill(plan, st, kv_heads, window, grid, [&](const PrefillTile& t) {
            const int64_t n_rows = st.query_starts[t.seq + 1] - st.query_starts[t.seq];
            const int64_t len = st.context_lens[t.seq];
            ASSERT_GT(n_rows, 1);
            ASSERT_LT(t.r_begin, t.r_end);
            ASSERT_LE(t.r_end, n_rows);
            ASSERT_LT(t.h_begin, t.h_end);
            ASSERT_LE(t.h_end, group);
            ASSERT_LE((t.r_end - t.r_begin) * (t.h_end - t.h_begin), queries);
            ASSERT_GE(t.k_begin, 0);
            ASSERT_LE(t.k_end, len);
            // A table whose entry b is block 1000 + b: the slot tells the position back.
            std::vector<int32_t> table((len + block_size - 1) / block_size);
            for (size_t b = 0; b < table.size(); ++b) table[b] = static_cast<int32_t>(1000 + b);
            for (int64_t t0 = t.k_begin; t0 < t.k_end; t0 += kPrefillTileKeys) {
                const int64_t nt = std::min<int64_t>(kPrefillTileKeys, t.k_end - t0);
                for (int64_t lane = 0; lane < nt; ++lane) {
                    const int64_t key = t0 + lane;
                    ASSERT_EQ(SlotOfPosition(table.data(), block_size, key),
                              (1000 + key / block_size) * block_size + key % block_size);
                    for (int64_t r = t.r_begin; r < t.r_end; ++r) {
                        const int64_t pos = len - n_rows + r;
                        if (!KeyVisible(key, pos, window)) continue;
                        for (int h = t.h_begin; h < t.h_end; ++h) {
                            ++at(t.seq, r, t.kv_head * group + h, key);
                            ++visits;
                        }
                    }
                }
            }
        });
        int64_t want_pairs = 0;
        for (int64_t s = 0; s < st.num_seqs(); ++s) {
            const int64_t n_rows = st.query_starts[s + 1] - st.query_starts[s];
            if (n_rows == 1) continue;
            const int64_t len = st.context_lens[s];
            for (int64_t r = 0; r < n_rows; ++r) {
                const int64_t pos = len - n_rows + r;
                for (int64_t key = 0; key < len; ++key) {
                    // The CPU's rule (kernels/paged_attention.h): causal, inside the window.
                    const bool visible = key <= pos && (window <= 0 || key > pos - window);
                    for (int64_t h = 0; h < num_heads; ++h) {
                        ASSERT_EQ(at(s, r, h, key), visible ? 1 : 0)
                            << "trial " << trial << " seq " << s << " row " << r << " head " << h
                            << " key " << key << " window " << window;
                        want_pairs += visible;
                    }
                }
            }
        }
        EXPECT_EQ(visits, want_pairs);  // and nothing outside the prefill chunks' rows
    }
}

// The kernel's arithmetic on the CPU: each block's query tile, its K/V tiles read through the
// block table at KvElementOffset, scores pre-scaled, the online softmax of each tile (max,
// rescale, sum) and the final division, equal cpu::PagedAttentionBatched on an fp32 pool within
// float rounding, windowed or not.
TEST(CudaPrefillMathTest, TileWalkReproducesTheCpuAttention) {
    std::mt19937 rng(21);
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    for (int trial = 0; trial < 12; ++trial) {
        const Step st = RandomStep(rng);
        const int64_t kv_heads = 2, group = trial % 2 ? 4 : 3, num_heads = kv_heads * group;
        const int64_t hd = trial % 3 == 0 ? 64 : 32, bs = 16;
        const int64_t window = trial % 4 == 3 ? 33 : 0;
        const int64_t rows = st.query_starts.back();
        // Each sequence its own shuffled blocks.
        std::vector<int32_t> table_starts{0}, tables;
        int32_t next_block = 0;
        for (int64_t s = 0; s < st.num_seqs(); ++s) {
            const int64_t nb = (st.context_lens[s] + bs - 1) / bs;
            for (int64_t b = 0; b < nb; ++b) tables.push_back(next_block++);
            std::shuffle(tables.end() - nb, tables.end(), rng);
            table_starts.push_back(static_cast<int32_t>(tables.size()));
        }
        const int64_t block_bytes = cpu::PagedLayerBytes(KvDtype::kFp32, bs, kv_heads, hd);
        std::vector<uint8_t> pool(static_cast<size_t>(next_block * block_bytes));
        for (size_t i = 0; i < pool.size() / 4; ++i) {
            const float x = u(rng);
            std::memcpy(&pool[4 * i], &x, 4);
        }
        const cpu::PagedKvLayer kv =
            cpu::MakePagedKvLayer(pool.data(), block_bytes, 0, KvDtype::kFp32, bs, kv_heads, hd);
        std::vector<float> q(static_cast<size_t>(rows * num_heads * hd));
        for (float& x : q) x = u(rng);
        cpu::PagedAttentionBatch batch;
        batch.num_seqs = st.num_seqs();
        batch.query_starts = st.query_starts.data();
        batch.context_lens = st.context_lens.data();
        batch.block_table_starts = table_starts.data();
        batch.block_tables = tables.data();
        batch.window = window;
        std::vector<float> want(q.size(), 0.0f);
        cpu::PagedAttentionBatched(q.data(), num_heads * hd, kv, batch, want.data(), num_heads);

        std::vector<float> got(q.size(), std::nanf(""));
        const PrefillPlan plan = PlanPrefill(static_cast<int>(group), PrefillQueriesPerBlock(64));
        const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
        auto element = [&](int64_t offset, int64_t slot, int64_t h, int64_t d) {
            float x;
            std::memcpy(&x, &pool[KvElementOffset(block_bytes, offset, bs, hd, 4, slot, h, d)], 4);
            return x;
        };
        WalkPrefill(plan, st, kv_heads, window, 7, [&](const PrefillTile& t) {
            const int64_t row0 = st.query_starts[t.seq];
            const int64_t n_rows = st.query_starts[t.seq + 1] - row0;
            const int64_t len = st.context_lens[t.seq];
            const int32_t* table = tables.data() + table_starts[t.seq];
            for (int64_t r = t.r_begin; r < t.r_end; ++r) {
                const int64_t pos = len - n_rows + r;
                for (int h = t.h_begin; h < t.h_end; ++h) {
                    const int64_t qh = t.kv_head * group + h;
                    const float* qv = &q[((row0 + r) * num_heads + qh) * hd];
                    float m = -INFINITY, l = 0.0f;
                    std::vector<float> acc(static_cast<size_t>(hd), 0.0f);
                    for (int64_t t0 = t.k_begin; t0 < t.k_end; t0 += kPrefillTileKeys) {
                        const int64_t nt = std::min<int64_t>(kPrefillTileKeys, t.k_end - t0);
                        float sc[kPrefillTileKeys];
                        float tile_max = -INFINITY;
                        for (int64_t j = 0; j < kPrefillTileKeys; ++j) {
                            sc[j] = -INFINITY;
                            if (j >= nt || !KeyVisible(t0 + j, pos, window)) continue;
                            const int64_t slot = SlotOfPosition(table, bs, t0 + j);
                            float dot = 0.0f;
                            for (int64_t d = 0; d < hd; ++d) {
                                dot += qv[d] * scale * element(kv.k_offset, slot, t.kv_head, d);
                            }
                            sc[j] = dot;
                            tile_max = std::max(tile_max, dot);
                        }
                        const float m_new = std::max(m, tile_max);
                        const float alpha = m == -INFINITY ? 0.0f : std::exp(m - m_new);
                        float sum = 0.0f;
                        for (float& p : sc) {
                            p = m_new == -INFINITY ? 0.0f : std::exp(p - m_new);
                            sum += p;
                        }
                        l = l * alpha + sum;
                        m = m_new;
                        for (int64_t d = 0; d < hd; ++d) {
                            float x = acc[d] * alpha;
                            for (int64_t j = 0; j < nt; ++j) {
                                if (sc[j] == 0.0f) continue;
                                x += sc[j] * element(kv.v_offset, SlotOfPosition(table, bs, t0 + j),
                                                     t.kv_head, d);
                            }
                            acc[d] = x;
                        }
                    }
                    for (int64_t d = 0; d < hd; ++d) {
                        got[((row0 + r) * num_heads + qh) * hd + d] = l > 0.0f ? acc[d] / l : 0.0f;
                    }
                }
            }
        });
        for (int64_t s = 0; s < st.num_seqs(); ++s) {
            const int64_t row0 = st.query_starts[s], n_rows = st.query_starts[s + 1] - row0;
            if (n_rows == 1) continue;  // the split-KV kernel's
            for (int64_t i = row0 * num_heads * hd; i < (row0 + n_rows) * num_heads * hd; ++i) {
                ASSERT_NEAR(got[i], want[i], 2e-5f + 2e-5f * std::fabs(want[i]))
                    << "trial " << trial << " seq " << s << " element " << i;
            }
        }
    }
}

}  // namespace
}  // namespace kvshard::cuda
