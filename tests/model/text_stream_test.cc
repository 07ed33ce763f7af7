// TextStream: incremental UTF-8-safe detokenization with stop strings.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/utf8.h"
#include "model/bpe_tokenizer.h"
#include "model/tokenizer.h"
#include "tests/model/tokenizer_test_util.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::CreateOrFail;
using testing::SharedModel;
using testing::WithBos;

const char kPoem[] = "主题：明月\n万里西征客，连山望旧林。";

// A byte-level vocabulary of the 256 byte symbols (id = byte) plus "Ġa".
std::unique_ptr<Tokenizer> ByteTokenizer() {
    TokenizerData d;
    d.kind = TokenizerKind::kByteLevelBpe;
    for (const std::string& s : ByteLevelEncodeTable()) d.tokens.push_back(s);
    d.tokens.push_back("<|eot|>");  // 256
    d.tokens.push_back("zabc");     // 257
    d.types.assign(d.tokens.size(), TokenType::kNormal);
    d.types[256] = TokenType::kControl;
    return CreateOrFail(d);
}

// Feeds `ids` one at a time; checks every chunk is valid UTF-8 and returns the chunks.
std::vector<std::string> Stream(TextStream& stream, const std::vector<int32_t>& ids) {
    std::vector<std::string> chunks;
    for (int32_t id : ids) {
        chunks.push_back(stream.Push(id));
        EXPECT_TRUE(IsValidUtf8(chunks.back())) << "chunk " << chunks.size() - 1;
        if (stream.stopped()) break;
    }
    return chunks;
}

std::string Concat(const std::vector<std::string>& chunks) {
    std::string s;
    for (const std::string& c : chunks) s += c;
    return s;
}

TEST(TextStream, MultiByteCharacterSplitAcrossByteTokens) {
    auto tok = ByteTokenizer();
    TextStream stream(*tok, {});
    // "明" is E6 98 8E: nothing until its last byte.
    EXPECT_EQ(Stream(stream, {0xE6, 0x98, 0x8E, 'a'}),
              (std::vector<std::string>{"", "", "明", "a"}));
    EXPECT_EQ(stream.Finish(), "");
}

TEST(TextStream, FinishReplacesAnIncompleteTail) {
    auto tok = ByteTokenizer();
    TextStream stream(*tok, {});
    EXPECT_EQ(stream.Push('x'), "x");
    EXPECT_EQ(stream.Push(0xE6), "");
    EXPECT_EQ(stream.Push(0x98), "");
    EXPECT_EQ(stream.Finish(), "\xEF\xBF\xBD");
}

TEST(TextStream, InvalidBytesBecomeReplacementCharacters) {
    auto tok = ByteTokenizer();
    TextStream stream(*tok, {});
    EXPECT_EQ(stream.Push(0xFF), "\xEF\xBF\xBD");
    EXPECT_EQ(stream.Push(0xE6), "");
    EXPECT_EQ(stream.Push('a'),
              "\xEF\xBF\xBD"
              "a");  // E6 cut short by 'a'
}

TEST(TextStream, ControlTokensGiveNoText) {
    auto tok = ByteTokenizer();
    TextStream stream(*tok, {});
    EXPECT_EQ(Concat(Stream(stream, {'a', 256, 'b'})), "ab");
}

TEST(TextStream, SkipSpecialTokensFalseGivesTheControlTokensPiece) {
    auto tok = ByteTokenizer();
    TextStream stream(*tok, {}, -1, TextStreamOptions{.skip_special_tokens = false});
    EXPECT_EQ(Concat(Stream(stream, {'a', 256, 'b'})), "a<|eot|>b");
}

TEST(TextStream, IncludeStopKeepsTheStopStringAndDropsWhatFollows) {
    auto tok = ByteTokenizer();
    TextStream stream(*tok, {"bc"}, -1, TextStreamOptions{.include_stop = true});
    std::string out = Concat(Stream(stream, {'x', 257}));  // "x", then "zabc": stop inside
    EXPECT_TRUE(stream.stopped());
    EXPECT_EQ(out, "xzabc");
    TextStream later(*tok, {"za"}, -1, TextStreamOptions{.include_stop = true});
    EXPECT_EQ(Concat(Stream(later, {'q', 257})), "qza");  // "bc" after the stop is dropped
}

struct StopCase {
    std::vector<std::string> stops;
    std::string text;     // fed one byte token at a time
    std::string emitted;  // all text returned
    bool stopped;
    std::string matched;
};

TEST(TextStream, StopStrings) {
    const StopCase cases[] = {
        {{"END"}, "abcENDxyz", "abc", true, "END"},
        {{"END"}, "abcENxyz", "abcENxyz", false, ""},  // a partial match is released
        {{"\n\n", "User:"}, "Hi.\nUser: yo", "Hi.\n", true, "User:"},
        {{"xyz", "y"}, "axyz", "ax", true, "y"},   // the earliest match wins
        {{"ab", "abc"}, "zabc", "z", true, "ab"},  // stops as soon as one is complete
        {{"明月"}, "主题：明月", "主题：", true, "明月"},
        {{""}, "abc", "abc", false, ""},  // empty stop strings are ignored
    };
    auto tok = ByteTokenizer();
    for (const StopCase& c : cases) {
        TextStream stream(*tok, c.stops);
        std::vector<int32_t> ids;
        for (char ch : c.text) ids.push_back(static_cast<uint8_t>(ch));
        std::string out = Concat(Stream(stream, ids));
        if (!stream.stopped()) out += stream.Finish();
        EXPECT_EQ(out, c.emitted) << c.text;
        EXPECT_EQ(stream.stopped(), c.stopped) << c.text;
        EXPECT_EQ(stream.matched_stop(), c.matched) << c.text;
        if (stream.stopped()) {
            EXPECT_EQ(stream.Push('q'), "");
            EXPECT_EQ(stream.Finish(), "");
        }
    }
}

TEST(TextStream, LongerStopWinsWhenBothCompleteAtOnce) {
    auto tok = ByteTokenizer();
    TextStream stream(*tok, {"ab", "abc"});
    EXPECT_EQ(stream.Push('y'), "y");
    EXPECT_EQ(stream.Push(257), "z");
    EXPECT_TRUE(stream.stopped());
    EXPECT_EQ(stream.matched_stop(), "abc");
}

TEST(TextStream, HoldsBackOnlyPossibleStopPrefixes) {
    auto tok = ByteTokenizer();
    TextStream stream(*tok, {"</s>"});
    EXPECT_EQ(stream.Push('a'), "a");
    EXPECT_EQ(stream.Push('<'), "");
    EXPECT_EQ(stream.Push('/'), "");
    EXPECT_EQ(stream.Push('x'), "</x");
    EXPECT_FALSE(stream.stopped());
}

class PoemTextStreamTest : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string path = SharedModel("zh-poem/poem_tok.bin");
        KV_REQUIRE_FIXTURE(path, "zh-poem/poem_tok.bin");
        auto data = ReadLlama2cTokenizer(path, 2048);
        ASSERT_TRUE(data.ok()) << data.status().ToString();
        tok_ = CreateOrFail(*data);
        ASSERT_NE(tok_, nullptr);
        ids_ = tok_->Encode(kPoem, WithBos());
        ASSERT_GT(ids_.size(), 2u);
        prompt_last_ = ids_.front();  // BOS
        ids_.erase(ids_.begin());
    }
    std::unique_ptr<Tokenizer> tok_;
    std::vector<int32_t> ids_;
    int32_t prompt_last_ = -1;
};

TEST_F(PoemTextStreamTest, StreamsWholeCharactersAndDropsTheSpaceAfterBos) {
    TextStream stream(*tok_, {}, prompt_last_);
    const auto chunks = Stream(stream, ids_);
    EXPECT_EQ(Concat(chunks) + stream.Finish(), kPoem);
    EXPECT_EQ(chunks[0], "");  // the dummy-prefix space right after BOS
    EXPECT_EQ(chunks[1], "主");
}

TEST_F(PoemTextStreamTest, StopStringSpanningTwoTokens) {
    TextStream stream(*tok_, {"西征"}, prompt_last_);
    const std::string out = Concat(Stream(stream, ids_));
    EXPECT_TRUE(stream.stopped());
    EXPECT_EQ(out, "主题：明月\n万里");
    EXPECT_EQ(stream.matched_stop(), "西征");
}

TEST_F(PoemTextStreamTest, ByteTokensOfThePoemNeverSplitACharacter) {
    // stories260K's vocabulary has no Chinese pieces: the poem becomes <0xXX> byte tokens, fed
    // here one at a time.
    const std::string path = SharedModel("stories260K/tok512.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K/tok512.bin");
    auto data = ReadLlama2cTokenizer(path, 512);
    ASSERT_TRUE(data.ok());
    auto bytes_tok = CreateOrFail(*data);
    std::vector<int32_t> ids = bytes_tok->Encode(kPoem, {});
    ASSERT_GT(ids.size(), 40u);  // mostly single bytes
    TextStream stream(*bytes_tok, {"望旧"}, /*prev_token=*/-1);
    const auto chunks = Stream(stream, ids);
    for (const std::string& c : chunks) {
        ASSERT_TRUE(c.empty() || IsValidUtf8(c)) << c;
    }
    EXPECT_TRUE(stream.stopped());
    EXPECT_EQ(Concat(chunks), std::string(" ") + "主题：明月\n万里西征客，连山");
}

}  // namespace
}  // namespace kvshard
