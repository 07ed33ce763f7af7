#include "kv/kv_geometry.h"

#include <gtest/gtest.h>

namespace kvshard::kv {
namespace {

TEST(KvGeometryTest, LocalKvHeadRange) {
    struct Case {
        int64_t kv_heads, tp, rank;
        HeadRange want;
    };
    const Case cases[] = {
        {8, 1, 0, {0, 8}},
        {8, 2, 1, {4, 8}},
        {8, 8, 3, {3, 4}},
        {8, 4, 0, {0, 2}},
        {8, 4, 3, {6, 8}},
        // Replication: tp 16 over 8 heads, two ranks per head.
        {8, 16, 0, {0, 1}},
        {8, 16, 1, {0, 1}},
        {8, 16, 2, {1, 2}},
        {8, 16, 15, {7, 8}},
        {1, 4, 2, {0, 1}},  // MQA
    };
    for (const Case& c : cases) {
        Result<HeadRange> r = LocalKvHeadRange(/*num_heads=*/32, c.kv_heads, c.tp, c.rank);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        EXPECT_EQ(*r, c.want) << c.kv_heads << " heads, tp " << c.tp << ", rank " << c.rank;
    }
}

// The planner plans even splits only; the rule itself refuses what no rank layout can hold.
TEST(KvGeometryTest, IndivisibleHeadCountsNameTheNumbers) {
    struct Case {
        int64_t heads, kv_heads, tp, rank;
        bool even_only;       // LocalKvHeadRange accepts it; CheckEvenKvHeadSplit refuses
        const char* want[2];  // substrings of the message
    };
    const Case cases[] = {
        {32, 8, 3, 0, true, {"8 KV heads", "tp 3"}},
        {32, 8, 12, 0, true, {"tp 12", "8 KV heads"}},
        {24, 6, 4, 0, true, {"6 KV heads", "tp 4"}},
        {32, 8, 4, 4, false, {"rank 4", "tp 4"}},
        {32, 8, 0, 0, false, {"tp must be positive", "0"}},
        {32, 0, 2, 0, false, {"num_kv_heads", "0"}},
        {12, 8, 2, 0, false, {"12 query heads", "8 KV heads"}},
        {8, 8, 16, 0, false, {"tp 16", "8 query heads"}},
    };
    for (const Case& c : cases) {
        Result<HeadRange> r = LocalKvHeadRange(c.heads, c.kv_heads, c.tp, c.rank);
        const Status even = CheckEvenKvHeadSplit(c.kv_heads, c.tp);
        EXPECT_EQ(r.ok(), c.even_only) << c.kv_heads << " heads, tp " << c.tp;
        const Status& refusal = c.even_only ? even : r.status();
        ASSERT_FALSE(refusal.ok());
        for (const char* w : c.want) {
            EXPECT_NE(refusal.message().find(w), std::string::npos) << refusal.message();
        }
    }
}

ModelSpec Llama3_8B() {
    ModelSpec s;
    s.num_layers = 32;
    s.hidden_size = 4096;
    s.num_heads = 32;
    s.num_kv_heads = 8;
    s.head_dim = 128;
    s.ffn_size = 14336;
    s.vocab_size = 128256;
    return s;
}

TEST(KvGeometryTest, BytesPerTokenAndBlock) {
    struct Case {
        int64_t tp;
        KvDtype dtype;
        int64_t block_size;
        int64_t bytes_per_token;
        int64_t bytes_per_block;
    };
    const Case cases[] = {
        // Llama 3 8B: 2 x 32 layers x 8 heads x 128 x 2 B = 131,072 B (128 KiB) per token.
        {1, KvDtype::kBf16, 16, 131072, 131072 * 16},
        {2, KvDtype::kBf16, 16, 65536, 65536 * 16},
        {8, KvDtype::kBf16, 16, 16384, 16384 * 16},
        {16, KvDtype::kBf16, 16, 16384, 16384 * 16},  // replicated: still one head per rank
        {1, KvDtype::kFp32, 16, 262144, 262144 * 16},
        {1, KvDtype::kFp16, 16, 131072, 131072 * 16},
        // 8-bit: 2 x 32 x 8 x (128 + 4-byte scale) = 67,584 B.
        {1, KvDtype::kFp8, 32, 67584, 67584 * 32},
        {1, KvDtype::kInt8, 16, 67584, 67584 * 16},
    };
    for (const Case& c : cases) {
        Result<KvGeometry> g = MakeKvGeometry(Llama3_8B(), c.tp, c.dtype, c.block_size);
        ASSERT_TRUE(g.ok()) << g.status().ToString();
        EXPECT_EQ(g->BytesPerToken(), c.bytes_per_token) << g->ToString();
        EXPECT_EQ(g->BytesPerBlock(), c.bytes_per_block) << g->ToString();
    }
    EXPECT_FALSE(MakeKvGeometry(Llama3_8B(), 3, KvDtype::kBf16, 16).ok());
    EXPECT_FALSE(MakeKvGeometry(Llama3_8B(), 1, KvDtype::kBf16, 0).ok());
}

TEST(KvGeometryTest, ParseDtypes) {
    struct Case {
        const char* name;
        KvDtype dtype;
        int64_t bytes;
    };
    const Case cases[] = {{"fp32", KvDtype::kFp32, 4},    {"float32", KvDtype::kFp32, 4},
                          {"bf16", KvDtype::kBf16, 2},    {"bfloat16", KvDtype::kBf16, 2},
                          {"fp16", KvDtype::kFp16, 2},    {"fp8", KvDtype::kFp8, 1},
                          {"fp8_e4m3", KvDtype::kFp8, 1}, {"int8", KvDtype::kInt8, 1}};
    for (const Case& c : cases) {
        Result<KvDtype> d = ParseKvDtype(c.name);
        ASSERT_TRUE(d.ok()) << c.name;
        EXPECT_EQ(*d, c.dtype);
        EXPECT_EQ(KvDtypeBytes(*d), c.bytes);
        EXPECT_EQ(ParseKvDtype(KvDtypeName(*d)).value(), c.dtype);
    }
    Result<KvDtype> bad = ParseKvDtype("int4");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("int4"), std::string::npos);
}

}  // namespace
}  // namespace kvshard::kv
