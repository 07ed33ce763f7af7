#include "model/hf_export.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "model/hf_names.h"
#include "model/model_file.h"
#include "model/synthetic_gguf.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::SharedModel;
using testing::TempDir;

std::vector<float> Dequantize(const TensorInfo& t) {
    std::vector<float> out(static_cast<size_t>(t.NumElements()));
    DequantizeRows(t, 0, t.NumRows(), out.data());
    return out;
}

TEST(HfExportTest, PermutationMovesPairsToHalves) {
    // Two heads of head_dim 4, one column: interleaved rows (x0 y0 x1 y1) -> (x0 x1 y0 y1).
    const std::vector<float> in = {0, 1, 2, 3, 4, 5, 6, 7};
    std::vector<float> out(8);
    InterleavedToHalfSplit(in.data(), 2, 4, 1, out.data());
    EXPECT_EQ(out, (std::vector<float>{0, 2, 1, 3, 4, 6, 5, 7}));
    // With two columns each row moves whole.
    const std::vector<float> in2 = {0, 10, 1, 11, 2, 12, 3, 13};
    std::vector<float> out2(8);
    InterleavedToHalfSplit(in2.data(), 1, 4, 2, out2.data());
    EXPECT_EQ(out2, (std::vector<float>{0, 10, 2, 12, 1, 11, 3, 13}));
}

TEST(HfExportTest, HfNamesMapBothWays) {
    const std::pair<const char*, const char*> names[] = {
        {"model.embed_tokens.weight", "token_embd.weight"},
        {"model.norm.weight", "output_norm.weight"},
        {"lm_head.weight", "output.weight"},
        {"model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"},
        {"model.layers.12.self_attn.q_proj.weight", "blk.12.attn_q.weight"},
        {"model.layers.3.self_attn.k_proj.weight", "blk.3.attn_k.weight"},
        {"model.layers.3.self_attn.v_proj.weight", "blk.3.attn_v.weight"},
        {"model.layers.3.self_attn.o_proj.weight", "blk.3.attn_output.weight"},
        {"model.layers.3.post_attention_layernorm.weight", "blk.3.ffn_norm.weight"},
        {"model.layers.3.mlp.gate_proj.weight", "blk.3.ffn_gate.weight"},
        {"model.layers.3.mlp.up_proj.weight", "blk.3.ffn_up.weight"},
        {"model.layers.3.mlp.down_proj.weight", "blk.3.ffn_down.weight"},
    };
    for (const auto& [hf, canonical] : names) {
        EXPECT_EQ(CanonicalNameFromHf(hf), canonical);
        EXPECT_EQ(HfNameFromCanonical(canonical), hf);
    }
    for (const char* other :
         {"model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.x.mlp.up_proj.weight",
          "model.layers..mlp.up_proj.weight", "foo"}) {
        EXPECT_FALSE(CanonicalNameFromHf(other).has_value()) << other;
    }
}

// Checks that `hf` (an exported folder, opened) holds `src`'s model: same spec but the Q/K
// layout, the same weights with Q/K rows permuted, within `tolerance` relative error.
void ExpectSameModel(const ModelFile& src, const ModelFile& hf, float tolerance) {
    EXPECT_EQ(hf.format(), ModelFormat::kHuggingFace);
    ModelSpec expected = src.spec();
    expected.qk_layout = QkLayout::kHalfSplit;
    const ModelSpec& got = hf.spec();
    EXPECT_EQ(got.ToString(), expected.ToString());
    EXPECT_EQ(got.qk_layout, QkLayout::kHalfSplit);
    EXPECT_EQ(got.max_position, expected.max_position);
    EXPECT_EQ(got.norm_eps, expected.norm_eps);
    EXPECT_EQ(got.rope_scaling.type, expected.rope_scaling.type);
    EXPECT_EQ(got.rope_scaling.factor, expected.rope_scaling.factor);
    EXPECT_EQ(got.chat_template, expected.chat_template);
    EXPECT_EQ(hf.tokenizer_data().tokens, src.tokenizer_data().tokens);
    for (const ExpectedTensor& e : ExpectedTensors(src.spec())) {
        const TensorInfo* a = src.FindTensor(e.name);
        const TensorInfo* b = hf.FindTensor(e.name);
        ASSERT_TRUE(a != nullptr && b != nullptr) << e.name;
        ASSERT_EQ(b->shape, e.shape) << e.name;
        std::vector<float> want = Dequantize(*a);
        const bool is_q = e.name.find("attn_q") != std::string::npos;
        const bool is_k = e.name.find("attn_k") != std::string::npos;
        if (is_q || is_k) {
            std::vector<float> permuted(want.size());
            InterleavedToHalfSplit(want.data(),
                                   is_q ? src.spec().num_heads : src.spec().num_kv_heads,
                                   src.spec().head_dim, a->NumCols(), permuted.data());
            want.swap(permuted);
        }
        const std::vector<float> got_values = Dequantize(*b);
        if (tolerance == 0) {
            ASSERT_EQ(got_values, want) << e.name;
        } else {
            for (size_t i = 0; i < want.size(); ++i) {
                // Plus F16's subnormal step, for the smallest weights.
                ASSERT_NEAR(got_values[i], want[i], tolerance * std::fabs(want[i]) + 6e-8f)
                    << e.name << " element " << i;
            }
        }
    }
}

TEST(HfExportTest, Stories260KRoundTripsInF32) {
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(bin, "stories260K/stories260K.bin");
    auto src = OpenModel(bin);
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    TempDir dir;
    const std::string out = dir.File("hf");
    ASSERT_TRUE(ExportHuggingFace(**src, out).ok());
    for (const char* file : {"config.json", "model.safetensors", "tokenizer.json",
                             "tokenizer_config.json", "generation_config.json"}) {
        EXPECT_TRUE(std::filesystem::exists(out + "/" + file)) << file;
    }
    const auto config = nlohmann::json::parse(testing::ReadFile(out + "/config.json"));
    EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");
    EXPECT_EQ(config["tie_word_embeddings"], true);
    EXPECT_EQ(config["torch_dtype"], "float32");
    auto hf = OpenModel(out);
    ASSERT_TRUE(hf.ok()) << hf.status().ToString();
    ExpectSameModel(**src, **hf, 0);
    EXPECT_EQ((*hf)->FindTensor("output.weight"), nullptr);

    // A file inside the folder stands for the folder.
    for (const char* file : {"config.json", "model.safetensors"}) {
        auto again = OpenModel(out + "/" + file);
        ASSERT_TRUE(again.ok()) << file << ": " << again.status().ToString();
        EXPECT_EQ((*again)->format(), ModelFormat::kHuggingFace);
    }

    // Exporting the (half-split) HF model again copies its rows unpermuted.
    ASSERT_TRUE(ExportHuggingFace(**hf, dir.File("hf2")).ok());
    auto hf2 = OpenModel(dir.File("hf2"));
    ASSERT_TRUE(hf2.ok()) << hf2.status().ToString();
    for (const ExpectedTensor& e : ExpectedTensors((*hf)->spec())) {
        ASSERT_EQ(Dequantize(*(*hf2)->FindTensor(e.name)), Dequantize(*(*hf)->FindTensor(e.name)))
            << e.name;
    }
}

TEST(HfExportTest, IncompleteFoldersAreNotFound) {
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(bin, "stories260K/stories260K.bin");
    auto src = OpenModel(bin);
    ASSERT_TRUE(src.ok());
    for (const char* missing : {"config.json", "model.safetensors", "tokenizer.json"}) {
        TempDir dir;
        ASSERT_TRUE(ExportHuggingFace(**src, dir.path()).ok());
        std::filesystem::remove(dir.File(missing));
        auto m = OpenModel(dir.path());
        EXPECT_EQ(m.status().code(), StatusCode::kNotFound) << missing;
        EXPECT_NE(m.status().message().find(dir.path()), std::string::npos) << missing;
    }
}

TEST(HfExportTest, ShardedAndReducedPrecision) {
    const std::string gguf = SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(gguf, "stories260K/stories260K.gguf");
    auto src = OpenModel(gguf);
    ASSERT_TRUE(src.ok()) << src.status().ToString();
    struct Case {
        DType dtype;
        float tolerance;
    };
    for (const Case& c :
         {Case{DType::kF32, 0}, Case{DType::kBF16, 1.0f / 256}, Case{DType::kF16, 1.0f / 1024}}) {
        TempDir dir;
        HfExportOptions options;
        options.dtype = c.dtype;
        options.max_shard_bytes = 100 * 1000;
        ASSERT_TRUE(ExportHuggingFace(**src, dir.path(), options).ok());
        EXPECT_FALSE(std::filesystem::exists(dir.File("model.safetensors")));
        const auto index =
            nlohmann::json::parse(testing::ReadFile(dir.File("model.safetensors.index.json")));
        std::set<std::string> shards;
        for (const auto& [name, file] : index["weight_map"].items()) shards.insert(file);
        EXPECT_GT(shards.size(), 2u);
        char first[64], last[64];
        std::snprintf(first, sizeof(first), "model-00001-of-%05zu.safetensors", shards.size());
        std::snprintf(last, sizeof(last), "model-%05zu-of-%05zu.safetensors", shards.size(),
                      shards.size());
        EXPECT_TRUE(shards.count(first)) << first;
        EXPECT_TRUE(shards.count(last)) << last;
        for (const std::string& shard : shards) {
            // Every shard holds at most max_shard_bytes of data, or a single larger tensor.
            EXPECT_LE(std::filesystem::file_size(dir.File(shard)), 2 * 140000u) << shard;
        }
        auto hf = OpenModel(dir.path());
        ASSERT_TRUE(hf.ok()) << hf.status().ToString();
        ExpectSameModel(**src, **hf, c.tolerance);
        EXPECT_FALSE((*hf)->spec().tied_embeddings);  // the GGUF has its own output.weight
    }
}

TEST(HfExportTest, QuantizedGgufExportsItsDequantizedValues) {
    ModelSpec spec;
    spec.num_layers = 2;
    spec.hidden_size = 64;
    spec.num_heads = 4;
    spec.num_kv_heads = 2;
    spec.head_dim = 16;
    spec.ffn_size = 96;
    spec.vocab_size = 300;
    spec.max_position = 128;
    spec.rope_theta = 100000.0f;
    spec.bos_token_id = 1;
    spec.eos_token_id = 2;
    spec.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}";
    for (DType dtype : {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
        TempDir dir;
        SyntheticGgufOptions options;
        options.weight_dtype = dtype;
        ASSERT_TRUE(SyntheticLlamaGguf(spec, options).WriteFile(dir.File("m.gguf")).ok());
        auto src = OpenModel(dir.File("m.gguf"));
        ASSERT_TRUE(src.ok()) << src.status().ToString();
        ASSERT_TRUE(ExportHuggingFace(**src, dir.File("hf")).ok());
        auto hf = OpenModel(dir.File("hf"));
        ASSERT_TRUE(hf.ok()) << hf.status().ToString();
        ExpectSameModel(**src, **hf, 0);
    }
}

TEST(HfExportTest, RejectsQuantizedOutputType) {
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(bin, "stories260K/stories260K.bin");
    auto src = OpenModel(bin);
    ASSERT_TRUE(src.ok());
    TempDir dir;
    HfExportOptions options;
    options.dtype = DType::kQ8_0;
    EXPECT_EQ(ExportHuggingFace(**src, dir.path(), options).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvshard
