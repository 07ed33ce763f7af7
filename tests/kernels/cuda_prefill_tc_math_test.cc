// The index math of the tensor-core prefill kernel (kernels/cuda/prefill_tc_math.h) on the CPU:
// the fragment maps against the PTX ISA's description of mma.m16n8k16 (written here on its own),
// the score → P fragment reuse, the key-tile masks against KeyVisible, and a scalar emulation of
// the kernel's whole tile loop, built from the header's functions, against the CPU attention. The
// kernel-selection setting (kernels/cuda/prefill_select.h) too. No GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kernels/cuda/launch_math.h"
#include "kernels/cuda/prefill_select.h"
#include "kernels/cuda/prefill_tc_math.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {
namespace {

constexpr int kLanes = 32;

// ---- mma.sync.aligned.m16n8k16 as the PTX ISA describes it, independently of the header ----
// groupID = laneid >> 2, threadID_in_group = laneid % 4; element i of a lane's A (a0..a7),
// B (b0..b3) and C (c0..c3) fragments.
FragCoord PtxA(int lane, int i) {
    const int group_id = lane >> 2, tig = lane % 4;
    const bool upper_row = i == 2 || i == 3 || i == 6 || i == 7;
    return {upper_row ? group_id + 8 : group_id, i < 4 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8};
}
FragCoord PtxB(int lane, int i) {
    const int group_id = lane >> 2, tig = lane % 4;
    return {i < 2 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8, group_id};
}
FragCoord PtxC(int lane, int i) {
    const int group_id = lane >> 2, tig = lane % 4;
    return {i < 2 ? group_id : group_id + 8, tig * 2 + (i & 1)};
}

// What one mma.sync does to the warp's registers: D = A·B + C, each lane's elements placed by
// the ISA's layout.
void EmulateMma(const float (&a)[kLanes][8], const float (&b)[kLanes][4], float (&c)[kLanes][4]) {
    float am[kMmaM][kMmaK], bm[kMmaK][kMmaN];
    for (int lane = 0; lane < kLanes; ++lane) {
        for (int i = 0; i < 8; ++i) am[PtxA(lane, i).row][PtxA(lane, i).col] = a[lane][i];
        for (int i = 0; i < 4; ++i) bm[PtxB(lane, i).row][PtxB(lane, i).col] = b[lane][i];
    }
    for (int lane = 0; lane < kLanes; ++lane) {
        for (int i = 0; i < 4; ++i) {
            const FragCoord rc = PtxC(lane, i);
            float acc = c[lane][i];
            for (int k = 0; k < kMmaK; ++k) acc += am[rc.row][k] * bm[k][rc.col];
            c[lane][i] = acc;
        }
    }
}

TEST(CudaPrefillTcMathTest, FragmentMapsAreThePtxLayoutsAndCoverEachTileOnce) {
    std::set<std::pair<int, int>> a_cells, b_cells, c_cells;
    for (int lane = 0; lane < kLanes; ++lane) {
        for (int e = 0; e < 8; ++e) {
            const FragCoord got = MmaAElement(lane, e), want = PtxA(lane, e);
            EXPECT_EQ(got.row, want.row) << "A lane " << lane << " element " << e;
            EXPECT_EQ(got.col, want.col) << "A lane " << lane << " element " << e;
            a_cells.insert({got.row, got.col});
        }
        for (int e = 0; e < 4; ++e) {
            const FragCoord b = MmaBElement(lane, e), c = MmaCElement(lane, e);
            EXPECT_EQ(b.row, PtxB(lane, e).row) << "B lane " << lane << " element " << e;
            EXPECT_EQ(b.col, PtxB(lane, e).col) << "B lane " << lane << " element " << e;
            EXPECT_EQ(c.row, PtxC(lane, e).row) << "C lane " << lane << " element " << e;
            EXPECT_EQ(c.col, PtxC(lane, e).col) << "C lane " << lane << " element " << e;
            b_cells.insert({b.row, b.col});
            c_cells.insert({c.row, c.col});
        }
        // Two elements of one 32-bit register are neighbours along the dimension the kernel
        // reads as one word (A and B: k).
        for (int r = 0; r < 4; ++r) {
            EXPECT_EQ(MmaAElement(lane, 2 * r + 1).col, MmaAElement(lane, 2 * r).col + 1);
            EXPECT_EQ(MmaAElement(lane, 2 * r + 1).row, MmaAElement(lane, 2 * r).row);
        }
        for (int r = 0; r < 2; ++r) {
            EXPECT_EQ(MmaBElement(lane, 2 * r + 1).row, MmaBElement(lane, 2 * r).row + 1);
        }
    }
    EXPECT_EQ(a_cells.size(), size_t(kMmaM * kMmaK));
    EXPECT_EQ(b_cells.size(), size_t(kMmaK * kMmaN));
    EXPECT_EQ(c_cells.size(), size_t(kMmaM * kMmaN));
}

TEST(CudaPrefillTcMathTest, ScoreFragmentsAreThePvProductsAOperand) {
    for (int lane = 0; lane < kLanes; ++lane) {
        for (int kk = 0; kk < kTcTileKeys / kMmaK; ++kk) {
            for (int e = 0; e < 8; ++e) {
                const FragCoord a = MmaAElement(lane, e);
                const int n = TcPTileOf(kk, e);
                const FragCoord c = MmaCElement(lane, TcPElementOf(e));
                ASSERT_GE(n, 0);
                ASSERT_LT(n, kTcScoreTiles);
                EXPECT_EQ(c.row, a.row) << "lane " << lane << " kk " << kk << " e " << e;
                EXPECT_EQ(n * kMmaN + c.col, kk * kMmaK + a.col)
                    << "lane " << lane << " kk " << kk << " e " << e;
            }
        }
    }
}

TEST(CudaPrefillTcMathTest, KeyTileMasksAgreeWithKeyVisible) {
    std::mt19937 rng(5);
    std::uniform_int_distribution<int> nq_d(1, kTcQueries), nh_d(1, 9), pos_d(0, 300), t0_d(0, 400),
        nt_d(1, kTcTileKeys), win_d(0, 3);
    int seen[3] = {0, 0, 0};
    for (int trial = 0; trial < 20000; ++trial) {
        const int nq = nq_d(rng), nh = nh_d(rng), warp = trial % kTcWarps;
        const int64_t pos0 = pos_d(rng), t0 = t0_d(rng);
        const int nt = trial % 3 == 0 ? kTcTileKeys : nt_d(rng);
        const int64_t window = std::vector<int64_t>{0, 1, 40, 130}[win_d(rng)];
        const TcWarpSpan span = TcWarpPositions(warp, nq, nh, pos0);
        int visible = 0, pairs = 0;
        for (int q = warp * kMmaM; q < warp * kMmaM + kMmaM && q < nq; ++q) {
            for (int j = 0; j < nt; ++j) {
                visible += KeyVisible(t0 + j, pos0 + q / nh, window) ? 1 : 0;
                ++pairs;
            }
        }
        EXPECT_EQ(span.empty, pairs == 0);
        const TcTileMask mask = TcKeyTileMask(t0, nt, span, window);
        ++seen[static_cast<int>(mask)];
        if (mask == TcTileMask::kSkip) {
            EXPECT_EQ(visible, 0) << "trial " << trial;
        }
        if (mask == TcTileMask::kAllVisible) {
            EXPECT_EQ(visible, pairs) << "trial " << trial;
            EXPECT_EQ(nt, kTcTileKeys);
        }
        // A tile with no visible pair is skipped, not masked (the causal tiles past a warp's rows
        // cost no tensor-core work); a masked tile has a visible pair.
        if (mask == TcTileMask::kMasked) {
            EXPECT_GT(visible, 0) << "trial " << trial;
        }
    }
    for (int kind = 0; kind < 3; ++kind) EXPECT_GT(seen[kind], 100) << "mask kind " << kind;
}

TEST(CudaPrefillTcMathTest, SharedMemoryFitsTwoBlocksOnAnSm80) {
    EXPECT_TRUE(TcHeadDimSupported(64));
    EXPECT_TRUE(TcHeadDimSupported(128));
    EXPECT_FALSE(TcHeadDimSupported(80));
    EXPECT_FALSE(TcHeadDimSupported(256));
    // sm_80: 164 KiB of shared memory a multiprocessor, 1 KiB of it reserved per block.
    EXPECT_LE(2 * (TcSharedBytes(128) + 1024 + 2 * 4 * kAttnMaxHeads + 8), 164 * 1024);
    // Row strides: 16 bytes past a multiple of 128 (conflict-free fragment loads; V is stored
    // key-major like K since ldmatrix.trans, tests/kernels/cuda_prefill_tc_ldsm_test.cc).
    EXPECT_EQ(TcRowHalves(128) * 2 % 128, 16);
    EXPECT_EQ(TcRowHalves(64) * 2 % 128, 16);
}

// ---- the kernel's tile loop, emulated ----

float RoundBf16(float x) { return Bf16Decode(Bf16Encode(x)); }

struct Step {
    std::vector<int32_t> query_starts{0};
    std::vector<int32_t> context_lens;
    void Add(int32_t rows, int32_t len) {
        query_starts.push_back(query_starts.back() + rows);
        context_lens.push_back(len);
    }
    int64_t num_seqs() const { return static_cast<int64_t>(context_lens.size()); }
};

// PrefillAttentionTcKernel's arithmetic for one step over an fp32 pool, lane by lane: the same
// tiles, fragments, masks and softmax steps, each mma.sync done by EmulateMma. `bf16` rounds what
// the kernel rounds (Q, K, V and P); without it every operand stays fp32. Rows of decode
// sequences are left as they are in `out`.
template <int kHd>
void EmulateTcPrefill(const std::vector<float>& q, int64_t num_heads, const cpu::PagedKvLayer& kv,
                      const Step& st, const std::vector<int32_t>& table_starts,
                      const std::vector<int32_t>& tables, int64_t window, bool bf16,
                      std::vector<float>& out) {
    constexpr int kKSteps = kHd / kMmaK, kDTiles = kHd / kMmaN;
    const auto round = [bf16](float x) { return bf16 ? RoundBf16(x) : x; };
    const int group = static_cast<int>(num_heads / kv.num_kv_heads);
    const float scale = 1.0f / std::sqrt(static_cast<float>(kHd));
    const PrefillPlan plan = PlanPrefill(group, kTcQueries);
    auto element = [&](int64_t offset, int64_t slot, int64_t h, int d) {
        float x;
        std::memcpy(
            &x,
            kv.base + KvElementOffset(kv.block_stride, offset, kv.block_size, kHd, 4, slot, h, d),
            4);
        return round(x);
    };
    for (int64_t w = 0;; ++w) {
        const PrefillTile t = PrefillTileOf(plan, w, st.num_seqs(), kv.num_kv_heads,
                                            st.query_starts.data(), st.context_lens.data(), window);
        if (t.seq < 0) break;
        const int h_begin = t.h_begin, nh = t.h_end - t.h_begin;
        const int64_t row0 = st.query_starts[t.seq];
        const int64_t n_rows = st.query_starts[t.seq + 1] - row0;
        const int64_t pos0 = st.context_lens[t.seq] - n_rows + t.r_begin;
        const int nq = static_cast<int>((t.r_end - t.r_begin) * nh);
        const int32_t* table = tables.data() + table_starts[t.seq];
        const auto head_of = [&](int qi) { return t.kv_head * group + h_begin + qi % nh; };

        std::vector<float> sq(size_t(kTcQueries) * kHd, 0.0f);
        for (int c = 0; c < kTcQueries * kHd / 2; ++c) {
            const int i = TcChunkKey(c, kHd), d = TcChunkDim(c, kHd);
            if (i >= nq) continue;
            const float* src = &q[((row0 + t.r_begin + i / nh) * num_heads + head_of(i)) * kHd + d];
            sq[size_t(i) * kHd + d] = round(src[0]);
            sq[size_t(i) * kHd + d + 1] = round(src[1]);
        }
        struct Lane {
            float qf[kKSteps][8];
            float m[2], l[2], o[kDTiles][4];
        };
        std::vector<Lane> lanes(size_t(kTcWarps) * kLanes);
        for (int warp = 0; warp < kTcWarps; ++warp) {
            for (int lane = 0; lane < kLanes; ++lane) {
                Lane& ln = lanes[size_t(warp) * kLanes + lane];
                for (int kk = 0; kk < kKSteps; ++kk) {
                    for (int e = 0; e < 8; ++e) {
                        const FragCoord c = MmaAElement(lane, e);
                        ln.qf[kk][e] = sq[size_t(warp * kMmaM + c.row) * kHd + kk * kMmaK + c.col];
                    }
                }
                ln.m[0] = ln.m[1] = -INFINITY;
                ln.l[0] = ln.l[1] = 0.0f;
                for (auto& od : ln.o) std::fill(od, od + 4, 0.0f);
            }
        }
        std::vector<float> sk(static_cast<size_t>(kTcTileKeys * kHd));
        std::vector<float> svt(static_cast<size_t>(kHd * kTcTileKeys));
        for (int64_t t0 = t.k_begin; t0 < t.k_end; t0 += kTcTileKeys) {
            const int nt = static_cast<int>(std::min<int64_t>(kTcTileKeys, t.k_end - t0));
            for (int c = 0; c < kTcTileKeys * kHd / 2; ++c) {
                const int j = TcChunkKey(c, kHd), d = TcChunkDim(c, kHd);
                for (int k = 0; k < 2; ++k) {
                    float kx = 0.0f, vx = 0.0f;
                    if (j < nt) {
                        const int64_t slot = SlotOfPosition(table, kv.block_size, t0 + j);
                        kx = element(kv.k_offset, slot, t.kv_head, d + k);
                        vx = element(kv.v_offset, slot, t.kv_head, d + k);
                    }
                    sk[size_t(j) * kHd + d + k] = kx;
                    svt[size_t(d + k) * kTcTileKeys + j] = vx;
                }
            }
            for (int warp = 0; warp < kTcWarps; ++warp) {
                const TcWarpSpan span = TcWarpPositions(warp, nq, nh, pos0);
                const TcTileMask mask = TcKeyTileMask(t0, nt, span, window);
                if (mask == TcTileMask::kSkip) continue;
                Lane* wl = &lanes[size_t(warp) * kLanes];
                static float s[kLanes][kTcScoreTiles][4];
                for (int n = 0; n < kTcScoreTiles; ++n) {
                    float c[kLanes][4] = {};
                    for (int kk = 0; kk < kKSteps; ++kk) {
                        float a[kLanes][8], b[kLanes][4];
                        for (int lane = 0; lane < kLanes; ++lane) {
                            std::copy(wl[lane].qf[kk], wl[lane].qf[kk] + 8, a[lane]);
                            for (int e = 0; e < 4; ++e) {
                                const FragCoord bc = MmaBElement(lane, e);
                                b[lane][e] =
                                    sk[size_t(n * kMmaN + bc.col) * kHd + kk * kMmaK + bc.row];
                            }
                        }
                        EmulateMma(a, b, c);
                    }
                    for (int lane = 0; lane < kLanes; ++lane) {
                        for (int e = 0; e < 4; ++e) {
                            const FragCoord cc = MmaCElement(lane, e);
                            float x = c[lane][e] * scale;
                            if (mask == TcTileMask::kMasked) {
                                const int qi = warp * kMmaM + cc.row, j = n * kMmaN + cc.col;
                                const bool visible =
                                    qi < nq && j < nt && KeyVisible(t0 + j, pos0 + qi / nh, window);
                                x = visible ? x : -INFINITY;
                            }
                            s[lane][n][e] = x;
                        }
                    }
                }
                // The quad reduction of the row maxes (the kernel's two __shfl_xor_sync).
                float own[kLanes][2];
                for (int lane = 0; lane < kLanes; ++lane) {
                    for (int r = 0; r < 2; ++r) own[lane][r] = TcLaneRowMax(s[lane], r);
                }
                for (int lane = 0; lane < kLanes; ++lane) {
                    float row_max[2];
                    for (int r = 0; r < 2; ++r) {
                        row_max[r] = std::max(std::max(own[lane][r], own[lane ^ 1][r]),
                                              std::max(own[lane ^ 2][r], own[lane ^ 3][r]));
                    }
                    TcSoftmaxStep(s[lane], wl[lane].m, wl[lane].l, wl[lane].o, row_max);
                }
                for (int kk = 0; kk < kTcTileKeys / kMmaK; ++kk) {
                    float a[kLanes][8];
                    for (int lane = 0; lane < kLanes; ++lane) {
                        for (int e = 0; e < 8; ++e) {
                            a[lane][e] = round(s[lane][TcPTileOf(kk, e)][TcPElementOf(e)]);
                        }
                    }
                    for (int d = 0; d < kDTiles; ++d) {
                        float b[kLanes][4], c[kLanes][4];
                        for (int lane = 0; lane < kLanes; ++lane) {
                            for (int e = 0; e < 4; ++e) {
                                const FragCoord bc = MmaBElement(lane, e);
                                b[lane][e] = svt[size_t(d * kMmaN + bc.col) * kTcTileKeys +
                                                 kk * kMmaK + bc.row];
                                c[lane][e] = wl[lane].o[d][e];
                            }
                        }
                        EmulateMma(a, b, c);
                        for (int lane = 0; lane < kLanes; ++lane) {
                            std::copy(c[lane], c[lane] + 4, wl[lane].o[d]);
                        }
                    }
                }
            }
        }
        for (int warp = 0; warp < kTcWarps; ++warp) {
            if (TcWarpPositions(warp, nq, nh, pos0).empty) continue;
            const Lane* wl = &lanes[size_t(warp) * kLanes];
            for (int lane = 0; lane < kLanes; ++lane) {
                float l[2];
                for (int r = 0; r < 2; ++r) {
                    l[r] =
                        wl[lane].l[r] + wl[lane ^ 1].l[r] + wl[lane ^ 2].l[r] + wl[lane ^ 3].l[r];
                }
                for (int d = 0; d < kDTiles; ++d) {
                    for (int e = 0; e < 4; ++e) {
                        const FragCoord c = MmaCElement(lane, e);
                        const int qi = warp * kMmaM + c.row;
                        if (qi >= nq) continue;
                        const int64_t r = row0 + t.r_begin + qi / nh;
                        const float lr = l[e >> 1];
                        out[size_t((r * num_heads + head_of(qi)) * kHd + d * kMmaN + c.col)] =
                            lr > 0.0f ? wl[lane].o[d][e] / lr : 0.0f;
                    }
                }
            }
        }
    }
}

struct Case {
    int64_t hd, kv_heads, group, window;
    bool bf16;
};

// Random steps (prefill chunks behind cached prefixes, mixed with decode rows) over shuffled
// blocks: the emulation against cpu::PagedAttentionBatched, element by element. fp32 operands:
// within float rounding (the order of the additions differs); with the kernel's bf16 roundings:
// the relative L2 error the GPU test allows (1e-2).
TEST(CudaPrefillTcMathTest, EmulatedTileLoopReproducesTheCpuAttention) {
    std::mt19937 rng(13);
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    const Case cases[] = {{64, 2, 4, 0, false},  {128, 2, 3, 0, false}, {64, 1, 9, 37, false},
                          {128, 3, 1, 0, false}, {64, 1, 70, 0, false}, {128, 2, 4, 0, true},
                          {64, 2, 4, 50, true}};
    for (const Case& cs : cases) {
        Step st;
        std::uniform_int_distribution<int> rows(2, 150), extra(0, 120);
        for (int s = 0; s < 4; ++s) {
            const int32_t n = s == 2 ? 1 : rows(rng);
            st.Add(n, n + extra(rng));
        }
        const int64_t hd = cs.hd, kv_heads = cs.kv_heads, num_heads = kv_heads * cs.group, bs = 16;
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
        const int64_t n = st.query_starts.back() * num_heads * hd;
        std::vector<float> q(static_cast<size_t>(n));
        for (float& x : q) x = u(rng);
        cpu::PagedAttentionBatch batch;
        batch.num_seqs = st.num_seqs();
        batch.query_starts = st.query_starts.data();
        batch.context_lens = st.context_lens.data();
        batch.block_table_starts = table_starts.data();
        batch.block_tables = tables.data();
        batch.window = cs.window;
        std::vector<float> want(q.size(), 0.0f), got(q.size(), std::nanf(""));
        cpu::PagedAttentionBatched(q.data(), num_heads * hd, kv, batch, want.data(), num_heads);
        if (hd == 64) {
            EmulateTcPrefill<64>(q, num_heads, kv, st, table_starts, tables, cs.window, cs.bf16,
                                 got);
        } else {
            EmulateTcPrefill<128>(q, num_heads, kv, st, table_starts, tables, cs.window, cs.bf16,
                                  got);
        }
        double num = 0, den = 0;
        for (int64_t s = 0; s < st.num_seqs(); ++s) {
            const int64_t row0 = st.query_starts[s], n_rows = st.query_starts[s + 1] - row0;
            if (n_rows == 1) continue;  // the split-KV kernel's
            for (int64_t i = row0 * num_heads * hd; i < (row0 + n_rows) * num_heads * hd; ++i) {
                ASSERT_FALSE(std::isnan(got[i])) << "element " << i << " not written";
                if (!cs.bf16) {
                    ASSERT_NEAR(got[i], want[i], 2e-5f + 2e-5f * std::fabs(want[i]))
                        << "head_dim " << hd << " group " << cs.group << " window " << cs.window
                        << " seq " << s << " element " << i;
                }
                num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
                den += double(want[i]) * want[i];
            }
        }
        const double rel = std::sqrt(num / den);
        EXPECT_LE(rel, cs.bf16 ? 1e-2 : 1e-6) << "head_dim " << hd << " bf16 " << cs.bf16;
        if (cs.bf16) {
            EXPECT_GT(rel, 1e-5) << "the bf16 roundings change the result";
        }
    }
}

TEST(CudaPrefillTcMathTest, TheSettingPicksAKernelAndNamesItselfWhenWrong) {
    EXPECT_EQ(*ParsePrefillKernel(nullptr), PrefillKernel::kFp32);  // until it has run on a device
    EXPECT_EQ(*ParsePrefillKernel("auto"), PrefillKernel::kAuto);
    EXPECT_EQ(*ParsePrefillKernel("tc"), PrefillKernel::kTensorCore);
    EXPECT_EQ(*ParsePrefillKernel("fp32"), PrefillKernel::kFp32);
    const Result<PrefillKernel> bad = ParsePrefillKernel("wmma");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().ToString().find("KVSHARD_CUDA_PREFILL=wmma"), std::string::npos)
        << bad.status().ToString();

    struct Row {
        PrefillKernel setting;
        KvDtype storage;
        int64_t head_dim;
        bool ok;
        PrefillKernel want;
    };
    const PrefillKernel tc = PrefillKernel::kTensorCore, fp32 = PrefillKernel::kFp32,
                        autok = PrefillKernel::kAuto;
    const Row rows[] = {
        {autok, KvDtype::kBf16, 128, true, tc},   {autok, KvDtype::kBf16, 64, true, tc},
        {autok, KvDtype::kFp8, 128, true, tc},    {autok, KvDtype::kInt8, 64, true, tc},
        {autok, KvDtype::kFp32, 128, true, fp32}, {autok, KvDtype::kFp16, 128, true, fp32},
        {autok, KvDtype::kBf16, 80, true, fp32},  {autok, KvDtype::kBf16, 256, true, fp32},
        {fp32, KvDtype::kBf16, 128, true, fp32},  {tc, KvDtype::kBf16, 128, true, tc},
        {tc, KvDtype::kFp32, 128, false, fp32},   {tc, KvDtype::kBf16, 80, false, fp32},
    };
    for (const Row& r : rows) {
        const Result<PrefillKernel> got = ChoosePrefillKernel(r.setting, r.storage, r.head_dim);
        ASSERT_EQ(got.ok(), r.ok) << KvDtypeName(r.storage) << " " << r.head_dim;
        if (r.ok) {
            EXPECT_EQ(*got, r.want) << KvDtypeName(r.storage) << " " << r.head_dim;
        } else {
            EXPECT_NE(got.status().ToString().find("KVSHARD_CUDA_PREFILL=tc"), std::string::npos);
        }
    }
}

}  // namespace
}  // namespace kvshard::cuda
