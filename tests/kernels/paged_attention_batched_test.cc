// PagedAttentionBatched against cpu::PagedAttention run per sequence over the same pool.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/paged_attention.h"

namespace kvshard::cpu {
namespace {

struct Seq {
    int32_t context_len;
    int32_t rows;  // the last `rows` positions of the context are this step's queries
};

struct BatchedCase {
    std::string name;
    std::vector<Seq> seqs;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    KvDtype storage = KvDtype::kFp32;
    std::vector<int32_t> kv_head_of_q = {};  // empty: null (h / group)
    int64_t q_stride_extra = 0;              // floats after each q row's heads (fused QKV)
    int64_t window = 0;                      // sliding window (0: none)
};

std::ostream& operator<<(std::ostream& os, const BatchedCase& c) { return os << c.name; }

std::vector<float> RandomVector(size_t n, std::mt19937& gen) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (float& x : v) x = dist(gen);
    return v;
}

// A two-layer pool with the sequences' blocks shuffled across it; the tests use layer 1, so the
// layer offsets matter. Every position of every context holds random K/V.
struct Pool {
    Pool(const BatchedCase& c, std::mt19937& gen) {
        const int64_t layer_bytes =
            PagedLayerBytes(c.storage, c.block_size, c.num_kv_heads, c.head_dim);
        int64_t num_blocks = 1;
        for (const Seq& s : c.seqs) num_blocks += (s.context_len + c.block_size - 1) / c.block_size;
        bytes.assign(static_cast<size_t>(num_blocks * 2 * layer_bytes), 0);
        kv = MakePagedKvLayer(bytes.data(), 2 * layer_bytes, 1, c.storage, c.block_size,
                              c.num_kv_heads, c.head_dim);
        std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), gen);
        size_t next = 0;
        table_starts.push_back(0);
        const int64_t row = c.num_kv_heads * c.head_dim;
        for (const Seq& s : c.seqs) {
            const int64_t blocks = (s.context_len + c.block_size - 1) / c.block_size;
            for (int64_t b = 0; b < blocks; ++b) tables.push_back(ids[next++]);
            table_starts.push_back(static_cast<int32_t>(tables.size()));
            const int32_t* table = tables.data() + table_starts[table_starts.size() - 2];
            std::vector<int64_t> slots(static_cast<size_t>(s.context_len));
            for (int64_t p = 0; p < s.context_len; ++p) {
                slots[p] = int64_t{table[p / c.block_size]} * c.block_size + p % c.block_size;
            }
            const auto k = RandomVector(static_cast<size_t>(s.context_len * row), gen);
            const auto v = RandomVector(static_cast<size_t>(s.context_len * row), gen);
            PagedKvWrite(kv, k.data(), v.data(), row, slots.data(), s.context_len);
        }
    }
    std::vector<uint8_t> bytes;
    PagedKvLayer kv;
    std::vector<int32_t> tables, table_starts;
};

// max|got - want| / max|want|.
double NormalizedError(const std::vector<float>& got, const std::vector<float>& want) {
    double diff = 0.0, mag = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
        diff = std::max(diff, std::abs(double{got[i]} - want[i]));
        mag = std::max(mag, std::abs(double{want[i]}));
    }
    return mag > 0.0 ? diff / mag : diff;
}

class PagedAttentionBatchedTest : public ::testing::TestWithParam<BatchedCase> {};

TEST_P(PagedAttentionBatchedTest, MatchesPagedAttentionPerSequence) {
    const BatchedCase c = GetParam();
    std::mt19937 gen(42);
    Pool pool(c, gen);
    const int64_t hd = c.head_dim;
    const int64_t q_width = c.num_heads * hd;
    const int64_t q_stride = q_width + c.q_stride_extra;
    std::vector<int32_t> query_starts{0}, context_lens;
    for (const Seq& s : c.seqs) {
        query_starts.push_back(query_starts.back() + s.rows);
        context_lens.push_back(s.context_len);
    }
    const int64_t rows = query_starts.back();
    const auto q = RandomVector(static_cast<size_t>(rows * q_stride), gen);
    const int32_t* map = c.kv_head_of_q.empty() ? nullptr : c.kv_head_of_q.data();

    // Reference: one PagedAttention per sequence on dense query rows.
    std::vector<float> want(static_cast<size_t>(rows * q_width));
    for (size_t s = 0; s < c.seqs.size(); ++s) {
        const int64_t n = c.seqs[s].rows;
        if (n == 0) continue;
        std::vector<float> dense(static_cast<size_t>(n * q_width));
        for (int64_t i = 0; i < n; ++i) {
            std::copy_n(q.begin() + (query_starts[s] + i) * q_stride, q_width,
                        dense.begin() + i * q_width);
        }
        PagedAttention(dense.data(), pool.kv, pool.tables.data() + pool.table_starts[s],
                       want.data() + query_starts[s] * q_width, n, c.seqs[s].context_len - n,
                       c.num_heads, map, c.window);
    }

    PagedAttentionBatch batch;
    batch.num_seqs = static_cast<int64_t>(c.seqs.size());
    batch.query_starts = query_starts.data();
    batch.context_lens = context_lens.data();
    batch.block_table_starts = pool.table_starts.data();
    batch.block_tables = pool.tables.data();
    batch.window = c.window;
    // One thread runs every tile whole; several split long KV walks of small batches.
    const int saved_threads = omp_get_max_threads();
    for (int threads : {1, 3}) {
        omp_set_num_threads(threads);
        std::vector<float> got(want.size(), std::nanf(""));
        PagedAttentionBatched(q.data(), q_stride, pool.kv, batch, got.data(), c.num_heads, map);
        EXPECT_LE(NormalizedError(got, want), 1e-5) << c.name << " threads=" << threads;
    }
    omp_set_num_threads(saved_threads);
}

// 8-bit and 16-bit storages are compared with PagedAttention over the same pool: both decode to the
// same floats, so the fp32 bound holds.
const std::vector<Seq> kMixed = {{200, 50}, {1, 1}, {513, 1}, {64, 64}, {90, 3}, {10, 0}};

INSTANTIATE_TEST_SUITE_P(
    Cases, PagedAttentionBatchedTest,
    ::testing::Values(
        BatchedCase{"DecodeOneRow", {{37, 1}}, 9, 3, 64, 16},
        BatchedCase{"PrefillFromZero", {{100, 100}}, 9, 3, 64, 16},
        BatchedCase{"PrefillChunkMidSequence", {{300, 70}}, 9, 3, 64, 16},
        BatchedCase{"Mixed", kMixed, 9, 3, 64, 16},
        BatchedCase{"MixedBlock1", {{130, 20}, {7, 1}, {40, 40}}, 4, 2, 64, 1},
        BatchedCase{"MixedBlock4HeadDim128", {{75, 30}, {129, 1}, {9, 9}}, 4, 2, 128, 4},
        BatchedCase{"MixedBlock64NoGqa", {{300, 100}, {65, 1}, {128, 17}}, 4, 4, 64, 64},
        BatchedCase{"Stories260KShape", {{60, 60}, {33, 1}, {70, 5}}, 8, 4, 8, 16},
        BatchedCase{"HeadDim8NoGqa", {{60, 20}, {33, 1}}, 8, 8, 8, 4},
        BatchedCase{"WideGroupOver64Heads", {{40, 3}, {20, 1}}, 72, 1, 8, 16},
        BatchedCase{"KvHeadMapUneven",
                    {{120, 40}, {50, 1}},
                    6,
                    4,
                    64,
                    16,
                    KvDtype::kFp32,
                    {3, 0, 0, 2, 3, 3}},
        BatchedCase{
            "KvHeadMapTensorParallelSlice", kMixed, 3, 1, 64, 16, KvDtype::kFp32, {0, 0, 0}},
        BatchedCase{"FusedQkvStride", kMixed, 9, 3, 64, 16, KvDtype::kFp32, {}, 2 * 3 * 64},
        BatchedCase{"LongDecodesSplitKv", {{2048, 1}, {1500, 1}}, 9, 3, 64, 16},
        BatchedCase{"LongPrefillChunk", {{1100, 300}}, 9, 3, 64, 16},
        BatchedCase{"Int8Mixed", kMixed, 9, 3, 64, 16, KvDtype::kInt8},
        BatchedCase{"Int8HeadDim128Block4", {{75, 30}, {700, 1}}, 4, 2, 128, 4, KvDtype::kInt8},
        BatchedCase{"Fp8Mixed", kMixed, 9, 3, 64, 16, KvDtype::kFp8},
        BatchedCase{"Fp8Stories260KShape", {{60, 60}, {33, 1}}, 8, 4, 8, 1, KvDtype::kFp8, {}, 16},
        BatchedCase{"Bf16Mixed", kMixed, 9, 3, 64, 16, KvDtype::kBf16},
        BatchedCase{"Bf16HeadDim128Block4", {{75, 30}, {700, 1}}, 4, 2, 128, 4, KvDtype::kBf16},
        BatchedCase{"Bf16LongDecodesSplitKv", {{2048, 1}, {1500, 1}}, 9, 3, 64, 16, KvDtype::kBf16},
        BatchedCase{"Bf16HeadDim8Block1", {{60, 60}, {33, 1}}, 8, 4, 8, 1, KvDtype::kBf16, {}, 16},
        BatchedCase{"Fp16Mixed", kMixed, 9, 3, 64, 16, KvDtype::kFp16},
        BatchedCase{"Fp16HeadDim128Block4", {{75, 30}, {700, 1}}, 4, 2, 128, 4, KvDtype::kFp16},
        // Sliding windows: shorter than a prefill chunk (late lanes see nothing in the first
        // chunks), across split decode walks, of one position, longer than the context, and
        // Gemma 3's 512 over a long prefill chunk.
        BatchedCase{"WindowMixed", kMixed, 9, 3, 64, 16, KvDtype::kFp32, {}, 0, 40},
        BatchedCase{"WindowPrefillChunk", {{300, 200}}, 9, 3, 64, 16, KvDtype::kFp32, {}, 0, 7},
        BatchedCase{"WindowLongDecodesSplitKv",
                    {{2048, 1}, {1500, 1}},
                    9,
                    3,
                    64,
                    16,
                    KvDtype::kFp32,
                    {},
                    0,
                    700},
        BatchedCase{"WindowOne", {{70, 20}, {33, 1}}, 4, 2, 64, 16, KvDtype::kFp32, {}, 0, 1},
        BatchedCase{"WindowPastContext", kMixed, 4, 1, 64, 16, KvDtype::kFp32, {}, 0, 5000},
        BatchedCase{
            "WindowGemma512", {{1100, 300}, {900, 1}}, 4, 1, 256, 16, KvDtype::kFp32, {}, 0, 512},
        BatchedCase{
            "WindowInt8HeadDim8", {{60, 60}, {33, 1}}, 8, 4, 8, 4, KvDtype::kInt8, {}, 0, 9},
        BatchedCase{"WindowBf16Mixed", kMixed, 9, 3, 64, 16, KvDtype::kBf16, {}, 0, 40}),
    [](const ::testing::TestParamInfo<BatchedCase>& info) { return info.param.name; });

TEST(PagedAttentionBatchedTest, EmptyBatchWritesNothing) {
    std::vector<uint8_t> bytes(PagedLayerBytes(KvDtype::kFp32, 16, 1, 8));
    const PagedKvLayer kv = MakePagedKvLayer(bytes.data(), static_cast<int64_t>(bytes.size()), 0,
                                             KvDtype::kFp32, 16, 1, 8);
    const int32_t zero[1] = {0};
    PagedAttentionBatch batch;
    batch.query_starts = zero;
    batch.block_table_starts = zero;
    float out = 7.0f;
    PagedAttentionBatched(nullptr, 8, kv, batch, &out, 1);
    EXPECT_EQ(out, 7.0f);
}

// Every KvDtype is stored: a layer of a 16-bit pool is half an fp32 pool's, an 8-bit one a quarter
// plus its scales, the bytes kv::KvGeometry counts (2 × KvRowBytes per head and slot).
TEST(PagedAttentionBatchedTest, EveryDtypeHasItsLayerBytes) {
    const std::pair<KvDtype, int64_t> cases[] = {{KvDtype::kFp32, 2 * 3 * 16 * 64 * 4},
                                                 {KvDtype::kBf16, 2 * 3 * 16 * 64 * 2},
                                                 {KvDtype::kFp16, 2 * 3 * 16 * 64 * 2},
                                                 {KvDtype::kFp8, 2 * 3 * 16 * (64 + 4)},
                                                 {KvDtype::kInt8, 2 * 3 * 16 * (64 + 4)}};
    for (const auto& [dtype, bytes] : cases) {
        EXPECT_EQ(PagedLayerBytes(dtype, 16, 3, 64), bytes) << KvDtypeName(dtype);
        EXPECT_EQ(PagedLayerBytes(dtype, 16, 3, 64), 2 * 3 * 16 * KvRowBytes(dtype, 64));
        const PagedKvLayer l = MakePagedKvLayer(nullptr, 0, 2, dtype, 16, 3, 64);
        EXPECT_EQ(l.k_offset, 2 * bytes) << KvDtypeName(dtype);
        EXPECT_EQ(l.v_offset - l.k_offset, 3 * 16 * 64 * KvDtypeBytes(dtype));
    }
}

// The batched kernel over a 16-bit pool against the same kernel over an fp32 pool of the same
// K/V: the only difference is bf16's (fp16's) rounding of K and V, 2^-9 (2^-12) of each value,
// so the outputs agree within a few of those.
TEST(PagedAttentionBatchedTest, SixteenBitPoolsAgainstFp32) {
    for (const auto& [dtype, bound] :
         {std::pair{KvDtype::kBf16, 1e-2}, std::pair{KvDtype::kFp16, 2e-3}}) {
        const BatchedCase fp32{"fp32", kMixed, 9, 3, 64, 16};
        BatchedCase low = fp32;
        low.storage = dtype;
        // Same seed: the same blocks and the same K/V values, stored at two precisions.
        std::mt19937 g1(7), g2(7);
        Pool a(fp32, g1), b(low, g2);
        ASSERT_EQ(a.tables, b.tables);
        std::vector<int32_t> query_starts{0}, context_lens;
        for (const Seq& s : kMixed) {
            query_starts.push_back(query_starts.back() + s.rows);
            context_lens.push_back(s.context_len);
        }
        const int64_t rows = query_starts.back(), width = 9 * 64;
        std::mt19937 gq(8);
        const auto q = RandomVector(static_cast<size_t>(rows * width), gq);
        PagedAttentionBatch batch;
        batch.num_seqs = static_cast<int64_t>(kMixed.size());
        batch.query_starts = query_starts.data();
        batch.context_lens = context_lens.data();
        batch.block_table_starts = a.table_starts.data();
        batch.block_tables = a.tables.data();
        std::vector<float> want(static_cast<size_t>(rows * width)), got(want.size());
        PagedAttentionBatched(q.data(), width, a.kv, batch, want.data(), 9);
        PagedAttentionBatched(q.data(), width, b.kv, batch, got.data(), 9);
        const double err = NormalizedError(got, want);
        EXPECT_LE(err, bound) << KvDtypeName(dtype);
        EXPECT_GT(err, 0.0) << KvDtypeName(dtype) << ": the pool must round";
    }
}

}  // namespace
}  // namespace kvshard::cpu
