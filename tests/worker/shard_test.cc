// Sharding of a model across tensor-parallel ranks: the slices each rank holds (worker/shard.h),
// and loading exactly those slices from the file (row ranges, block-aligned column ranges, the
// Hugging Face Q/K permutation per head).
#include "worker/shard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu_backend.h"
#include "model/hf_export.h"
#include "model/model_file.h"
#include "model/synthetic_gguf.h"
#include "tests/test_util.h"
#include "worker/weights.h"

namespace kvshard {
namespace {

using testing::SharedModel;
using testing::TempDir;

ModelSpec Spec(int64_t heads, int64_t kv_heads, int64_t ffn, int64_t vocab) {
    ModelSpec s;
    s.num_layers = 1;
    s.hidden_size = 64;
    s.num_heads = heads;
    s.num_kv_heads = kv_heads;
    s.head_dim = 8;
    s.ffn_size = ffn;
    s.vocab_size = vocab;
    return s;
}

struct LayoutCase {
    const char* name;
    int64_t heads, kv_heads, ffn, vocab;
    int rank, tp;
    IndexRange q, kv, ffn_cols, vocab_rows;
    std::vector<int32_t> kv_head_of_q;
};

void PrintTo(const LayoutCase& c, std::ostream* os) { *os << c.name; }

class ShardLayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(ShardLayoutTest, Slices) {
    const LayoutCase& c = GetParam();
    Result<ShardLayout> l =
        MakeShardLayout(Spec(c.heads, c.kv_heads, c.ffn, c.vocab), {.rank = c.rank, .tp = c.tp});
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    EXPECT_EQ(l->q_heads, c.q);
    EXPECT_EQ(l->kv_heads, c.kv);
    EXPECT_EQ(l->ffn, c.ffn_cols);
    EXPECT_EQ(l->vocab, c.vocab_rows);
    EXPECT_EQ(l->kv_head_of_q, c.kv_head_of_q);
    EXPECT_EQ(l->vocab_padded, (c.vocab + c.tp - 1) / c.tp);
}

// clang-format off
INSTANTIATE_TEST_SUITE_P(
    Cases, ShardLayoutTest,
    ::testing::Values(
        //          name                   H  KV   ffn  vocab  r  tp  q heads   KV heads  MLP columns   vocabulary      kv_head_of_q
        // SmolLM2 (9 query heads, groups of 3) at tp 2: KV head 1 is split, both ranks hold it.
        LayoutCase{"SmolLM2Tp2Rank0",      9,  3, 1536, 49152, 0, 2,  {0, 4},   {0, 2},   {0, 768},     {0, 24576},     {0, 0, 0, 1}},
        LayoutCase{"SmolLM2Tp2Rank1",      9,  3, 1536, 49152, 1, 2,  {4, 9},   {1, 3},   {768, 1536},  {24576, 49152}, {0, 0, 1, 1, 1}},
        LayoutCase{"SmolLM2Tp3Rank2",      9,  3, 1536, 49152, 2, 3,  {6, 9},   {2, 3},   {1024, 1536}, {32768, 49152}, {0, 0, 0}},
        // stories260K: ffn 172 splits at multiples of 32.
        LayoutCase{"Stories260KTp2Rank0",  8,  4,  172,   512, 0, 2,  {0, 4},   {0, 2},   {0, 64},      {0, 256},       {0, 0, 1, 1}},
        LayoutCase{"Stories260KTp4Rank3",  8,  4,  172,   512, 3, 4,  {6, 8},   {3, 4},   {128, 172},   {384, 512},     {0, 0}},
        // 70B-class attention (64 / 8): at tp 16 each KV head is replicated on two ranks.
        LayoutCase{"Llama70BTp16Rank5",   64,  8,  512,   512, 5, 16, {20, 24}, {2, 3},   {160, 192},   {160, 192},     {0, 0, 0, 0}},
        LayoutCase{"Llama70BTp8Rank7",    64,  8,  512,   512, 7, 8,  {56, 64}, {7, 8},   {448, 512},   {448, 512},     {0, 0, 0, 0, 0, 0, 0, 0}},
        // Odd vocabulary: slices of 170, 171, 171, padded to 171.
        LayoutCase{"OddVocabTp3Rank1",     6,  6,   96,   512, 1, 3,  {2, 4},   {2, 4},   {32, 64},     {170, 341},     {0, 1}}),
    [](const ::testing::TestParamInfo<LayoutCase>& info) { return info.param.name; });
// clang-format on

// Over all ranks: every query head, MLP column and token once; every KV head a query head reads
// is held by that head's rank.
TEST(ShardLayout, RanksCoverEverythingOnce) {
    for (const auto& [heads, kv_heads] : {std::pair{9, 3}, {8, 4}, {64, 8}, {6, 6}, {32, 8}}) {
        for (int tp = 1; tp <= heads; ++tp) {
            const ModelSpec spec = Spec(heads, kv_heads, 1536, 49153);
            int64_t q_next = 0, ffn_next = 0, vocab_next = 0;
            for (int r = 0; r < tp; ++r) {
                Result<ShardLayout> l = MakeShardLayout(spec, {.rank = r, .tp = tp});
                ASSERT_TRUE(l.ok());
                EXPECT_EQ(l->q_heads.begin, q_next);
                EXPECT_EQ(l->ffn.begin, ffn_next);
                EXPECT_EQ(l->ffn.begin % ShardLayout::kColumnAlign, 0);
                EXPECT_EQ(l->vocab.begin, vocab_next);
                EXPECT_LE(l->vocab.size(), l->vocab_padded);
                EXPECT_GE(l->num_q_heads(), 1);
                q_next = l->q_heads.end;
                ffn_next = l->ffn.end;
                vocab_next = l->vocab.end;
                const int64_t group = heads / kv_heads;
                for (int64_t h = 0; h < l->num_q_heads(); ++h) {
                    EXPECT_EQ(l->kv_heads.begin + l->kv_head_of_q[h],
                              (l->q_heads.begin + h) / group)
                        << "heads " << heads << " tp " << tp << " rank " << r;
                }
            }
            EXPECT_EQ(q_next, heads);
            EXPECT_EQ(ffn_next, 1536);
            EXPECT_EQ(vocab_next, 49153);
        }
    }
}

TEST(ShardLayout, RefusesMoreRanksThanQueryHeads) {
    Result<ShardLayout> l = MakeShardLayout(Spec(9, 3, 1536, 100), {.rank = 0, .tp = 10});
    ASSERT_FALSE(l.ok());
    EXPECT_EQ(l.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find("tp 10"), std::string::npos) << l.status().message();
    EXPECT_NE(l.status().message().find("9 query heads"), std::string::npos);
    EXPECT_FALSE(MakeShardLayout(Spec(9, 3, 1536, 100), {.rank = 0, .tp = 0}).ok());
    EXPECT_FALSE(MakeShardLayout(Spec(9, 3, 1536, 100), {.rank = 2, .tp = 2}).ok());
}

// A synthetic model in a real GGUF file, with quantized 2-D weights.
class ShardedLoad : public ::testing::TestWithParam<DType> {
  protected:
    void SetUp() override {
        ModelSpec s;
        s.num_layers = 2;
        s.hidden_size = 128;
        s.num_heads = 16;
        s.num_kv_heads = 4;
        s.head_dim = 16;
        s.ffn_size = 384;
        s.vocab_size = 300;
        s.bos_token_id = 1;
        s.eos_token_id = 2;
        const std::string path = dir_.File("model.gguf");
        ASSERT_TRUE(SyntheticLlamaGguf(s, {.weight_dtype = GetParam()}).WriteFile(path).ok());
        Result<std::unique_ptr<ModelFile>> f = OpenModel(path);
        ASSERT_TRUE(f.ok()) << f.status().ToString();
        file_ = std::move(*f);
    }
    TempDir dir_;
    std::unique_ptr<ModelFile> file_;
};

// Rows [begin, end) of each `cols`-wide row of `full`, restricted to columns [c0, c1).
std::vector<float> Block(const std::vector<float>& full, int64_t cols, int64_t r0, int64_t r1,
                         int64_t c0, int64_t c1) {
    std::vector<float> out;
    for (int64_t r = r0; r < r1; ++r) {
        out.insert(out.end(), full.begin() + r * cols + c0, full.begin() + r * cols + c1);
    }
    return out;
}

// The rows of a weight as floats; sub-ranges of rows of the fused matrices.
std::vector<float> Floats(Backend& backend, const WeightView& w, int64_t r0 = 0, int64_t r1 = -1) {
    const std::vector<float> all = ReadWeightRows(backend, w);
    if (r1 < 0) r1 = w.rows;
    return std::vector<float>(all.begin() + r0 * w.cols, all.begin() + r1 * w.cols);
}

// Each rank's tensors are exactly the corresponding slices of the whole model's (bit for bit),
// whether kept in the file's format or dequantized at load.
TEST_P(ShardedLoad, SlicesEqualTheWholeModelsSlices) {
    if (!file_) return;
    const ModelSpec& s = file_->spec();
    CpuBackend backend{BackendConfig{}};
    Result<ModelWeights> whole = LoadWeights(*file_, backend, {.format = WeightFormat::kF32});
    ASSERT_TRUE(whole.ok()) << whole.status().ToString();
    const int64_t h = s.hidden_size, hd = s.head_dim;
    const int64_t q_all = s.num_heads * hd, kv_all = s.num_kv_heads * hd;
    for (WeightFormat format : {WeightFormat::kF32, WeightFormat::kStored}) {
        for (int tp : {2, 4, 8}) {
            size_t sum_bytes = 0;
            int64_t kv_heads_held = 0;
            for (int r = 0; r < tp; ++r) {
                Result<ModelWeights> part = LoadWeights(
                    *file_, backend, {.shard = {.rank = r, .tp = tp}, .format = format});
                ASSERT_TRUE(part.ok()) << part.status().ToString();
                const ShardLayout& sl = part->layout;
                sum_bytes += part->NumBytes();
                kv_heads_held += sl.num_kv_heads();
                EXPECT_EQ(Floats(backend, part->embedding),
                          Block(Floats(backend, whole->embedding), h, sl.vocab.begin, sl.vocab.end,
                                0, h));
                for (size_t l = 0; l < whole->layers.size(); ++l) {
                    const LayerWeights& w = whole->layers[l];
                    const LayerWeights& p = part->layers[l];
                    const int64_t q0 = sl.q_heads.begin * hd, q1 = sl.q_heads.end * hd;
                    const int64_t k0 = sl.kv_heads.begin * hd, k1 = sl.kv_heads.end * hd;
                    const int64_t qr = q1 - q0, kr = k1 - k0;
                    const std::vector<float> wqkv = Floats(backend, w.qkv);
                    EXPECT_EQ(Floats(backend, p.qkv, 0, qr), Block(wqkv, h, q0, q1, 0, h))
                        << "tp " << tp << " rank " << r;
                    EXPECT_EQ(Floats(backend, p.qkv, qr, qr + kr),
                              Block(wqkv, h, q_all + k0, q_all + k1, 0, h));
                    EXPECT_EQ(Floats(backend, p.qkv, qr + kr, qr + 2 * kr),
                              Block(wqkv, h, q_all + kv_all + k0, q_all + kv_all + k1, 0, h));
                    EXPECT_EQ(Floats(backend, p.wo),
                              Block(Floats(backend, w.wo), q_all, 0, h, q0, q1));
                    const int64_t f = sl.ffn.size();
                    const std::vector<float> wgu = Floats(backend, w.gate_up);
                    EXPECT_EQ(Floats(backend, p.gate_up, 0, f),
                              Block(wgu, h, sl.ffn.begin, sl.ffn.end, 0, h));
                    EXPECT_EQ(
                        Floats(backend, p.gate_up, f, 2 * f),
                        Block(wgu, h, s.ffn_size + sl.ffn.begin, s.ffn_size + sl.ffn.end, 0, h));
                    EXPECT_EQ(Floats(backend, p.down), Block(Floats(backend, w.down), s.ffn_size, 0,
                                                             h, sl.ffn.begin, sl.ffn.end));
                    EXPECT_EQ(Floats(backend, p.attn_norm), Floats(backend, w.attn_norm));
                    if (format == WeightFormat::kStored) {
                        EXPECT_EQ(p.qkv.dtype, GetParam());
                        EXPECT_EQ(p.attn_norm.dtype, DType::kF32);
                    }
                }
            }
            if (format != WeightFormat::kF32) continue;
            // Each rank holds about 1/tp: only the norms are replicated, and the K/V projections
            // of KV heads held by several ranks (tp 8: each of the 4 by two ranks).
            const int64_t layers = static_cast<int64_t>(whole->layers.size());
            const int64_t norms = (2 * layers + 1) * h * int64_t(sizeof(float));
            const int64_t kv = layers * 2 * (kv_heads_held - s.num_kv_heads) * hd * h * 4;
            EXPECT_EQ(kv_heads_held, tp <= 4 ? 4 : tp);
            EXPECT_EQ(int64_t(sum_bytes), int64_t(whole->NumBytes()) + (tp - 1) * norms + kv)
                << "tp " << tp;
        }
    }
}

// A column slice must start and end on a quantization block: one query head of 16 columns is
// half a block of 32.
TEST_P(ShardedLoad, RefusesColumnSlicesInsideABlock) {
    if (!file_) return;
    CpuBackend backend{BackendConfig{}};
    Result<ModelWeights> w = LoadWeights(*file_, backend, {.shard = {.rank = 1, .tp = 16}});
    if (GetParam() == DType::kF32) {
        EXPECT_TRUE(w.ok()) << w.status().ToString();
        return;
    }
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(w.status().message().find("attn_output"), std::string::npos) << w.status().message();
    EXPECT_NE(w.status().message().find("[16, 32)"), std::string::npos) << w.status().message();
}

INSTANTIATE_TEST_SUITE_P(Types, ShardedLoad,
                         ::testing::Values(DType::kF32, DType::kQ4_1, DType::kQ8_0),
                         [](const ::testing::TestParamInfo<DType>& info) {
                             return std::string(DTypeName(info.param));
                         });

// Hugging Face files store Q/K rows half-split; a rank permutes its own heads, and gets the rows
// the whole model's interleaved weights have.
TEST(ShardedLoadHf, HalfSplitPermutationPerHead) {
    const std::string src = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(src, "stories260K.bin");
    TempDir dir;
    Result<std::unique_ptr<ModelFile>> original = OpenModel(src);
    ASSERT_TRUE(original.ok());
    ASSERT_TRUE(ExportHuggingFace(**original, dir.path()).ok());
    Result<std::unique_ptr<ModelFile>> hf = OpenModel(dir.path());
    ASSERT_TRUE(hf.ok()) << hf.status().ToString();
    ASSERT_EQ((*hf)->spec().qk_layout, QkLayout::kHalfSplit);
    CpuBackend backend{BackendConfig{}};
    Result<ModelWeights> whole = LoadWeights(**original, backend);
    ASSERT_TRUE(whole.ok());
    const ModelSpec& s = (*hf)->spec();
    for (int r = 0; r < 4; ++r) {
        Result<ModelWeights> part = LoadWeights(**hf, backend, {.shard = {.rank = r, .tp = 4}});
        ASSERT_TRUE(part.ok()) << part.status().ToString();
        const ShardLayout& sl = part->layout;
        const int64_t hd = s.head_dim, h = s.hidden_size;
        const int64_t qr = sl.num_q_heads() * hd, kr = sl.num_kv_heads() * hd;
        const std::vector<float> wqkv = Floats(backend, whole->layers[0].qkv);
        EXPECT_EQ(Floats(backend, part->layers[0].qkv, 0, qr),
                  Block(wqkv, h, sl.q_heads.begin * hd, sl.q_heads.end * hd, 0, h));
        const int64_t q_all = s.num_heads * hd;
        EXPECT_EQ(
            Floats(backend, part->layers[0].qkv, qr, qr + kr),
            Block(wqkv, h, q_all + sl.kv_heads.begin * hd, q_all + sl.kv_heads.end * hd, 0, h));
    }
}

}  // namespace
}  // namespace kvshard
