// The tensor-core prefill kernel's shared-memory traffic (kernels/cuda/prefill_attention_tc.cu,
// index math in kernels/cuda/prefill_tc_math.h) on the CPU: ldmatrix.x4 (plain and .trans)
// emulated as the PTX ISA describes it, fed the addresses TcLdsmTile16 / TcLdsmStrip8 give each
// lane over the kernel's Q, K and V tiles, must hand every lane the mma.m16n8k16 fragment elements
// the PTX ISA's fragment layout asks for (written here on their own, as in
// cuda_prefill_tc_math_test.cc), without shared-memory bank conflicts; the cp.async chunks cover
// each tile once at 16-byte aligned addresses; the two stages and the Q tile fit the block's
// shared memory without overlapping what is live at the same time. No GPU needed.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "kernels/cuda/launch_math.h"
#include "kernels/cuda/prefill_tc_math.h"

namespace kvshard::cuda {
namespace {

constexpr int kLanes = 32;

// ---- the PTX ISA's mma.m16n8k16 .bf16 fragments (groupID = lane >> 2, tig = lane % 4) ----
// A element i (0..7, two a register) and B element i (0..3).
FragCoord PtxA(int lane, int i) {
    const int g = lane >> 2, tig = lane % 4;
    const bool upper_row = i == 2 || i == 3 || i == 6 || i == 7;
    return {upper_row ? g + 8 : g, tig * 2 + (i & 1) + (i < 4 ? 0 : 8)};
}
FragCoord PtxB(int lane, int i) {
    const int g = lane >> 2, tig = lane % 4;
    return {tig * 2 + (i & 1) + (i < 2 ? 0 : 8), g};
}

// ---- ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16, emulated ----
// Lanes 8 i .. 8 i + 7 give the addresses (element offsets into `smem`) of rows 0..7 of matrix i;
// lane l receives in register i the two b16 of matrix i at row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 (low half first), or with .trans at column l / 4, rows 2 (l % 4) and one more.
using Regs = std::pair<uint16_t, uint16_t>;
std::vector<std::vector<Regs>> Ldmatrix(const std::vector<uint16_t>& smem, const int (&addr)[kLanes],
                                        bool trans) {
    std::vector<std::vector<Regs>> out(kLanes, std::vector<Regs>(4));
    for (int l = 0; l < kLanes; ++l) {
        for (int i = 0; i < 4; ++i) {
            auto at = [&](int row, int col) { return smem.at(size_t(addr[8 * i + row] + col)); };
            const int a = l / 4, b = 2 * (l % 4);
            out[l][i] = trans ? Regs{at(b, a), at(b + 1, a)} : Regs{at(a, b), at(a, b + 1)};
        }
    }
    return out;
}
uint16_t Half(const Regs& r, int h) { return h == 0 ? r.first : r.second; }

// A tile whose element (row, col) holds a value naming it: row · row_halves + col.
std::vector<uint16_t> NamedTile(int rows, int row_halves) {
    std::vector<uint16_t> t(size_t(rows) * row_halves);
    for (size_t i = 0; i < t.size(); ++i) t[i] = uint16_t(i);
    return t;
}

// Each 8-address phase of an ldmatrix (one matrix: 8 rows of 16 bytes) touches 8 distinct 16-byte
// bank groups of the 128-byte bank window: no conflict. And every row address is 16-byte aligned.
void ExpectConflictFreeAndAligned(const int (&addr)[kLanes], const char* what) {
    for (int i = 0; i < 4; ++i) {
        std::set<int> groups;
        for (int r = 0; r < 8; ++r) {
            EXPECT_EQ(addr[8 * i + r] * 2 % 16, 0) << what << " lane " << 8 * i + r;
            groups.insert(addr[8 * i + r] * 2 / 16 % 8);
        }
        EXPECT_EQ(groups.size(), 8u) << what << " matrix " << i;
    }
}

class CudaPrefillTcLdsmTest : public ::testing::TestWithParam<int> {};

// Q: A fragments of k-step kk for warp w's 16 rows.
TEST_P(CudaPrefillTcLdsmTest, QTileGivesTheAFragments) {
    const int hd = GetParam(), row = TcRowHalves(hd);
    const std::vector<uint16_t> q = NamedTile(kTcQueries, row);
    for (int w = 0; w < kTcWarps; ++w) {
        for (int kk = 0; kk < hd / kMmaK; ++kk) {
            int addr[kLanes];
            for (int l = 0; l < kLanes; ++l) {
                const FragCoord c = TcLdsmTile16(l);
                addr[l] = (w * kMmaM + c.row) * row + kk * kMmaK + c.col;
            }
            ExpectConflictFreeAndAligned(addr, "Q");
            const auto regs = Ldmatrix(q, addr, false);
            for (int l = 0; l < kLanes; ++l) {
                for (int e = 0; e < 8; ++e) {
                    const FragCoord a = PtxA(l, e);
                    ASSERT_EQ(Half(regs[l][e / 2], e % 2), (w * kMmaM + a.row) * row + kk * kMmaK + a.col)
                        << "warp " << w << " kk " << kk << " lane " << l << " a" << e;
                }
            }
        }
    }
}

// K (key-major): the B fragments of k-steps kk and kk + 1 of score tile n, B(k, n') = K[8 n + n'][16 kk + k].
TEST_P(CudaPrefillTcLdsmTest, KTileGivesTheScoreBFragmentsOfTwoKSteps) {
    const int hd = GetParam(), row = TcRowHalves(hd);
    const std::vector<uint16_t> k = NamedTile(kTcTileKeys, row);
    for (int n = 0; n < kTcScoreTiles; ++n) {
        for (int kk = 0; kk < hd / kMmaK; kk += 2) {
            int addr[kLanes];
            for (int l = 0; l < kLanes; ++l) {
                const FragCoord c = TcLdsmStrip8(l);
                addr[l] = (n * kMmaN + c.row) * row + kk * kMmaK + c.col;
            }
            ExpectConflictFreeAndAligned(addr, "K");
            const auto regs = Ldmatrix(k, addr, false);
            for (int l = 0; l < kLanes; ++l) {
                for (int step = 0; step < 2; ++step) {
                    for (int e = 0; e < 4; ++e) {
                        const FragCoord b = PtxB(l, e);
                        const int want = (n * kMmaN + b.col) * row + (kk + step) * kMmaK + b.row;
                        ASSERT_EQ(Half(regs[l][2 * step + e / 2], e % 2), want)
                            << "n " << n << " kk " << kk + step << " lane " << l << " b" << e;
                    }
                }
            }
        }
    }
}

// V (key-major, read transposed): the P·V B fragments of dim tiles d and d + 1 at k-step kk,
// B(k, n) = V[16 kk + k][8 d + n].
TEST_P(CudaPrefillTcLdsmTest, VTileTransposedGivesThePvBFragmentsOfTwoDimTiles) {
    const int hd = GetParam(), row = TcRowHalves(hd);
    const std::vector<uint16_t> v = NamedTile(kTcTileKeys, row);
    for (int kk = 0; kk < kTcTileKeys / kMmaK; ++kk) {
        for (int d = 0; d < hd / kMmaN; d += 2) {
            int addr[kLanes];
            for (int l = 0; l < kLanes; ++l) {
                const FragCoord c = TcLdsmTile16(l);
                addr[l] = (kk * kMmaK + c.row) * row + d * kMmaN + c.col;
            }
            ExpectConflictFreeAndAligned(addr, "V");
            const auto regs = Ldmatrix(v, addr, true);
            for (int l = 0; l < kLanes; ++l) {
                for (int tile = 0; tile < 2; ++tile) {
                    for (int e = 0; e < 4; ++e) {
                        const FragCoord b = PtxB(l, e);
                        const int want = (kk * kMmaK + b.row) * row + (d + tile) * kMmaN + b.col;
                        ASSERT_EQ(Half(regs[l][2 * tile + e / 2], e % 2), want)
                            << "kk " << kk << " d " << d + tile << " lane " << l << " b" << e;
                    }
                }
            }
        }
    }
}

// The cp.async chunks of a tile: every (key, dim) once, 16-byte destinations, and 16-byte sources
// in a pool whose base, block stride and K/V offsets are 16-byte aligned (what the launch checks).
TEST_P(CudaPrefillTcLdsmTest, CopyChunksCoverTheTileOnceAligned) {
    const int hd = GetParam(), row = TcRowHalves(hd);
    std::vector<int> seen(size_t(kTcTileKeys) * hd, 0);
    const int64_t bs = 16, kv_heads = 8, block_stride = 2 * kv_heads * bs * hd * 2 * 3 + 64;
    for (int c = 0; c < kTcTileKeys * hd / 8; ++c) {
        const int j = TcCopyChunkKey(c, hd), d = TcCopyChunkDim(c, hd);
        ASSERT_LT(j, kTcTileKeys);
        ASSERT_EQ(d % 8, 0);
        EXPECT_EQ((j * row + d) * 2 % 16, 0) << "chunk " << c;
        for (int x = 0; x < 8; ++x) ++seen[size_t(j) * hd + d + x];
        for (int64_t slot : {int64_t{0}, int64_t{5}, int64_t{37}, int64_t{1000}}) {
            for (int64_t head : {int64_t{0}, int64_t{7}}) {
                EXPECT_EQ(KvElementOffset(block_stride, 0, bs, hd, 2, slot, head, d) % 16, 0);
            }
        }
    }
    for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << "element " << i;
}

// Two stages of K and V and the header fit TcSharedBytes; the stages do not overlap; the Q tile
// lies inside stage 1's K tile (dead once Q is in registers) and clear of stage 0, where tile 0
// is copied while Q is loaded; everything 16-byte aligned.
TEST_P(CudaPrefillTcLdsmTest, StagesAndQTileFitTheSharedMemory) {
    const int hd = GetParam();
    const int64_t header = 2 * kTcTileKeys * 8, tile = TcTileHalves(hd);
    EXPECT_EQ(header % 16, 0);
    const int at[4] = {TcKTileAt(0, hd), TcVTileAt(0, hd), TcKTileAt(1, hd), TcVTileAt(1, hd)};
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(at[i], i * tile);
        EXPECT_EQ(at[i] * 2 % 16, 0);
    }
    EXPECT_EQ(header + 4 * tile * 2, TcSharedBytes(hd));
    const int q = TcQTileAt(hd), q_end = q + kTcQueries * TcRowHalves(hd);
    EXPECT_GE(q, TcKTileAt(1, hd));
    EXPECT_LE(q_end, TcKTileAt(1, hd) + tile);
    EXPECT_GE(q, TcVTileAt(0, hd) + tile);
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaPrefillTcLdsmTest, ::testing::Values(64, 128));

}  // namespace
}  // namespace kvshard::cuda
