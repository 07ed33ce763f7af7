#include "model/model_file.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/synthetic_gguf.h"
#include "model/tokenizer.h"
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

void ExpectStories260KSpec(const ModelSpec& s) {
    EXPECT_EQ(s.architecture, "llama");
    EXPECT_EQ(s.num_layers, 5);
    EXPECT_EQ(s.hidden_size, 64);
    EXPECT_EQ(s.num_heads, 8);
    EXPECT_EQ(s.num_kv_heads, 4);
    EXPECT_EQ(s.head_dim, 8);
    EXPECT_EQ(s.ffn_size, 172);
    EXPECT_EQ(s.vocab_size, 512);
    EXPECT_EQ(s.rope_theta, 10000.0f);
    EXPECT_EQ(s.rope_scaling.type, RopeScalingType::kNone);
    EXPECT_NEAR(s.norm_eps, 1e-5f, 1e-12f);
    EXPECT_EQ(s.bos_token_id, 1);
    EXPECT_EQ(s.eos_token_id, 2);
    EXPECT_EQ(s.qk_layout, QkLayout::kInterleaved);
}

TEST(ModelFileTest, OpensStories260KBin) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K/stories260K.bin");
    auto m = OpenModel(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const ModelFile& model = **m;
    EXPECT_EQ(model.format(), ModelFormat::kLlama2c);
    EXPECT_EQ(ModelFormatName(model.format()), "llama2c");
    EXPECT_EQ(model.path(), path);
    ExpectStories260KSpec(model.spec());
    EXPECT_EQ(model.spec().max_position, 512);
    EXPECT_TRUE(model.spec().tied_embeddings);  // shared classifier
    EXPECT_EQ(model.tokenizer_data().tokens.size(), 512u);
    EXPECT_NE(model.tokenizer_data().source.find("tok512.bin"), std::string::npos);
    EXPECT_EQ(model.FindTensor("output.weight"), nullptr);
    EXPECT_EQ(model.TensorNames().size(), 1u + 5 * 9 + 1);
    auto q = model.GetTensor("blk.4.attn_k.weight", {32, 64});
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    EXPECT_EQ((*q)->dtype, DType::kF32);
    EXPECT_EQ(model.GetTensor("blk.4.attn_k.weight", {64, 64}).status().code(),
              StatusCode::kInvalidArgument);
    auto missing = model.GetTensor("blk.5.attn_q.weight");
    EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
    EXPECT_NE(missing.status().message().find("blk.5.attn_q.weight"), std::string::npos);
    EXPECT_NE(missing.status().message().find(path), std::string::npos);
}

TEST(ModelFileTest, OpensStories260KGguf) {
    const std::string path = SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(path, "stories260K/stories260K.gguf");
    auto m = OpenModel(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ((*m)->format(), ModelFormat::kGguf);
    ExpectStories260KSpec((*m)->spec());
    EXPECT_EQ((*m)->spec().max_position, 128);  // what the converter wrote (README)
    // llama.cpp's llama2c converter stores the shared classifier as its own output.weight, so
    // the GGUF is structurally untied; the tensor equals token_embd (checked below).
    EXPECT_FALSE((*m)->spec().tied_embeddings);
    EXPECT_EQ((*m)->tokenizer_data().tokens.size(), 512u);
}

TEST(ModelFileTest, Stories260KWeightsAgreeBetweenBinAndGguf) {
    const std::string bin_path = SharedModel("stories260K/stories260K.bin");
    const std::string gguf_path = SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(bin_path, "stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(gguf_path, "stories260K/stories260K.gguf");
    auto bin = OpenModel(bin_path);
    auto gguf = OpenModel(gguf_path);
    ASSERT_TRUE(bin.ok() && gguf.ok());
    for (const ExpectedTensor& e : ExpectedTensors((*bin)->spec())) {
        auto a = (*bin)->GetTensor(e.name, e.shape);
        auto b = (*gguf)->GetTensor(e.name, e.shape);
        ASSERT_TRUE(a.ok() && b.ok()) << e.name;
        EXPECT_EQ((*b)->dtype, DType::kF32) << e.name;
        ASSERT_EQ(Dequantize(**a), Dequantize(**b)) << e.name;
    }
    EXPECT_EQ(Dequantize(*(*gguf)->FindTensor("output.weight")),
              Dequantize(*(*bin)->FindTensor("token_embd.weight")));
    EXPECT_EQ((*bin)->tokenizer_data().tokens, (*gguf)->tokenizer_data().tokens);
}

TEST(ModelFileTest, OpensDefaultModel) {
    const std::string path = testing::DefaultModel();
    KV_REQUIRE_FIXTURE(path, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    auto m = OpenModel(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const ModelSpec& s = (*m)->spec();
    EXPECT_EQ(s.num_layers, 30);
    EXPECT_EQ(s.hidden_size, 576);
    EXPECT_EQ(s.num_heads, 9);
    EXPECT_EQ(s.num_kv_heads, 3);
    EXPECT_EQ(s.head_dim, 64);
    EXPECT_EQ(s.ffn_size, 1536);
    EXPECT_EQ(s.vocab_size, 49152);
    EXPECT_EQ(s.max_position, 8192);
    EXPECT_EQ(s.rope_theta, 100000.0f);
    EXPECT_TRUE(s.tied_embeddings);
    EXPECT_EQ(s.bos_token_id, 1);
    EXPECT_EQ(s.eos_token_id, 2);
    EXPECT_NE(s.chat_template.find("<|im_start|>"), std::string::npos);
    EXPECT_EQ((*m)->tokenizer_data().tokens.size(), 49152u);
    const TensorInfo* emb = (*m)->FindTensor("token_embd.weight");
    ASSERT_NE(emb, nullptr);
    EXPECT_EQ(emb->dtype, DType::kQ8_0);
    EXPECT_EQ(emb->shape, (std::vector<int64_t>{49152, 576}));
    const TensorInfo* q = (*m)->FindTensor("blk.0.attn_q.weight");
    EXPECT_EQ(q->dtype, DType::kQ4_1);
    EXPECT_EQ(q->shape, (std::vector<int64_t>{576, 576}));
    for (const TensorInfo* t : {emb, q, (*m)->FindTensor("blk.29.ffn_down.weight")}) {
        std::vector<float> row(static_cast<size_t>(t->NumCols()));
        DequantizeRows(*t, t->NumRows() - 1, 1, row.data());
        float sum_abs = 0;
        for (float v : row) {
            ASSERT_TRUE(std::isfinite(v)) << t->name;
            sum_abs += std::fabs(v);
        }
        EXPECT_GT(sum_abs, 0) << t->name;
    }
}

ModelSpec TinySpec() {
    ModelSpec s;
    s.num_layers = 2;
    s.hidden_size = 64;
    s.num_heads = 4;
    s.num_kv_heads = 2;
    s.head_dim = 16;
    s.ffn_size = 96;
    s.vocab_size = 40;
    s.max_position = 256;
    s.rope_theta = 500000.0f;
    s.norm_eps = 1e-6f;
    s.tied_embeddings = true;
    s.bos_token_id = 1;
    s.eos_token_id = 2;
    s.chat_template = "{{ messages }}";
    return s;
}

TEST(ModelFileTest, SyntheticGgufRoundTrips) {
    for (DType dtype :
         {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
        for (bool tied : {true, false}) {
            ModelSpec spec = TinySpec();
            spec.tied_embeddings = tied;
            spec.rope_scaling.type = RopeScalingType::kLinear;
            spec.rope_scaling.factor = 2.0f;
            TempDir dir;
            const std::string path = dir.File("tiny.gguf");
            SyntheticGgufOptions options;
            options.weight_dtype = dtype;
            ASSERT_TRUE(SyntheticLlamaGguf(spec, options).WriteFile(path).ok());
            auto m = OpenModel(path);
            ASSERT_TRUE(m.ok()) << m.status().ToString();
            const ModelSpec& s = (*m)->spec();
            EXPECT_EQ(s.ToString(), spec.ToString()) << DTypeName(dtype);
            EXPECT_EQ(s.max_position, 256);
            EXPECT_EQ(s.chat_template, spec.chat_template);
            EXPECT_EQ(s.rope_scaling.type, RopeScalingType::kLinear);
            EXPECT_EQ(s.rope_scaling.factor, 2.0f);
            EXPECT_EQ((*m)->FindTensor("blk.1.attn_q.weight")->dtype, dtype);
            EXPECT_EQ((*m)->FindTensor("blk.1.attn_norm.weight")->dtype, DType::kF32);
            EXPECT_EQ((*m)->FindTensor("output.weight") != nullptr, !tied);
        }
    }
}

// Builds a synthetic GGUF with `edit` applied to a fresh writer's keys/tensors.
struct Variant {
    const char* name;
    StatusCode code;
    const char* in_message;  // must appear in the error
    std::function<GgufWriter()> make;
};

// The synthetic model for `spec` with tensor `name` left out, or stored with `ggml_type` when
// that is not 0, and integer keys replaced by `overrides`.
GgufWriter SyntheticWithTensorChanged(const ModelSpec& spec, const std::string& name,
                                      uint32_t ggml_type = 0,
                                      const std::map<std::string, uint32_t>& overrides = {}) {
    TempDir dir;
    KV_CHECK(SyntheticLlamaGguf(spec).WriteFile(dir.File("src.gguf")).ok());
    auto src = GgufFile::Open(dir.File("src.gguf"));
    KV_CHECK(src.ok());
    GgufWriter w;
    for (const std::string& key : (*src)->keys()) {
        const GgufValue& v = *(*src)->Find(key);
        if (overrides.count(key) != 0) {
            w.AddUInt32(key, overrides.at(key));
            continue;
        }
        if (const auto* i = std::get_if<int64_t>(&v.value))
            w.AddUInt32(key, static_cast<uint32_t>(*i));
        if (const auto* d = std::get_if<double>(&v.value))
            w.AddFloat32(key, static_cast<float>(*d));
        if (const auto* s = std::get_if<std::string>(&v.value)) w.AddString(key, *s);
        if (const auto* a = std::get_if<GgufValue::Array>(&v.value)) {
            if (const auto* strs = std::get_if<std::vector<std::string>>(a))
                w.AddStringArray(key, *strs);
            if (const auto* ds = std::get_if<std::vector<double>>(a)) {
                w.AddFloat32Array(key, std::vector<float>(ds->begin(), ds->end()));
            }
            if (const auto* is = std::get_if<std::vector<int64_t>>(a)) {
                w.AddInt32Array(key, std::vector<int32_t>(is->begin(), is->end()));
            }
        }
    }
    for (const TensorInfo& t : (*src)->tensors()) {
        std::string bytes(reinterpret_cast<const char*>(t.data), t.num_bytes);
        if (t.name != name) {
            w.AddTensor(t.name, t.dtype, t.shape, bytes);
        } else if (ggml_type != 0) {
            w.AddTensorWithGgmlType(t.name, ggml_type, t.shape, bytes);
        }
    }
    return w;
}

TEST(ModelFileTest, BadGgufModelsNameTheProblem) {
    const Variant variants[] = {
        {"other architecture", StatusCode::kUnimplemented, "general.architecture = 'deepseek2'",
         [] {
             GgufWriter w;
             w.AddString("general.architecture", "deepseek2");
             return w;
         }},
        {"multi-head latent attention", StatusCode::kUnimplemented,
         "llama.attention.kv_lora_rank = 512",
         [] {
             GgufWriter w = SyntheticLlamaGguf(TinySpec());
             w.AddUInt32("llama.attention.kv_lora_rank", 512);
             return w;
         }},
        {"final logit soft-capping", StatusCode::kUnimplemented,
         "gemma3.final_logit_softcapping = 30",
         [] {
             GgufWriter w = SyntheticLlamaGguf(SyntheticArchSpec("gemma3"));
             w.AddFloat32("gemma3.final_logit_softcapping", 30.0f);
             return w;
         }},
        {"attention logit soft-capping", StatusCode::kUnimplemented,
         "gemma3.attn_logit_softcapping = 50",
         [] {
             GgufWriter w = SyntheticLlamaGguf(SyntheticArchSpec("gemma3"));
             w.AddFloat32("gemma3.attn_logit_softcapping", 50.0f);
             return w;
         }},
        {"qwen2 without its biases", StatusCode::kNotFound, "blk.1.attn_v.bias",
         [] { return SyntheticWithTensorChanged(SyntheticArchSpec("qwen2"), "blk.1.attn_v.bias"); }},
        {"qwen3 without its k norm", StatusCode::kNotFound, "blk.0.attn_k_norm.weight",
         [] {
             return SyntheticWithTensorChanged(SyntheticArchSpec("qwen3"),
                                               "blk.0.attn_k_norm.weight");
         }},
        {"missing tensor", StatusCode::kNotFound, "blk.1.ffn_up.weight",
         [] { return SyntheticWithTensorChanged(TinySpec(), "blk.1.ffn_up.weight"); }},
        {"unsupported tensor type", StatusCode::kUnimplemented, "blk.0.attn_v.weight",
         [] {
             return SyntheticWithTensorChanged(TinySpec(), "blk.0.attn_v.weight", 16 /* IQ2_XXS */);
         }},
        {"wrong shape", StatusCode::kInvalidArgument, "blk.0.ffn_gate.weight",
         [] {
             ModelSpec spec = TinySpec();
             GgufWriter w = SyntheticWithTensorChanged(spec, "blk.0.ffn_gate.weight");
             w.AddTensorFromFloats("blk.0.ffn_gate.weight", DType::kF32, {64, 96},
                                   std::vector<float>(64 * 96));
             return w;
         }},
        {"mixture of experts", StatusCode::kUnimplemented, "llama.expert_count = 8",
         [] {
             GgufWriter w = SyntheticLlamaGguf(TinySpec());
             w.AddUInt32("llama.expert_count", 8);
             return w;
         }},
        {"invalid spec", StatusCode::kInvalidArgument, "num_kv_heads",
         [] {
             return SyntheticWithTensorChanged(TinySpec(), "", 0,
                                               {{"llama.attention.head_count_kv", 3}});
         }},
        {"unsupported rope scaling", StatusCode::kUnimplemented, "yarn",
         [] {
             GgufWriter w = SyntheticLlamaGguf(TinySpec());
             w.AddString("llama.rope.scaling.type", "yarn");
             return w;
         }},
    };
    for (const Variant& v : variants) {
        TempDir dir;
        const std::string path = dir.File("bad.gguf");
        ASSERT_TRUE(v.make().WriteFile(path).ok());
        auto m = OpenModel(path);
        ASSERT_FALSE(m.ok()) << v.name;
        EXPECT_EQ(m.status().code(), v.code) << v.name << ": " << m.status().ToString();
        EXPECT_NE(m.status().message().find(v.in_message), std::string::npos)
            << v.name << ": " << m.status().ToString();
        EXPECT_NE(m.status().message().find(path), std::string::npos) << v.name;
    }
}

// Llama 3.1-style RoPE scaling reaches GGUF only as the factors tensor rope_freqs.weight.
TEST(ModelFileTest, GgufRopeFreqsOfLlama3Scaling) {
    ModelSpec spec = TinySpec();
    const double factor = 8, low = 1, high = 4, original = 8192;
    std::vector<float> factors;
    for (int64_t i = 0; i < spec.head_dim / 2; ++i) {
        const double wavelen = 2 * M_PI * std::pow(spec.rope_theta, 2.0 * i / spec.head_dim);
        if (wavelen < original / high) {
            factors.push_back(1.0f);
        } else if (wavelen > original / low) {
            factors.push_back(static_cast<float>(factor));
        } else {
            const double smooth = (original / wavelen - low) / (high - low);
            factors.push_back(static_cast<float>(1 / ((1 - smooth) / factor + smooth)));
        }
    }
    ASSERT_EQ(factors.front(), 1.0f);
    ASSERT_EQ(factors.back(), 8.0f);
    TempDir dir;
    GgufWriter w = SyntheticLlamaGguf(spec);
    w.AddTensorFromFloats("rope_freqs.weight", DType::kF32, {spec.head_dim / 2}, factors);
    ASSERT_TRUE(w.WriteFile(dir.File("llama3.gguf")).ok());
    auto m = OpenModel(dir.File("llama3.gguf"));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    const RopeScaling& rs = (*m)->spec().rope_scaling;
    EXPECT_EQ(rs.type, RopeScalingType::kLlama3);
    EXPECT_EQ(rs.factor, 8.0f);
    EXPECT_EQ(rs.low_freq_factor, 1.0f);
    EXPECT_EQ(rs.high_freq_factor, 4.0f);
    EXPECT_EQ(rs.original_max_position, 8192);

    GgufWriter other = SyntheticLlamaGguf(spec);
    other.AddTensorFromFloats("rope_freqs.weight", DType::kF32, {spec.head_dim / 2},
                              std::vector<float>(spec.head_dim / 2, 2.0f));
    ASSERT_TRUE(other.WriteFile(dir.File("other.gguf")).ok());
    auto bad = OpenModel(dir.File("other.gguf"));
    EXPECT_EQ(bad.status().code(), StatusCode::kUnimplemented) << bad.status().ToString();
    EXPECT_NE(bad.status().message().find("rope_freqs.weight"), std::string::npos);
}

TEST(ModelFileTest, ATokenizerSharesTheModelFilesTokenizerData) {
    TempDir dir;
    const std::string path = dir.File("tiny.gguf");
    ASSERT_TRUE(SyntheticLlamaGguf(TinySpec()).WriteFile(path).ok());
    auto m = OpenModel(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    auto shared = Tokenizer::Create((*m)->shared_tokenizer_data());
    ASSERT_TRUE(shared.ok()) << shared.status().ToString();
    // One copy of the vocabulary in the process: the tokenizer reads the file's.
    EXPECT_EQ(&(*shared)->data(), &(*m)->tokenizer_data());
    // A tokenizer made from a copy owns it, and encodes alike.
    auto copied = Tokenizer::Create((*m)->tokenizer_data());
    ASSERT_TRUE(copied.ok()) << copied.status().ToString();
    EXPECT_NE(&(*copied)->data(), &(*m)->tokenizer_data());
    EXPECT_EQ((*copied)->data().tokens, (*shared)->data().tokens);
    const std::string text = (*m)->tokenizer_data().tokens.back();
    EXPECT_EQ((*shared)->Encode(text, {}), (*copied)->Encode(text, {}));
    // The tokenizer keeps the data alive after the file is closed.
    const std::vector<std::string> tokens = (*m)->tokenizer_data().tokens;
    m->reset();
    EXPECT_EQ((*shared)->data().tokens, tokens);
}

TEST(ModelFileTest, TokenizerVocabularyMustMatch) {
    TempDir dir;
    const std::string path = dir.File("short_vocab.gguf");
    SyntheticGgufOptions options;
    options.num_tokens = 39;
    ASSERT_TRUE(SyntheticLlamaGguf(TinySpec(), options).WriteFile(path).ok());
    auto m = OpenModel(path);
    ASSERT_EQ(m.status().code(), StatusCode::kInvalidArgument) << m.status().ToString();
    EXPECT_NE(
        m.status().message().find(path + ": vocabulary has 39 tokens, model " + path + " has 40"),
        std::string::npos)
        << m.status().ToString();
}

TEST(ModelFileTest, Llama2cTokenizerLookup) {
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    const std::string tok = SharedModel("stories260K/tok512.bin");
    KV_REQUIRE_FIXTURE(bin, "stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(tok, "stories260K/tok512.bin");
    TempDir dir;
    const std::string model = dir.File("model.bin");
    std::filesystem::copy_file(bin, model);
    // No tokenizer beside it: NotFound naming the checkpoint.
    auto none = OpenModel(model);
    EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
    EXPECT_NE(none.status().message().find(model), std::string::npos);
    // Explicit path.
    OpenModelOptions options;
    options.tokenizer_path = tok;
    EXPECT_TRUE(OpenModel(model, options).ok());
    // tok*.bin beside, first by name; tokenizer.bin wins over it.
    std::filesystem::copy_file(tok, dir.File("tok_b.bin"));
    testing::WriteFile(dir.File("tok_a.bin"), "junk");
    auto found = OpenModel(model);
    EXPECT_FALSE(found.ok());
    EXPECT_NE(found.status().message().find("tok_a.bin"), std::string::npos)
        << found.status().ToString();
    std::filesystem::copy_file(tok, dir.File("tokenizer.bin"));
    auto preferred = OpenModel(model);
    ASSERT_TRUE(preferred.ok()) << preferred.status().ToString();
    EXPECT_NE((*preferred)->tokenizer_data().source.find("tokenizer.bin"), std::string::npos);
}

TEST(ModelFileTest, Llama2cVersionedCheckpointIsUnimplemented) {
    TempDir dir;
    std::string bytes(256, '\0');
    const uint32_t magic = 0x616b3432;
    const int32_t version = 2;
    std::memcpy(bytes.data(), &magic, 4);
    std::memcpy(bytes.data() + 4, &version, 4);
    testing::WriteFile(dir.File("v2.bin"), bytes);
    auto m = OpenModel(dir.File("v2.bin"));
    EXPECT_EQ(m.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(m.status().message().find("version 2"), std::string::npos);
}

// A file that is no format kvshard reads is named as such (not as a llama2.c header error); a
// llama2.c checkpoint is still found under any name, and a truncated GGUF or .bin keeps its own
// error.
TEST(ModelFileTest, AFileOfNoFormatIsNotAModelFile) {
    TempDir dir;
    const std::string kNotAModel =
        ": not a model file (expected GGUF, a llama2.c .bin checkpoint or a Hugging Face folder)";
    for (const auto& [name, bytes] :
         {std::pair<std::string, std::string>{"README.md",
                                              "# kvshard\n\nA tensor-parallel LLM "
                                              "serving cluster.\n"},
          {"empty", ""},
          {"short.txt", "abc"}}) {
        testing::WriteFile(dir.File(name), bytes);
        auto m = OpenModel(dir.File(name));
        ASSERT_FALSE(m.ok()) << name;
        EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument) << name;
        EXPECT_EQ(m.status().message(), dir.File(name) + kNotAModel);
    }
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    const std::string tok = SharedModel("stories260K/tok512.bin");
    const std::string gguf = SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(bin, "stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(tok, "stories260K/tok512.bin");
    KV_REQUIRE_FIXTURE(gguf, "stories260K/stories260K.gguf");
    const std::string checkpoint = testing::ReadFile(bin);
    testing::WriteFile(dir.File("checkpoint"), checkpoint);
    OpenModelOptions options;
    options.tokenizer_path = tok;
    auto renamed = OpenModel(dir.File("checkpoint"), options);
    ASSERT_TRUE(renamed.ok()) << renamed.status().ToString();
    EXPECT_EQ((*renamed)->format(), ModelFormat::kLlama2c);
    testing::WriteFile(dir.File("cut.bin"), checkpoint.substr(0, checkpoint.size() / 2));
    auto cut = OpenModel(dir.File("cut.bin"), options);
    ASSERT_FALSE(cut.ok());
    EXPECT_NE(cut.status().message().find("a llama2.c checkpoint with this header has"),
              std::string::npos)
        << cut.status().message();
    const std::string g = testing::ReadFile(gguf);
    testing::WriteFile(dir.File("cut"), g.substr(0, g.size() / 2));
    auto cut_gguf = OpenModel(dir.File("cut"));
    ASSERT_FALSE(cut_gguf.ok());
    EXPECT_EQ(cut_gguf.status().message().find("not a model file"), std::string::npos)
        << cut_gguf.status().message();
}

TEST(ModelFileTest, MissingPathIsNotFound) {
    auto m = OpenModel("/nonexistent/model.gguf");
    EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
    EXPECT_NE(m.status().message().find("/nonexistent/model.gguf"), std::string::npos);
}

TEST(ModelFileTest, LayerTensorNames) {
    EXPECT_EQ(LayerTensorName(3, "attn_q"), "blk.3.attn_q.weight");
    ModelSpec spec = TinySpec();
    auto expected = ExpectedTensors(spec);
    ASSERT_EQ(expected.size(), 1u + 2 * 9 + 1);
    EXPECT_EQ(expected.front().name, "token_embd.weight");
    EXPECT_EQ(expected[2].name, "blk.0.attn_q.weight");
    EXPECT_EQ(expected[2].shape, (std::vector<int64_t>{64, 64}));
    EXPECT_EQ(expected[3].shape, (std::vector<int64_t>{32, 64}));
    EXPECT_EQ(expected[9].shape, (std::vector<int64_t>{64, 96}));
    spec.tied_embeddings = false;
    EXPECT_EQ(ExpectedTensors(spec).back().name, "output.weight");
    EXPECT_EQ(ModelFormatName(ModelFormat::kHuggingFace), "huggingface");
    EXPECT_EQ(ModelFormatName(ModelFormat::kGguf), "gguf");
}

}  // namespace
}  // namespace kvshard
