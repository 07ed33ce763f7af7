// LoadWeights keeps each weight only in the form its backend's ops read (ResidentWeightFormat):
// the CUDA backend's formats loaded onto the CPU backend (formats_of), checked value by value
// against the stored-format load.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu_backend.h"
#include "model/model_file.h"
#include "model/synthetic_gguf.h"
#include "tests/test_util.h"
#include "worker/weights.h"

namespace kvshard {
namespace {

TEST(ResidentWeightFormat, CpuKeepsEveryStoredFormat) {
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0,
                    DType::kQ4_1}) {
        for (WeightUse u : {WeightUse::kMatMul, WeightUse::kEmbedding,
                            WeightUse::kEmbeddingAndMatMul}) {
            EXPECT_EQ(ResidentWeightFormat(BackendKind::kCpu, d, u), d) << DTypeName(d);
        }
    }
}

TEST(ResidentWeightFormat, CudaMultipliesBf16AndGathersF32) {
    constexpr BackendKind kCuda = BackendKind::kCuda;
    for (DType d : {DType::kF32, DType::kBF16}) {
        EXPECT_EQ(ResidentWeightFormat(kCuda, d, WeightUse::kMatMul), d);
        EXPECT_EQ(ResidentWeightFormat(kCuda, d, WeightUse::kEmbedding), d);
        EXPECT_EQ(ResidentWeightFormat(kCuda, d, WeightUse::kEmbeddingAndMatMul), d);
    }
    for (DType d : {DType::kF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
        EXPECT_EQ(ResidentWeightFormat(kCuda, d, WeightUse::kMatMul), DType::kBF16);
        EXPECT_EQ(ResidentWeightFormat(kCuda, d, WeightUse::kEmbedding), DType::kF32);
        EXPECT_EQ(ResidentWeightFormat(kCuda, d, WeightUse::kEmbeddingAndMatMul), DType::kF32);
    }
}

size_t ViewBytes(const WeightView& w) { return RowBytes(w.dtype, w.cols) * static_cast<size_t>(w.rows); }

// `resident` holds exactly the bf16 rounding of `stored`'s values (or the values, for F32).
void ExpectConverted(Backend& backend, const WeightView& stored, const WeightView& resident,
                     DType expected, const char* what) {
    SCOPED_TRACE(what);
    ASSERT_EQ(resident.dtype, expected);
    ASSERT_EQ(resident.rows, stored.rows);
    ASSERT_EQ(resident.cols, stored.cols);
    const std::vector<float> want = ReadWeightRows(backend, stored);
    const std::vector<float> got = ReadWeightRows(backend, resident);
    ASSERT_EQ(got.size(), want.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const float w = expected == DType::kBF16 ? BF16ToFloat(FloatToBF16(want[i])) : want[i];
        mismatches += got[i] != w;
    }
    EXPECT_EQ(mismatches, 0u) << "of " << want.size();
}

// The bytes a device plan reserves for the weights are the bytes LoadWeights allocates, for every
// backend's forms, at tp 1 and on rank 0 of tp 2, with biases and q/k norms built on the host.
TEST(ResidentWeights, PlannedBytesAreTheLoadedArena) {
    testing::TempDir dir;
    for (const char* arch : {"llama", "qwen2", "gemma3"}) {
        SCOPED_TRACE(arch);
        const std::string path = dir.File(std::string(arch) + ".gguf");
        const SyntheticGgufOptions o{.weight_dtype = DType::kQ8_0, .seed = 5};
        ASSERT_TRUE(SyntheticLlamaGguf(SyntheticArchSpec(arch), o).WriteFile(path).ok());
        Result<std::unique_ptr<ModelFile>> model = OpenModel(path);
        ASSERT_TRUE(model.ok()) << model.status().ToString();
        CpuBackend backend(BackendConfig{});
        for (BackendKind kind : {BackendKind::kCpu, BackendKind::kCuda}) {
            for (int tp : {1, 2}) {
                const WeightLoadOptions opt{.shard = {.rank = 0, .tp = tp},
                                            .format = WeightFormat::kStored,
                                            .formats_of = kind};
                Result<ModelWeights> w = LoadWeights(**model, backend, opt);
                ASSERT_TRUE(w.ok()) << w.status().ToString();
                Result<int64_t> planned = ResidentWeightBytes(**model, kind, {.shard = opt.shard});
                ASSERT_TRUE(planned.ok()) << planned.status().ToString();
                EXPECT_EQ(*planned, static_cast<int64_t>(w->NumBytes()))
                    << BackendKindName(kind) << " tp " << tp;
            }
        }
        // CUDA keeps Q8_0 products as BF16: more bytes than the CPU's stored form.
        EXPECT_GT(*ResidentWeightBytes(**model, BackendKind::kCuda),
                  *ResidentWeightBytes(**model, BackendKind::kCpu));
    }
}

TEST(ResidentWeights, CudaFormatsLoadedOnTheCpuHoldOnlyTheConvertedForm) {
    const std::string path = testing::DefaultModel();
    KV_REQUIRE_FIXTURE(path, "default model (scripts/test fetches it)");
    Result<std::unique_ptr<ModelFile>> model = OpenModel(path);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    CpuBackend backend(BackendConfig{});
    Result<ModelWeights> stored = LoadWeights(**model, backend);
    ASSERT_TRUE(stored.ok()) << stored.status().ToString();
    Result<ModelWeights> cuda = LoadWeights(
        **model, backend,
        {.shard = {}, .format = WeightFormat::kStored, .formats_of = BackendKind::kCuda});
    ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
    // The default model stores its products as Q4_1 / Q8_0 and ties the classifier.
    const LayerWeights& s0 = stored->layers[0];
    const LayerWeights& c0 = cuda->layers[0];
    ASSERT_NE(s0.qkv.dtype, DType::kBF16);
    ExpectConverted(backend, s0.qkv, c0.qkv, DType::kBF16, "qkv");
    ExpectConverted(backend, s0.wo, c0.wo, DType::kBF16, "wo");
    ExpectConverted(backend, s0.gate_up, c0.gate_up, DType::kBF16, "gate_up");
    ExpectConverted(backend, s0.down, c0.down, DType::kBF16, "down");
    ExpectConverted(backend, s0.attn_norm, c0.attn_norm, DType::kF32, "attn_norm");
    const WeightUse embedding_use = (*model)->spec().tied_embeddings
                                        ? WeightUse::kEmbeddingAndMatMul
                                        : WeightUse::kEmbedding;
    ExpectConverted(backend, stored->embedding, cuda->embedding,
                    ResidentWeightFormat(BackendKind::kCuda, stored->embedding.dtype, embedding_use),
                    "embedding");
    // One form per weight: the arena is the sum of the resident views (64-byte aligned), not the
    // stored bytes beside them.
    size_t resident = 0;
    auto add = [&](const WeightView& w) { resident += (ViewBytes(w) + 63) / 64 * 64; };
    add(cuda->embedding);
    add(cuda->output_norm);
    if (cuda->output.data != nullptr) add(cuda->output);
    for (const LayerWeights& l : cuda->layers) {
        for (const WeightView* w : {&l.attn_norm, &l.qkv, &l.wo, &l.ffn_norm, &l.gate_up, &l.down}) {
            add(*w);
        }
    }
    EXPECT_EQ(cuda->NumBytes(), resident);
    EXPECT_GT(cuda->NumBytes(), stored->NumBytes());  // bf16 rows are wider than 4/8-bit blocks
}

}  // namespace
}  // namespace kvshard
