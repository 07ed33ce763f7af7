// Byte-level BPE: the byte table, the pre-tokenizers, merging, special tokens, and SmolLM2 checked
// against llama.cpp.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "common/utf8.h"
#include "model/bpe_tokenizer.h"
#include "model/pre_tokenizer.h"
#include "model/tokenizer.h"
#include "tests/model/tokenizer_test_util.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::CreateOrFail;
using testing::ParseSpecial;
using testing::WithBos;

std::vector<std::string> Pieces(std::string_view pre, std::string_view text) {
    auto p = PreTokenizer::Create(PreTokenizerRegexes(pre));
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    std::vector<std::string> out;
    for (std::string_view piece : (*p)->Split(text)) out.emplace_back(piece);
    return out;
}

using Strings = std::vector<std::string>;

TEST(ByteLevelTokenTable, TableIsABijectionOntoPrintableCharacters) {
    const auto& table = ByteLevelEncodeTable();
    std::set<std::string> seen(table.begin(), table.end());
    EXPECT_EQ(seen.size(), 256u);
    EXPECT_EQ(table[' '], "Ġ");
    EXPECT_EQ(table['\n'], "Ċ");
    EXPECT_EQ(table['A'], "A");
    EXPECT_EQ(table[0xFF], "ÿ");
    EXPECT_EQ(table[0xAD], "Ń");  // the soft hyphen is not printable: U+0100 + 67
    std::string all, encoded;
    for (int b = 0; b < 256; ++b) {
        all.push_back(static_cast<char>(b));
        encoded += table[static_cast<size_t>(b)];
    }
    EXPECT_EQ(ByteLevelDecode(encoded), all);
    EXPECT_EQ(ByteLevelDecode("€"), "€");  // not in the table: kept
}

struct SplitCase {
    const char* pre;
    const char* text;
    Strings pieces;
};

TEST(PreTokenizer, SplitsAsLlamaCpp) {
    const SplitCase cases[] = {
        {"gpt-2", "Hello world's end", {"Hello", " world", "'s", " end"}},
        {"gpt-2", "a  b\n\n", {"a", " ", " b", "\n\n"}},
        {"gpt-2", " 123 4567!!", {" 123", " 4567", "!!"}},
        {"gpt-2", "I'M", {"I", "'", "M"}},
        {"smollm", " 123 ab4", {" ", "1", "2", "3", " ab", "4"}},
        {"smollm", "x٣٤", {"x", "٣", "٤"}},
        {"llama-bpe",
         "Hello 12345 world\n\n  x",
         {"Hello", " ", "123", "45", " world", "\n\n", " ", " x"}},
        {"llama-bpe", "I'M ok", {"I", "'M", " ok"}},
        {"llama-bpe", "(x)...\r\ny", {"(x", ")...\r\n", "y"}},
    };
    for (const SplitCase& c : cases) {
        EXPECT_EQ(Pieces(c.pre, c.text), c.pieces) << c.pre << ": \"" << c.text << "\"";
    }
}

TEST(PreTokenizer, InvalidUtf8BytesArePiecesOfTheirOwn) {
    EXPECT_EQ(Pieces("gpt-2", "ab\xFF\xC3 cd"), (Strings{"ab", "\xFF", "\xC3", " cd"}));
}

TEST(PreTokenizer, KnownNames) {
    EXPECT_FALSE(PreTokenizerRegexes("gpt-2").empty());
    EXPECT_FALSE(PreTokenizerRegexes("llama3").empty());
    EXPECT_TRUE(PreTokenizerRegexes("qwen2").empty());
}

// The 256 byte symbols (id = byte), then `pieces`, then merges among them.
TokenizerData BpeData(const Strings& pieces, const Strings& merges) {
    TokenizerData d;
    d.kind = TokenizerKind::kByteLevelBpe;
    for (const std::string& s : ByteLevelEncodeTable()) d.tokens.push_back(s);
    for (const std::string& p : pieces) d.tokens.push_back(p);
    d.types.assign(d.tokens.size(), TokenType::kNormal);
    d.merges = merges;
    return d;
}

TEST(BpeTokenizer, MergesLowestRankFirst) {
    // 256 a b c -> ids 256.. : ab bc abc
    auto tok = CreateOrFail(BpeData({"ab", "bc", "abc"}, {"b c", "a bc", "a b"}));
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->Encode("abc", {}), (std::vector<int32_t>{258}));
    EXPECT_EQ(tok->Encode("abd", {}), (std::vector<int32_t>{256, 'd'}));
    auto other = CreateOrFail(BpeData({"ab", "bc", "abc"}, {"a b", "b c"}));
    EXPECT_EQ(other->Encode("abc", {}), (std::vector<int32_t>{256, 'c'}));
    // Ties between equal pairs go to the leftmost: "bcbc" has no equal pairs; "aaa" does.
    auto aa = CreateOrFail(BpeData({"aa"}, {"a a"}));
    EXPECT_EQ(aa->Encode("aaa", {}), (std::vector<int32_t>{256, 'a'}));
}

TEST(BpeTokenizer, BytesAndSpacesGoThroughTheTable) {
    auto tok = CreateOrFail(BpeData({"Ġa"}, {"Ġ a"}));
    EXPECT_EQ(tok->Encode(" a a", {}), (std::vector<int32_t>{256, 256}));
    EXPECT_EQ(tok->TokenBytes(256), " a");
    EXPECT_EQ(tok->TokenBytes(0xC3), "\xC3");
    // Any bytes survive a round trip, valid UTF-8 or not.
    const std::string odd = "x\xFF\xC3 \xE6\x98";
    EXPECT_EQ(tok->Decode(tok->Encode(odd, {})), odd);
}

TEST(BpeTokenizer, SpecialTokens) {
    TokenizerData d = BpeData({"<|end|>", "<think>"}, {});
    d.types[256] = TokenType::kControl;
    d.types[257] = TokenType::kUserDefined;
    d.bos_id = 256;
    auto tok = CreateOrFail(d);
    // Control tokens only with parse_special; user-defined tokens always, as llama.cpp.
    EXPECT_EQ(tok->Encode("a<|end|>", {}).size(), 8u);
    EXPECT_EQ(tok->Encode("a<|end|>", ParseSpecial()), (std::vector<int32_t>{'a', 256}));
    EXPECT_EQ(tok->Encode("<think>b", {}), (std::vector<int32_t>{257, 'b'}));
    EXPECT_EQ(tok->Encode("b", WithBos()), (std::vector<int32_t>{256, 'b'}));
    EXPECT_EQ(tok->TokenBytes(256), "");
    EXPECT_EQ(tok->TokenBytes(257), "<think>");
    EXPECT_EQ(tok->PieceToId("<|end|>"), 256);
    EXPECT_TRUE(tok->IsControl(256));
    EXPECT_FALSE(tok->IsControl(257));
}

TEST(BpeTokenizer, LongestSpecialTokenWins) {
    TokenizerData d = BpeData({"<a>", "<a><b>"}, {});
    d.types[256] = TokenType::kControl;
    d.types[257] = TokenType::kControl;
    auto tok = CreateOrFail(d);
    EXPECT_EQ(tok->Encode("<a><b><a>", ParseSpecial()), (std::vector<int32_t>{257, 256}));
}

TEST(BpeTokenizer, CreateErrors) {
    TokenizerData d = BpeData({}, {});
    d.pre = "qwen2";
    auto r = Tokenizer::Create(d);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(r.status().message().find("qwen2"), std::string::npos) << r.status().ToString();

    auto bad_merge = Tokenizer::Create(BpeData({}, {"a zz"}));
    ASSERT_FALSE(bad_merge.ok());
    EXPECT_EQ(bad_merge.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad_merge.status().message().find("zz"), std::string::npos);
    EXPECT_EQ(Tokenizer::Create(BpeData({}, {"ab"})).status().code(), StatusCode::kInvalidArgument);
}

TEST(BpeTokenizer, Gpt2VocabularyDetails) {
    const std::string path = testing::SharedModel("tokenizer-tests/ggml-vocab-gpt-2.gguf");
    KV_REQUIRE_FIXTURE(path, "tokenizer-tests/ggml-vocab-gpt-2.gguf");
    auto tok = testing::GgufTokenizer(path);
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->data().pre, "gpt-2");
    EXPECT_FALSE(tok->data().add_bos);
    EXPECT_EQ(tok->eos_id(), 50256);
    EXPECT_EQ(tok->Encode("Hello<|endoftext|>", ParseSpecial()),
              (std::vector<int32_t>{15496, 50256}));
    EXPECT_EQ(tok->Encode("Hello world", {}), (std::vector<int32_t>{15496, 995}));
}

// SmolLM2 (pre "smollm": every digit its own piece). The expected ids came from llama.cpp:
//   python3 -c "import llama_cpp; m =
//   llama_cpp.Llama(model_path='models/SmolLM2-135M-Instruct.Q4_1.gguf',
//     vocab_only=True); print(m.tokenize(s.encode(), add_bos=False, special=False))"
// with llama-cpp-python 0.3.36 (and special=True for the last case).
TEST(BpeTokenizer, SmolLM2MatchesLlamaCpp) {
    const std::string path = testing::DefaultModel();
    KV_REQUIRE_FIXTURE(path, "models/SmolLM2-135M-Instruct.Q4_1.gguf");
    auto tok = testing::GgufTokenizer(path);
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->data().pre, "smollm");
    struct Case {
        const char* text;
        std::vector<int32_t> ids;
    };
    const Case cases[] = {
        {"I have 12345 apples and 3.14159 pies.", {57,  457, 216, 33, 34, 35, 36, 37, 13855, 284,
                                                   216, 35,  30,  33, 36, 33, 37, 41, 42801, 30}},
        {"Call 555-0199 before 2024-12-31!", {12800, 216, 37, 37, 37, 29, 32, 33, 41, 41, 1092, 216,
                                              34,    32,  34, 36, 29, 33, 34, 29, 35, 33, 17}},
        {" 42", {216, 36, 34}},
        {"x1y22z333 ½ ٣٤ ⅷ", {104,   33,  105, 34,  34,  106, 35,  35,  35,  216,
                              16738, 216, 164, 113, 164, 114, 216, 173, 223, 132}},
        {"Hello world", {19556, 905}},
        {"   indented\n\n\tcode = 10 ** 9",
         {256, 641, 6574, 1116, 197, 4635, 446, 216, 33, 32, 1903, 216, 41}},
        {"<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
         {44, 108, 306, 79,    3738, 108, 46, 4093, 198, 1780, 314, 216,
          34, 27,  34,  15137, 108,  306, 79, 486,  108, 46,   198}},
    };
    for (const Case& c : cases) {
        EXPECT_EQ(tok->Encode(c.text, {}), c.ids) << c.text;
        EXPECT_EQ(tok->Decode(c.ids), c.text);
    }
    EXPECT_EQ(tok->Encode("<|im_start|>user\nWhat is 2+2?<|im_end|>\n", ParseSpecial()),
              (std::vector<int32_t>{1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198}));
    EXPECT_EQ(tok->PieceToId("<|im_end|>"), 2);
    EXPECT_TRUE(tok->IsControl(2));
    EXPECT_EQ(tok->Decode({1, 4093, 2}), "user");
}

}  // namespace
}  // namespace kvshard
