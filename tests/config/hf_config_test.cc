#include "config/hf_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;

// SmolLM2-135M-Instruct's config.json (the fields kvshard reads, and a few it ignores).
json SmolLm2Config() {
    return json::parse(R"({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
      "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": false,
      "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
      "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 100000,
      "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
      "use_cache": true, "vocab_size": 49152})");
}

Result<ModelSpec> Parse(const json& j) { return ParseHfConfig(j.dump(), "/models/x/config.json"); }

TEST(HfConfigTest, ReadsSmolLm2) {
    auto spec = Parse(SmolLm2Config());
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->architecture, "llama");
    EXPECT_EQ(spec->num_layers, 30);
    EXPECT_EQ(spec->hidden_size, 576);
    EXPECT_EQ(spec->num_heads, 9);
    EXPECT_EQ(spec->num_kv_heads, 3);
    EXPECT_EQ(spec->head_dim, 64);
    EXPECT_EQ(spec->ffn_size, 1536);
    EXPECT_EQ(spec->vocab_size, 49152);
    EXPECT_EQ(spec->max_position, 8192);
    EXPECT_EQ(spec->rope_theta, 100000.0f);
    EXPECT_EQ(spec->rope_scaling.type, RopeScalingType::kNone);
    EXPECT_EQ(spec->norm_eps, 1e-5f);
    EXPECT_TRUE(spec->tied_embeddings);
    EXPECT_EQ(spec->bos_token_id, 1);
    EXPECT_EQ(spec->eos_token_id, 2);
    EXPECT_EQ(spec->qk_layout, QkLayout::kHalfSplit);
}

TEST(HfConfigTest, DefaultsAndAlternatives) {
    json j = SmolLm2Config();
    for (const char* key : {"num_key_value_heads", "rope_theta", "tie_word_embeddings",
                            "rms_norm_eps", "max_position_embeddings", "bos_token_id"}) {
        j.erase(key);
    }
    j.erase("architectures");  // model_type alone is enough
    j["eos_token_id"] = {128001, 128008, 128009};
    j["head_dim"] = nullptr;
    j["vocab_size"] = 128256;
    auto spec = Parse(j);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->num_kv_heads, 9);
    EXPECT_EQ(spec->head_dim, 64);
    EXPECT_EQ(spec->rope_theta, 10000.0f);
    EXPECT_FALSE(spec->tied_embeddings);
    EXPECT_EQ(spec->norm_eps, 1e-6f);
    EXPECT_EQ(spec->max_position, 0);
    EXPECT_EQ(spec->bos_token_id, -1);
    EXPECT_EQ(spec->eos_token_id, 128001);  // the first of a list
    j["head_dim"] = 128;                    // explicit head_dim wins over hidden/heads
    EXPECT_EQ(Parse(j)->head_dim, 128);
}

TEST(HfConfigTest, RopeScaling) {
    json j = SmolLm2Config();
    j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
    auto spec = Parse(j);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->rope_scaling.type, RopeScalingType::kLinear);
    EXPECT_EQ(spec->rope_scaling.factor, 4.0f);

    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 8192}};
    spec = Parse(j);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->rope_scaling.type, RopeScalingType::kLlama3);
    EXPECT_EQ(spec->rope_scaling.factor, 8.0f);
    EXPECT_EQ(spec->rope_scaling.low_freq_factor, 1.0f);
    EXPECT_EQ(spec->rope_scaling.high_freq_factor, 4.0f);
    EXPECT_EQ(spec->rope_scaling.original_max_position, 8192);

    j["rope_scaling"] = {{"rope_type", "default"}};
    EXPECT_EQ(Parse(j)->rope_scaling.type, RopeScalingType::kNone);

    j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
    EXPECT_EQ(Parse(j).status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(Parse(j).status().message().find("yarn"), std::string::npos);
}

TEST(HfConfigTest, BadFieldsNameTheField) {
    struct Case {
        const char* field;  // expected in the message as field '<field>'
        std::function<void(json&)> edit;
    };
    const Case cases[] = {
        {"num_hidden_layers", [](json& j) { j.erase("num_hidden_layers"); }},
        {"hidden_size", [](json& j) { j["hidden_size"] = "576"; }},
        {"hidden_size", [](json& j) { j["hidden_size"] = 576.5; }},
        {"num_attention_heads", [](json& j) { j["num_attention_heads"] = 0; }},
        {"num_key_value_heads", [](json& j) { j["num_key_value_heads"] = -3; }},
        {"intermediate_size", [](json& j) { j.erase("intermediate_size"); }},
        {"vocab_size", [](json& j) { j["vocab_size"] = json::array(); }},
        {"rope_theta", [](json& j) { j["rope_theta"] = "1e5"; }},
        {"rms_norm_eps", [](json& j) { j["rms_norm_eps"] = -1; }},
        {"tie_word_embeddings", [](json& j) { j["tie_word_embeddings"] = 1; }},
        {"eos_token_id", [](json& j) { j["eos_token_id"] = "</s>"; }},
        {"max_position_embeddings", [](json& j) { j["max_position_embeddings"] = -1; }},
        {"rope_scaling", [](json& j) { j["rope_scaling"] = "linear"; }},
        {"rope_scaling.factor",
         [](json& j) {
             j["rope_scaling"] = {{"type", "linear"}};
         }},
        {"rope_scaling.low_freq_factor",
         [](json& j) {
             j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
         }},
        {"architectures", [](json& j) { j["architectures"] = "LlamaForCausalLM"; }},
        {"architectures",
         [](json& j) {
             j.erase("architectures");
             j.erase("model_type");
         }},
        {"hidden_size", [](json& j) { j["hidden_size"] = 577; }},  // not divisible by heads
    };
    for (const Case& c : cases) {
        json j = SmolLm2Config();
        c.edit(j);
        auto spec = Parse(j);
        ASSERT_FALSE(spec.ok()) << c.field;
        EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument) << spec.status().ToString();
        EXPECT_NE(spec.status().message().find("/models/x/config.json: field '" +
                                               std::string(c.field) + "'"),
                  std::string::npos)
            << spec.status().ToString();
    }
}

TEST(HfConfigTest, UnsupportedModelsAreUnimplementedNamingThem) {
    struct Case {
        const char* name;
        std::function<void(json&)> edit;
    };
    const Case cases[] = {
        {"MixtralForCausalLM",
         [](json& j) {
             j.erase("model_type");
             j["architectures"] = {"MixtralForCausalLM"};
         }},
        {"gemma2", [](json& j) { j["model_type"] = "gemma2"; }},
        {"gelu", [](json& j) { j["hidden_act"] = "gelu"; }},
        {"attention_bias", [](json& j) { j["attention_bias"] = true; }},
    };
    for (const Case& c : cases) {
        json j = SmolLm2Config();
        c.edit(j);
        auto spec = Parse(j);
        EXPECT_EQ(spec.status().code(), StatusCode::kUnimplemented) << c.name;
        EXPECT_NE(spec.status().message().find(c.name), std::string::npos)
            << spec.status().ToString();
    }
}

// The config.json fields of google/gemma-3-270m, Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B-Instruct and
// mistralai/Mistral-7B-v0.1 (a few ignored ones left out).
json Gemma3Config() {
    json j = json::parse(R"({
      "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
      "_sliding_window_pattern": 6, "attention_bias": false, "attn_logit_softcapping": null,
      "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": null, "head_dim": 256,
      "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "intermediate_size": 2048,
      "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 18,
      "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
      "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": null,
      "rope_theta": 1000000.0, "sliding_window": 512, "torch_dtype": "bfloat16",
      "use_bidirectional_attention": false, "vocab_size": 262144})");
    for (int l = 0; l < 18; ++l) {
        j["layer_types"].push_back(l % 6 == 5 ? "full_attention" : "sliding_attention");
    }
    return j;
}

json Qwen3Config() {
    return json::parse(R"({
      "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": false,
      "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
      "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28,
      "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
      "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
      "use_sliding_window": false, "vocab_size": 151936})");
}

json Qwen2Config() {
    return json::parse(R"({
      "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
      "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
      "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
      "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
      "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
      "tie_word_embeddings": true, "use_sliding_window": false, "vocab_size": 151936})");
}

json MistralConfig() {
    return json::parse(R"({
      "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1,
      "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
      "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
      "sliding_window": 4096, "tie_word_embeddings": false, "vocab_size": 32000})");
}

TEST(HfConfigTest, ReadsTheNewArchitectures) {
    auto gemma = Parse(Gemma3Config());
    ASSERT_TRUE(gemma.ok()) << gemma.status().ToString();
    EXPECT_EQ(gemma->architecture, "gemma3");
    EXPECT_EQ(gemma->head_dim, 256);
    EXPECT_EQ(gemma->num_kv_heads, 1);
    EXPECT_TRUE(gemma->qk_norm && gemma->post_norms);
    EXPECT_EQ(gemma->activation, Activation::kGeluTanh);
    EXPECT_FLOAT_EQ(gemma->embedding_scale, std::sqrt(640.0f));
    EXPECT_EQ(gemma->sliding_window, 512);
    EXPECT_EQ(gemma->sliding_window_pattern, 6);
    EXPECT_TRUE(gemma->IsWindowed(4));
    EXPECT_FALSE(gemma->IsWindowed(5));
    EXPECT_FLOAT_EQ(gemma->rope_theta, 1e6f);
    EXPECT_FLOAT_EQ(gemma->rope_theta_local, 10000.0f);
    EXPECT_TRUE(gemma->tied_embeddings);  // Gemma3TextConfig's default
    // Without layer_types, the period.
    json period = Gemma3Config();
    period.erase("layer_types");
    period["sliding_window_pattern"] = 6;
    auto by_period = Parse(period);
    ASSERT_TRUE(by_period.ok()) << by_period.status().ToString();
    EXPECT_EQ(by_period->ToString(), gemma->ToString());

    auto qwen3 = Parse(Qwen3Config());
    ASSERT_TRUE(qwen3.ok()) << qwen3.status().ToString();
    EXPECT_EQ(qwen3->architecture, "qwen3");
    EXPECT_TRUE(qwen3->qk_norm);
    EXPECT_FALSE(qwen3->attn_bias);
    EXPECT_EQ(qwen3->head_dim, 128);  // not hidden / heads (64)
    EXPECT_EQ(qwen3->sliding_window, 0);

    auto qwen2 = Parse(Qwen2Config());
    ASSERT_TRUE(qwen2.ok()) << qwen2.status().ToString();
    EXPECT_EQ(qwen2->architecture, "qwen2");
    EXPECT_TRUE(qwen2->attn_bias);
    EXPECT_FALSE(qwen2->qk_norm);
    EXPECT_EQ(qwen2->sliding_window, 0);  // use_sliding_window is false

    auto mistral = Parse(MistralConfig());
    ASSERT_TRUE(mistral.ok()) << mistral.status().ToString();
    EXPECT_EQ(mistral->architecture, "mistral");
    EXPECT_EQ(mistral->sliding_window, 4096);
    EXPECT_EQ(mistral->sliding_window_pattern, 0);
    EXPECT_TRUE(mistral->IsWindowed(31));
    json no_window = MistralConfig();
    no_window["sliding_window"] = nullptr;  // Mistral 7B v0.2 and later
    EXPECT_EQ(Parse(no_window)->sliding_window, 0);

    for (const json& j : {Gemma3Config(), Qwen3Config(), Qwen2Config(), MistralConfig()}) {
        const ModelSpec spec = *Parse(j);
        auto back = Parse(json::parse(HfConfigText(spec, "bfloat16")));
        ASSERT_TRUE(back.ok()) << back.status().ToString();
        EXPECT_EQ(back->ToString(), spec.ToString());
        EXPECT_EQ(back->attn_bias, spec.attn_bias);
        EXPECT_EQ(back->embedding_scale, spec.embedding_scale);
    }
}

TEST(HfConfigTest, NewArchitecturesRefuseWhatKvshardDoesNotRun) {
    struct Case {
        const char* name;  // in the message
        json config;
        StatusCode code = StatusCode::kUnimplemented;
    };
    auto edit = [](json j, const char* key, json value) {
        j[key] = std::move(value);
        return j;
    };
    json irregular = Gemma3Config();
    irregular["layer_types"][0] = "full_attention";
    const Case cases[] = {
        {"final_logit_softcapping", edit(Gemma3Config(), "final_logit_softcapping", 30.0)},
        {"attn_logit_softcapping", edit(Gemma3Config(), "attn_logit_softcapping", 50.0)},
        {"query_pre_attn_scalar", edit(Gemma3Config(), "query_pre_attn_scalar", 168)},
        {"use_bidirectional_attention",
         edit(Gemma3Config(), "use_bidirectional_attention", true)},
        {"hidden_activation", edit(Gemma3Config(), "hidden_activation", "gelu")},
        {"layer_types", irregular},
        {"layer_types", edit(Gemma3Config(), "layer_types", json::array({"full_attention"})),
         StatusCode::kInvalidArgument},
        {"model_type 'gemma3'", edit(Gemma3Config(), "model_type", "gemma3")},
        {"use_sliding_window", edit(Qwen2Config(), "use_sliding_window", true)},
        {"use_sliding_window", edit(Qwen3Config(), "use_sliding_window", true)},
        {"attention_bias", edit(Qwen3Config(), "attention_bias", true)},
        {"architectures", edit(Qwen3Config(), "architectures", json::array({"Qwen2ForCausalLM"})),
         StatusCode::kInvalidArgument},
        {"sliding_window", edit(MistralConfig(), "sliding_window", -1),
         StatusCode::kInvalidArgument},
    };
    for (const Case& c : cases) {
        auto spec = Parse(c.config);
        EXPECT_EQ(spec.status().code(), c.code) << c.name << ": " << spec.status().ToString();
        EXPECT_NE(spec.status().message().find(c.name), std::string::npos)
            << spec.status().ToString();
        EXPECT_NE(spec.status().message().find("/models/x/config.json"), std::string::npos)
            << spec.status().ToString();
    }
}

TEST(HfConfigTest, SpecValidationNamesThePath) {
    json j = SmolLm2Config();
    j["num_key_value_heads"] = 4;  // 9 heads are not a multiple of 4
    auto spec = Parse(j);
    EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(spec.status().message().find("/models/x/config.json"), std::string::npos);
}

TEST(HfConfigTest, InvalidJsonAndMissingFile) {
    EXPECT_EQ(ParseHfConfig("{\"a\": ", "c.json").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(ParseHfConfig("[]", "c.json").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(ReadHfConfig("/nonexistent/config.json").status().code(), StatusCode::kNotFound);
}

TEST(HfConfigTest, ConfigTextRoundTrips) {
    ModelSpec spec = *Parse(SmolLm2Config());
    for (RopeScalingType type :
         {RopeScalingType::kNone, RopeScalingType::kLinear, RopeScalingType::kLlama3}) {
        spec.rope_scaling.type = type;
        spec.rope_scaling.factor = type == RopeScalingType::kNone ? 1.0f : 8.0f;
        spec.norm_eps = 9.999999747378752e-06f;
        testing::TempDir dir;
        testing::WriteFile(dir.File("config.json"), HfConfigText(spec, "bfloat16"));
        auto back = ReadHfConfig(dir.File("config.json"));
        ASSERT_TRUE(back.ok()) << back.status().ToString();
        EXPECT_EQ(back->ToString(), spec.ToString());
        EXPECT_EQ(back->norm_eps, spec.norm_eps);
        EXPECT_EQ(back->max_position, spec.max_position);
        EXPECT_EQ(back->rope_scaling.type, type);
        EXPECT_EQ(back->rope_scaling.factor, spec.rope_scaling.factor);
        EXPECT_EQ(back->rope_scaling.original_max_position,
                  spec.rope_scaling.original_max_position);
    }
    EXPECT_NE(HfConfigText(spec, "float32").find("\"rms_norm_eps\": 1e-05"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
