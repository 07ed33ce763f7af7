// TokenizerData readers: GGUF metadata, Hugging Face tokenizer.json (+ tokenizer_config.json),
// and the tokenizer.json writer's round trip.
#include "model/tokenizer_data.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/tokenizer.h"
#include "tests/model/tokenizer_test_util.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::SharedModel;
using testing::TempDir;
using testing::WriteFile;

Result<TokenizerData> FromGgufBytes(const TempDir& dir, const GgufWriter& w) {
    const std::string path = dir.File("t.gguf");
    WriteFile(path, w.Serialize());
    KV_ASSIGN_OR_RETURN(auto gguf, GgufFile::Open(path));
    return TokenizerDataFromGguf(*gguf);
}

GgufWriter MinimalGguf(const char* model) {
    GgufWriter w;
    w.AddString("general.architecture", "llama");
    w.AddString("tokenizer.ggml.model", model);
    w.AddStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "▁a"});
    return w;
}

TEST(TokenizerDataFromGguf, SentencePieceDefaults) {
    TempDir dir;
    auto d = FromGgufBytes(dir, MinimalGguf("llama"));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->kind, TokenizerKind::kSentencePiece);
    EXPECT_TRUE(d->add_bos);
    EXPECT_TRUE(d->add_space_prefix);
    EXPECT_EQ(d->bos_id, 1);
    EXPECT_EQ(d->eos_id, 2);
    EXPECT_EQ(d->unk_id, 0);
    EXPECT_EQ(d->pad_id, -1);
    EXPECT_EQ(d->source, dir.File("t.gguf"));
}

TEST(TokenizerDataFromGguf, ReadsEveryKey) {
    TempDir dir;
    GgufWriter w = MinimalGguf("gpt2");
    w.AddStringArray("tokenizer.ggml.merges", {"▁ a"});
    w.AddString("tokenizer.ggml.pre", "smollm");
    w.AddInt32Array("tokenizer.ggml.token_type", {2, 3, 3, 1});
    w.AddUInt32("tokenizer.ggml.bos_token_id", 1);
    w.AddUInt32("tokenizer.ggml.eos_token_id", 2);
    w.AddUInt32("tokenizer.ggml.unknown_token_id", 0);
    w.AddUInt32("tokenizer.ggml.padding_token_id", 0xFFFFFFFFu);  // llama.cpp's "none"
    w.AddBool("tokenizer.ggml.add_bos_token", true);
    w.AddString("tokenizer.chat_template", "{{ x }}");
    auto d = FromGgufBytes(dir, w);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->kind, TokenizerKind::kByteLevelBpe);
    EXPECT_EQ(d->tokens.size(), 4u);
    EXPECT_EQ(d->merges, (std::vector<std::string>{"▁ a"}));
    EXPECT_EQ(d->pre, "smollm");
    EXPECT_EQ(d->types, (std::vector<TokenType>{TokenType::kUnknown, TokenType::kControl,
                                                TokenType::kControl, TokenType::kNormal}));
    EXPECT_EQ(d->pad_id, -1);
    EXPECT_TRUE(d->add_bos);
    EXPECT_FALSE(d->add_space_prefix);
    EXPECT_EQ(d->chat_template, "{{ x }}");
}

TEST(TokenizerDataFromGguf, ErrorsNameTheFileAndKey) {
    TempDir dir;
    const std::string file = dir.File("t.gguf");
    struct Case {
        GgufWriter writer;
        StatusCode code;
        const char* mention;
    };
    GgufWriter no_model;
    no_model.AddString("general.architecture", "llama");
    GgufWriter no_tokens;
    no_tokens.AddString("tokenizer.ggml.model", "llama");
    GgufWriter bad_scores = MinimalGguf("llama");
    bad_scores.AddFloat32Array("tokenizer.ggml.scores", {0, 0});
    GgufWriter bad_types = MinimalGguf("llama");
    bad_types.AddInt32Array("tokenizer.ggml.token_type", {1, 1, 1, 42});
    GgufWriter wrong_type = MinimalGguf("llama");
    wrong_type.AddString("tokenizer.ggml.bos_token_id", "one");
    Case cases[] = {
        {MinimalGguf("bert"), StatusCode::kUnimplemented, "bert"},
        {MinimalGguf("gpt2"), StatusCode::kNotFound, "tokenizer.ggml.merges"},
        {no_model, StatusCode::kNotFound, "tokenizer.ggml.model"},
        {no_tokens, StatusCode::kNotFound, "tokenizer.ggml.tokens"},
        {bad_scores, StatusCode::kInvalidArgument, "tokenizer.ggml.scores"},
        {bad_types, StatusCode::kInvalidArgument, "tokenizer.ggml.token_type"},
        {wrong_type, StatusCode::kInvalidArgument, "tokenizer.ggml.bos_token_id"},
    };
    for (const Case& c : cases) {
        auto d = FromGgufBytes(dir, c.writer);
        ASSERT_FALSE(d.ok()) << c.mention;
        EXPECT_EQ(d.status().code(), c.code) << d.status().ToString();
        EXPECT_NE(d.status().message().find(file), std::string::npos) << d.status().ToString();
        EXPECT_NE(d.status().message().find(c.mention), std::string::npos) << d.status().ToString();
    }
}

TEST(TokenizerDataFromGguf, SmolLM2) {
    const std::string path = testing::DefaultModel();
    KV_REQUIRE_FIXTURE(path, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    auto gguf = GgufFile::Open(path);
    ASSERT_TRUE(gguf.ok()) << gguf.status().ToString();
    auto d = TokenizerDataFromGguf(**gguf);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->kind, TokenizerKind::kByteLevelBpe);
    EXPECT_EQ(d->tokens.size(), 49152u);
    EXPECT_EQ(d->pre, "smollm");
    EXPECT_EQ(d->bos_id, 1);
    EXPECT_EQ(d->eos_id, 2);
    EXPECT_EQ(d->pad_id, 2);
    EXPECT_FALSE(d->add_bos);
    EXPECT_FALSE(d->add_space_prefix);
    EXPECT_NE(d->chat_template.find("<|im_start|>"), std::string::npos);
}

// Everything but `source`.
void ExpectSameData(const TokenizerData& a, const TokenizerData& b) {
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.scores, b.scores);
    EXPECT_EQ(a.types, b.types);
    EXPECT_EQ(a.merges, b.merges);
    EXPECT_EQ(a.pre, b.pre);
    EXPECT_EQ(a.bos_id, b.bos_id);
    EXPECT_EQ(a.eos_id, b.eos_id);
    EXPECT_EQ(a.unk_id, b.unk_id);
    EXPECT_EQ(a.pad_id, b.pad_id);
    EXPECT_EQ(a.add_bos, b.add_bos);
    EXPECT_EQ(a.add_space_prefix, b.add_space_prefix);
    EXPECT_EQ(a.chat_template, b.chat_template);
}

Result<TokenizerData> WriteAndRead(const TempDir& dir, const TokenizerData& d) {
    WriteFile(dir.File("tokenizer.json"), TokenizerJsonText(d));
    WriteFile(dir.File("tokenizer_config.json"), TokenizerConfigJsonText(d));
    return ReadTokenizerJson(dir.File("tokenizer.json"));
}

class TokenizerJsonRoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerJsonRoundTrip, ByteLevelDataComesBackIdentical) {
    const std::string path =
        GetParam() == "smollm2" ? testing::DefaultModel() : SharedModel(GetParam());
    KV_REQUIRE_FIXTURE(path, GetParam());
    auto gguf = GgufFile::Open(path);
    ASSERT_TRUE(gguf.ok()) << gguf.status().ToString();
    auto original = TokenizerDataFromGguf(**gguf);
    ASSERT_TRUE(original.ok()) << original.status().ToString();
    TempDir dir;
    auto back = WriteAndRead(dir, *original);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    ExpectSameData(*original, *back);
    EXPECT_EQ(back->source, dir.File("tokenizer.json"));
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, TokenizerJsonRoundTrip,
                         ::testing::Values("tokenizer-tests/ggml-vocab-gpt-2.gguf", "smollm2"),
                         [](const auto& info) {
                             return info.param == "smollm2" ? std::string("SmolLM2")
                                                            : std::string("Gpt2");
                         });

TEST(TokenizerJson, SentencePieceRoundTripEncodesTheSame) {
    const std::string path = SharedModel("tokenizer-tests/ggml-vocab-llama-spm.gguf");
    KV_REQUIRE_FIXTURE(path, "tokenizer-tests/ggml-vocab-llama-spm.gguf");
    auto original = testing::GgufTokenizer(path);
    ASSERT_NE(original, nullptr);
    TempDir dir;
    auto back = WriteAndRead(dir, original->data());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->kind, TokenizerKind::kSentencePiece);
    EXPECT_EQ(back->tokens, original->data().tokens);
    EXPECT_EQ(back->types, original->data().types);
    EXPECT_TRUE(back->add_space_prefix);
    EXPECT_TRUE(back->add_bos);
    EXPECT_EQ(back->bos_id, 1);
    EXPECT_EQ(back->unk_id, 0);
    auto tok = testing::CreateOrFail(*back);
    const std::string inputs = testing::ReadFile(path + ".inp");
    size_t start = 0, checked = 0;
    for (size_t sep; (sep = inputs.find("\n__ggml_vocab_test__\n", start)) != std::string::npos;) {
        const std::string text = inputs.substr(start, sep - start);
        EXPECT_EQ(tok->Encode(text, {}), original->Encode(text, {})) << text;
        start = sep + 21;
        ++checked;
    }
    EXPECT_GT(checked, 30u);
}

// A hand-written Hugging Face file in the newer style: merges as pairs, special flags, a config
// with {content} tokens and named chat templates.
TEST(TokenizerJson, ReadsHuggingFaceVariants) {
    TempDir dir;
    WriteFile(dir.File("tokenizer.json"), R"({
      "added_tokens": [
        {"id": 5, "content": "<|begin|>", "special": true},
        {"id": 6, "content": "<tool>", "special": false}
      ],
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated"},
        {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
      "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]},
      "decoder": {"type": "ByteLevel"},
      "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3},
                "merges": [["a", "b"]]}
    })");
    WriteFile(dir.File("tokenizer_config.json"), R"({
      "eos_token": {"content": "<|begin|>", "lstrip": false},
      "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    })");
    auto d = ReadTokenizerJson(dir.File("tokenizer.json"));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->kind, TokenizerKind::kByteLevelBpe);
    EXPECT_EQ(d->pre, "llama-bpe");
    EXPECT_EQ(d->tokens,
              (std::vector<std::string>{"a", "b", "ab", "Ġ", "[PAD4]", "<|begin|>", "<tool>"}));
    EXPECT_EQ(d->types[4], TokenType::kUnused);
    EXPECT_EQ(d->types[5], TokenType::kControl);
    EXPECT_EQ(d->types[6], TokenType::kUserDefined);
    EXPECT_EQ(d->merges, (std::vector<std::string>{"a b"}));
    EXPECT_TRUE(d->add_bos);  // from the post-processor template
    EXPECT_EQ(d->bos_id, 5);
    EXPECT_EQ(d->eos_id, 5);
    EXPECT_EQ(d->chat_template, "D");
    auto tok = testing::CreateOrFail(*d);
    EXPECT_EQ(tok->Encode("ab<tool>", testing::WithBos()), (std::vector<int32_t>{5, 2, 6}));
}

TEST(TokenizerJson, SentencePieceStyleWithMetaspace) {
    TempDir dir;
    WriteFile(dir.File("tokenizer.json"), R"({
      "added_tokens": [{"id": 0, "content": "<unk>", "special": true},
                       {"id": 1, "content": "<s>", "special": true}],
      "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"},
      "model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>",
                "vocab": {"<unk>": 0, "<s>": 1, "<0x41>": 2, "▁": 3, "b": 4, "▁b": 5, "bb": 6, "▁bb": 7},
                "merges": ["b b", "▁ b", "▁ bb"]}
    })");
    auto d = ReadTokenizerJson(dir.File("tokenizer.json"));
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_EQ(d->kind, TokenizerKind::kSentencePiece);
    EXPECT_TRUE(d->add_space_prefix);
    EXPECT_EQ(d->unk_id, 0);
    EXPECT_EQ(d->types[0], TokenType::kUnknown);
    EXPECT_EQ(d->types[2], TokenType::kByte);
    // -(rank of the first merge making the piece); -(merges + id) for pieces no merge makes.
    EXPECT_EQ(d->scores, (std::vector<float>{0, 0, 0, -6, -7, -1, 0, -2}));
    auto tok = testing::CreateOrFail(*d);
    // "▁bbb": bb (rank 0) first, then ▁bb (rank 2), as the file's BPE does.
    EXPECT_EQ(tok->Encode("bbbA", {}), (std::vector<int32_t>{7, 4, 2}));
}

TEST(TokenizerJson, Errors) {
    TempDir dir;
    struct Case {
        const char* json;
        StatusCode code;
        const char* mention;
    };
    const Case cases[] = {
        {"{not json", StatusCode::kInvalidArgument, "tokenizer.json"},
        {R"({"model": {"type": "Unigram", "vocab": []}})", StatusCode::kUnimplemented, "Unigram"},
        {R"({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\d+"}}, {"type": "ByteLevel"}]},
            "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})",
         StatusCode::kUnimplemented, "Split"},
        {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})",
         StatusCode::kUnimplemented, "neither"},
    };
    for (const Case& c : cases) {
        WriteFile(dir.File("tokenizer.json"), c.json);
        auto d = ReadTokenizerJson(dir.File("tokenizer.json"));
        ASSERT_FALSE(d.ok()) << c.json;
        EXPECT_EQ(d.status().code(), c.code) << d.status().ToString();
        EXPECT_NE(d.status().message().find(dir.File("tokenizer.json")), std::string::npos)
            << d.status().ToString();
        EXPECT_NE(d.status().message().find(c.mention), std::string::npos) << d.status().ToString();
    }
    EXPECT_EQ(ReadTokenizerJson(dir.File("missing.json")).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvshard
