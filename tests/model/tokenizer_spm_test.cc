// SentencePiece-style tokenizer: hand-built vocabularies, llama2.c's tokenizer.bin, stories260K.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "model/tokenizer.h"
#include "model/tokenizer_data.h"
#include "tests/model/tokenizer_test_util.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::CreateOrFail;
using testing::ParseSpecial;
using testing::SharedModel;
using testing::WithBos;

// <unk> <s> </s>, the 256 byte tokens (ids 3..258), then `pieces` with their scores.
TokenizerData SpmData(const std::vector<std::pair<std::string, float>>& pieces) {
    TokenizerData d;
    d.kind = TokenizerKind::kSentencePiece;
    d.add_bos = true;
    d.add_space_prefix = true;
    d.unk_id = 0;
    d.bos_id = 1;
    d.eos_id = 2;
    d.tokens = {"<unk>", "<s>", "</s>"};
    d.types = {TokenType::kUnknown, TokenType::kControl, TokenType::kControl};
    for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        d.tokens.push_back(name);
        d.types.push_back(TokenType::kByte);
    }
    d.scores.assign(d.tokens.size(), 0.0f);
    for (const auto& [piece, score] : pieces) {
        d.tokens.push_back(piece);
        d.scores.push_back(score);
        d.types.push_back(TokenType::kNormal);
    }
    return d;
}

constexpr int32_t kFirst = 259;  // id of the first piece after the byte tokens

TEST(SpmTokenizer, MergesHighestScoreFirst) {
    // ▁ a b c ▁a ab bc ▁ab abc
    auto tok = CreateOrFail(SpmData({{"▁", -1},
                                     {"a", -1},
                                     {"b", -1},
                                     {"c", -1},
                                     {"▁a", -5},
                                     {"ab", -2},
                                     {"bc", -3},
                                     {"▁ab", -9},
                                     {"abc", -4}}));
    ASSERT_NE(tok, nullptr);
    // "▁abc": ab (-2) beats bc (-3) and ▁a (-5); then abc (-4) beats ▁ab (-9).
    EXPECT_EQ(tok->Encode("abc", {}), (std::vector<int32_t>{kFirst, kFirst + 8}));
    EXPECT_EQ(tok->Encode("abc", WithBos()), (std::vector<int32_t>{1, kFirst, kFirst + 8}));
    // No dummy prefix when the vocabulary says so.
    TokenizerData no_prefix = tok->data();
    no_prefix.add_space_prefix = false;
    EXPECT_EQ(CreateOrFail(no_prefix)->Encode("bc", {}), (std::vector<int32_t>{kFirst + 6}));
}

TEST(SpmTokenizer, TiesMergeLeftmostPair) {
    auto tok = CreateOrFail(SpmData({{"a", -1}, {"aa", -2}}));
    TokenizerData d = tok->data();
    d.add_space_prefix = false;
    tok = CreateOrFail(d);
    // "aaa": both pairs score -2; the left one merges first.
    EXPECT_EQ(tok->Encode("aaa", {}), (std::vector<int32_t>{kFirst + 1, kFirst}));
}

TEST(SpmTokenizer, ByteFallbackForUnknownCharacters) {
    auto tok = CreateOrFail(SpmData({{"▁", -1}, {"x", -1}}));
    // "é" is not a piece: its two UTF-8 bytes become <0xC3> <0xA9> (ids 3 + byte).
    EXPECT_EQ(tok->Encode("x\xC3\xA9", {}),
              (std::vector<int32_t>{kFirst, kFirst + 1, 3 + 0xC3, 3 + 0xA9}));
    EXPECT_EQ(tok->Decode(tok->Encode("x\xC3\xA9", WithBos())), "x\xC3\xA9");
}

TEST(SpmTokenizer, UnknownTokenWithoutByteTokens) {
    TokenizerData d;
    d.kind = TokenizerKind::kSentencePiece;
    d.tokens = {"<unk>", "<s>", "</s>", "▁", "x"};
    d.types = {TokenType::kUnknown, TokenType::kControl, TokenType::kControl, TokenType::kNormal,
               TokenType::kNormal};
    d.unk_id = 0;
    d.bos_id = 1;
    d.add_space_prefix = true;
    auto tok = CreateOrFail(d);
    EXPECT_EQ(tok->Encode("x\xC3\xA9x", {}), (std::vector<int32_t>{3, 4, 0, 4}));
}

TEST(SpmTokenizer, EmptyTextHasNoTokens) {
    auto tok = CreateOrFail(SpmData({{"▁", -1}}));
    EXPECT_TRUE(tok->Encode("", {}).empty());
    EXPECT_EQ(tok->Encode("", WithBos()), (std::vector<int32_t>{1}));
}

TEST(SpmTokenizer, ParseSpecialSplitsControlTokens) {
    auto tok =
        CreateOrFail(SpmData({{"▁", -1}, {"a", -1}, {"▁a", -2}, {"<", -3}, {"s", -3}, {">", -3}}));
    const int32_t sp = kFirst, a = kFirst + 1, spa = kFirst + 2;
    // Without parse_special "<s>" is plain text.
    EXPECT_EQ(tok->Encode("a<s>a", {}),
              (std::vector<int32_t>{spa, kFirst + 3, kFirst + 4, kFirst + 5, a}));
    // With it, <s> is BOS and, as in llama.cpp, the text after a special token gets the dummy
    // prefix again.
    EXPECT_EQ(tok->Encode("a<s>a", ParseSpecial()), (std::vector<int32_t>{spa, 1, spa}));
    EXPECT_EQ(tok->Encode("<s>", ParseSpecial()), (std::vector<int32_t>{1}));
    EXPECT_EQ(tok->Encode(" </s>", ParseSpecial()), (std::vector<int32_t>{sp, sp, 2}));
}

TEST(SpmTokenizer, TokenBytesAndDecode) {
    auto tok = CreateOrFail(SpmData({{"▁", -1}, {"▁a", -2}}));
    EXPECT_EQ(tok->TokenBytes(kFirst + 1), " a");
    EXPECT_EQ(tok->TokenBytes(3 + 0x0A), "\n");
    EXPECT_EQ(tok->TokenBytes(1), "");  // control
    EXPECT_EQ(tok->TokenBytes(0), "");  // unknown, as llama.cpp without special rendering
    EXPECT_EQ(tok->TokenBytes(-1), "");
    EXPECT_EQ(tok->TokenBytes(100000), "");
    // The leading space is dropped only right after BOS.
    EXPECT_EQ(tok->Decode({1, kFirst + 1, kFirst + 1}), "a a");
    EXPECT_EQ(tok->Decode({kFirst + 1, kFirst + 1}), " a a");
    EXPECT_EQ(tok->PieceToId("▁a"), kFirst + 1);
    EXPECT_EQ(tok->PieceToId("</s>"), 2);
    EXPECT_EQ(tok->PieceToId("nope"), -1);
    EXPECT_TRUE(tok->IsControl(1));
    EXPECT_FALSE(tok->IsControl(0));
    EXPECT_FALSE(tok->IsControl(kFirst));
    EXPECT_FALSE(tok->IsControl(-5));
}

TEST(SpmTokenizer, CreateRejectsInconsistentData) {
    TokenizerData d = SpmData({{"▁", -1}});
    d.bos_id = 5000;
    auto r = Tokenizer::Create(d);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("BOS"), std::string::npos) << r.status().ToString();

    d = SpmData({{"▁", -1}});
    d.scores.pop_back();
    EXPECT_EQ(Tokenizer::Create(d).status().code(), StatusCode::kInvalidArgument);

    d = SpmData({{"▁", -1}});
    d.types.back() = static_cast<TokenType>(9);
    EXPECT_EQ(Tokenizer::Create(d).status().code(), StatusCode::kInvalidArgument);

    EXPECT_EQ(Tokenizer::Create(TokenizerData{}).status().code(), StatusCode::kInvalidArgument);
}

// llama2.c's tokenizer.bin of stories260K.
class Llama2cTokenizerTest : public ::testing::Test {
  protected:
    void SetUp() override {
        path_ = SharedModel("stories260K/tok512.bin");
        KV_REQUIRE_FIXTURE(path_, "stories260K/tok512.bin");
        auto data = ReadLlama2cTokenizer(path_, 512);
        ASSERT_TRUE(data.ok()) << data.status().ToString();
        data_ = *data;
        tok_ = CreateOrFail(data_);
        ASSERT_NE(tok_, nullptr);
    }
    std::string path_;
    TokenizerData data_;
    std::unique_ptr<Tokenizer> tok_;
};

TEST_F(Llama2cTokenizerTest, ReadsVocabulary) {
    EXPECT_EQ(data_.kind, TokenizerKind::kSentencePiece);
    ASSERT_EQ(data_.tokens.size(), 512u);
    EXPECT_EQ(data_.tokens[0], "<unk>");
    EXPECT_EQ(data_.tokens[1], "<s>");
    EXPECT_EQ(data_.tokens[2], "</s>");
    EXPECT_EQ(data_.tokens[3 + 0x0A], "<0x0A>");
    EXPECT_EQ(data_.types[0], TokenType::kUnknown);
    EXPECT_EQ(data_.types[1], TokenType::kControl);
    EXPECT_EQ(data_.types[3 + 0x41], TokenType::kByte);
    EXPECT_EQ(data_.tokens[259], "▁t");  // llama2.c stored " t"
    EXPECT_EQ(data_.types[259], TokenType::kNormal);
    EXPECT_EQ(data_.bos_id, 1);
    EXPECT_EQ(data_.eos_id, 2);
    EXPECT_EQ(data_.unk_id, 0);
    EXPECT_TRUE(data_.add_bos);
    EXPECT_TRUE(data_.add_space_prefix);
    EXPECT_EQ(data_.source, path_);
}

TEST_F(Llama2cTokenizerTest, EncodesPromptAsLlama2c) {
    // The prompt ids of the stories260K reference run (../shared/models/README.md).
    EXPECT_EQ(tok_->Encode("Once upon a time", WithBos()),
              (std::vector<int32_t>{1, 403, 407, 261, 378}));
    EXPECT_EQ(tok_->Decode({1, 403, 407, 261, 378}), "Once upon a time");
    EXPECT_EQ(tok_->Decode(tok_->Encode("Lily's mom said, \"Hi!\"\n", WithBos())),
              "Lily's mom said, \"Hi!\"\n");
}

TEST_F(Llama2cTokenizerTest, AgreesWithTheGgufOfTheSameTokenizer) {
    const std::string gguf = SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(gguf, "stories260K/stories260K.gguf");
    auto from_gguf = testing::GgufTokenizer(gguf);
    ASSERT_NE(from_gguf, nullptr);
    EXPECT_EQ(from_gguf->data().tokens, data_.tokens);
    for (const char* text : {"Once upon a time", "  two  spaces", "Tim's 3 dogs ran.\n\nThe end",
                             "caf\xC3\xA9 \xE6\x98\x8E\xE6\x9C\x88 \xF0\x9F\xA6\x99"}) {
        EXPECT_EQ(from_gguf->Encode(text, WithBos()), tok_->Encode(text, WithBos())) << text;
    }
}

TEST_F(Llama2cTokenizerTest, TruncatedFileIsDataLossNamingThePath) {
    testing::TempDir dir;
    const std::string bytes = testing::ReadFile(path_);
    for (size_t keep : {size_t{2}, size_t{4}, bytes.size() / 2, bytes.size() - 1}) {
        const std::string cut = dir.File("tok.bin");
        testing::WriteFile(cut, bytes.substr(0, keep));
        auto r = ReadLlama2cTokenizer(cut, 512);
        ASSERT_FALSE(r.ok()) << keep;
        EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
        EXPECT_NE(r.status().message().find(cut), std::string::npos) << r.status().ToString();
    }
    EXPECT_EQ(ReadLlama2cTokenizer(dir.File("missing.bin"), 512).status().code(),
              StatusCode::kNotFound);
}

TEST(Llama2cTokenizer, RejectsNegativeLength) {
    testing::TempDir dir;
    std::string bytes(4, '\0');
    const int32_t max_len = 4, len = -3;
    const float score = 0;
    std::memcpy(bytes.data(), &max_len, 4);
    bytes.append(reinterpret_cast<const char*>(&score), 4);
    bytes.append(reinterpret_cast<const char*>(&len), 4);
    testing::WriteFile(dir.File("t.bin"), bytes);
    EXPECT_EQ(ReadLlama2cTokenizer(dir.File("t.bin"), 1).status().code(), StatusCode::kDataLoss);
}

TEST(Llama2cTokenizer, PoemVocabularyOfWholeCharacters) {
    const std::string path = SharedModel("zh-poem/poem_tok.bin");
    KV_REQUIRE_FIXTURE(path, "zh-poem/poem_tok.bin");
    auto data = ReadLlama2cTokenizer(path, 2048);
    ASSERT_TRUE(data.ok()) << data.status().ToString();
    auto tok = CreateOrFail(*data);
    const std::string text = "主题：明月\n万里西征客，连山望旧林。";
    const auto ids = tok->Encode(text, WithBos());
    // BOS, the dummy-prefix space, then one token per character.
    ASSERT_EQ(ids.size(), 2u + 18u) << testing::JoinIds(ids);
    EXPECT_EQ(ids[0], 1);
    EXPECT_EQ(tok->TokenBytes(ids[1]), " ");
    EXPECT_EQ(tok->Decode(ids), text);
}

}  // namespace
}  // namespace kvshard
