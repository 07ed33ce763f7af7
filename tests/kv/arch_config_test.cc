// ArchConfig from the published config.json files under tests/kv/configs (the fields the planner
// needs, with the values of the Hugging Face model repositories named in docs/kv.md).
#include "config/arch_config.h"

#include <gtest/gtest.h>

#include "common/build_config.h"

namespace kvshard {
namespace {

std::string Fixture(const std::string& name) {
    return std::string(KVSHARD_SOURCE_DIR) + "/tests/kv/configs/" + name;
}

ArchConfig MustRead(const std::string& name) {
    Result<ArchConfig> c = ReadArchConfig(Fixture(name));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : ArchConfig{};
}

TEST(ArchConfigTest, ReadsPublishedConfigs) {
    struct Case {
        const char* file;
        const char* model_type;
        int64_t layers, hidden, heads, kv_heads, head_dim, vocab;
        bool tied;
        AttentionKind attention;
        int64_t sliding_layers, sliding_window, moe_layers;
    };
    const AttentionKind kMha = AttentionKind::kMultiHead;
    const AttentionKind kMla = AttentionKind::kMultiLatent;
    const Case cases[] = {
        {"llama-3-8b.json", "llama", 32, 4096, 32, 8, 128, 128256, false, kMha, 0, 0, 0},
        {"llama-3-70b.json", "llama", 80, 8192, 64, 8, 128, 128256, false, kMha, 0, 0, 0},
        {"mistral-7b-v0.1.json", "mistral", 32, 4096, 32, 8, 128, 32000, false, kMha, 32, 4096, 0},
        {"qwen2-7b-instruct.json", "qwen2", 28, 3584, 28, 4, 128, 152064, false, kMha, 0, 0, 0},
        {"qwen3-8b.json", "qwen3", 36, 4096, 32, 8, 128, 151936, false, kMha, 0, 0, 0},
        {"qwen3-30b-a3b.json", "qwen3_moe", 48, 2048, 32, 4, 128, 151936, false, kMha, 0, 0, 48},
        {"gemma-2-27b.json", "gemma2", 46, 4608, 32, 16, 128, 256000, true, kMha, 23, 4096, 0},
        // Multimodal file: the text model is under text_config; vocab_size is the default.
        {"gemma-3-27b-it.json", "gemma3_text", 62, 5376, 32, 16, 128, 262208, true, kMha, 52, 1024,
         0},
        {"deepseek-v2.json", "deepseek_v2", 60, 5120, 128, 128, 40, 102400, false, kMla, 0, 0, 59},
        {"deepseek-v3.json", "deepseek_v3", 61, 7168, 128, 128, 56, 129280, false, kMla, 0, 0, 58},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.file);
        ArchConfig a = MustRead(c.file);
        EXPECT_EQ(a.model_type, c.model_type);
        EXPECT_EQ(a.num_layers, c.layers);
        EXPECT_EQ(a.hidden_size, c.hidden);
        EXPECT_EQ(a.num_heads, c.heads);
        EXPECT_EQ(a.num_kv_heads, c.kv_heads);
        EXPECT_EQ(a.head_dim, c.head_dim);
        EXPECT_EQ(a.vocab_size, c.vocab);
        EXPECT_EQ(a.tied_embeddings, c.tied);
        EXPECT_EQ(a.attention, c.attention);
        EXPECT_EQ(a.NumSlidingLayers(), c.sliding_layers);
        EXPECT_EQ(a.sliding_window, c.sliding_window);
        EXPECT_EQ(a.NumMoeLayers(), c.moe_layers);
        EXPECT_EQ(static_cast<int64_t>(a.layer_attention.size()), c.layers);
    }
}

TEST(ArchConfigTest, GemmaWindowPatterns) {
    // Gemma 3: every 6th layer (5, 11, ..., 59) is global.
    ArchConfig g3 = MustRead("gemma-3-27b-it.json");
    for (int64_t i = 0; i < g3.num_layers; ++i) {
        EXPECT_EQ(g3.layer_attention[i] == LayerAttention::kGlobal, (i + 1) % 6 == 0) << i;
    }
    EXPECT_TRUE(g3.qk_norm);
    EXPECT_EQ(g3.norms_per_layer, 4);
    EXPECT_EQ(g3.notes.size(), 1u) << "the vision tower is noted as not counted";
    // Gemma 2: even layers slide.
    ArchConfig g2 = MustRead("gemma-2-27b.json");
    EXPECT_EQ(g2.layer_attention[0], LayerAttention::kSliding);
    EXPECT_EQ(g2.layer_attention[1], LayerAttention::kGlobal);
}

TEST(ArchConfigTest, MlaAndMoeFields) {
    ArchConfig v2 = MustRead("deepseek-v2.json");
    EXPECT_EQ(v2.mla.kv_lora_rank, 512);
    EXPECT_EQ(v2.mla.qk_rope_head_dim, 64);
    EXPECT_EQ(v2.mla.q_lora_rank, 1536);
    EXPECT_EQ(v2.moe.num_routed_experts, 160);
    EXPECT_EQ(v2.moe.shared_intermediate_size, 2 * 1536);
    EXPECT_FALSE(v2.moe_layers[0]) << "first_k_dense_replace 1";
    EXPECT_TRUE(v2.moe_layers[1]);
    ArchConfig v3 = MustRead("deepseek-v3.json");
    EXPECT_TRUE(v3.moe.router_bias);
    EXPECT_EQ(v3.notes.size(), 2u) << "quantization_config and the MTP layer";
}

TEST(ArchConfigTest, LayerTypesAndQwenWindows) {
    const std::string layer_types = R"({"model_type": "qwen3", "num_hidden_layers": 4,
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 100, "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                        "full_attention"]})";
    Result<ArchConfig> a = ParseArchConfig(layer_types, "lt.json");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(a->NumSlidingLayers(), 2);
    EXPECT_EQ(a->sliding_window, 32);

    const std::string qwen_swa = R"({"model_type": "qwen2", "num_hidden_layers": 6,
        "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
        "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 4})";
    a = ParseArchConfig(qwen_swa, "q.json");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    EXPECT_EQ(a->NumSlidingLayers(), 2) << "layers 4 and 5";
    EXPECT_EQ(a->layer_attention[4], LayerAttention::kSliding);
    EXPECT_EQ(a->num_kv_heads, 4) << "defaults to num_attention_heads";
    EXPECT_EQ(a->head_dim, 16) << "hidden / heads";
}

TEST(ArchConfigTest, BadConfigsNameFileFieldAndProblem) {
    const std::string base = R"("model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100)";
    struct Case {
        std::string json;
        StatusCode code;
        std::vector<std::string> want;
    };
    const Case cases[] = {
        {"{" + base + R"(, "num_key_value_heads": 3})",
         StatusCode::kInvalidArgument,
         {"bad.json", "field 'num_key_value_heads'", "3 does not divide"}},
        {R"({"model_type": "llama", "hidden_size": 64})",
         StatusCode::kInvalidArgument,
         {"bad.json", "field 'num_hidden_layers'", "missing"}},
        {"{" + base + R"(, "vocab_size": "lots"})",
         StatusCode::kInvalidArgument,
         {"field 'vocab_size'", "must be an integer"}},
        {"{" + base + R"(, "vocab_size": -5})",
         StatusCode::kInvalidArgument,
         {"field 'vocab_size'", "must be positive, got -5"}},
        {R"({"model_type": "gpt2"})", StatusCode::kUnimplemented, {"bad.json", "'gpt2'"}},
        {R"({"hidden_size": 4})", StatusCode::kInvalidArgument, {"field 'model_type'", "missing"}},
        {R"({"model_type": "gemma3"})",
         StatusCode::kInvalidArgument,
         {"field 'text_config'", "missing"}},
        {R"({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text",
             "num_hidden_layers": 0}})",
         StatusCode::kInvalidArgument,
         {"field 'text_config.num_hidden_layers'", "positive"}},
        {"{" + base + R"(, "layer_types": ["full_attention"]})",
         StatusCode::kInvalidArgument,
         {"field 'layer_types'", "list of 2"}},
        {"{" + base + R"(, "layer_types": ["full_attention", "chunked_attention"]})",
         StatusCode::kUnimplemented,
         {"layer_types", "chunked_attention"}},
        {"{" + base + R"(, "layer_types": ["full_attention", "sliding_attention"]})",
         StatusCode::kInvalidArgument,
         {"field 'sliding_window'", "missing"}},
        {"[1, 2]", StatusCode::kInvalidArgument, {"bad.json", "not a JSON object"}},
        {"{", StatusCode::kInvalidArgument, {"bad.json", "not valid JSON"}},
    };
    for (const Case& c : cases) {
        Result<ArchConfig> a = ParseArchConfig(c.json, "bad.json");
        ASSERT_FALSE(a.ok()) << c.json;
        EXPECT_EQ(a.status().code(), c.code) << a.status().ToString();
        for (const std::string& w : c.want) {
            EXPECT_NE(a.status().message().find(w), std::string::npos)
                << "want '" << w << "' in: " << a.status().message();
        }
        EXPECT_EQ(a.status().message().find('\n'), std::string::npos);
    }
    Result<ArchConfig> missing = ReadArchConfig(Fixture("no-such-config.json"));
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.status().message().find("no-such-config.json"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
