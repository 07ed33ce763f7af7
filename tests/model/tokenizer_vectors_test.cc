// llama.cpp's tokenizer test vectors (tests/ggml-vocab-*.gguf.{inp,out}): every string of the
// .inp file, tokenized without BOS and without special-token parsing, must give the ids of the
// matching .out line. Also Decode(Encode(s)) == s on the same strings.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "model/tokenizer_data.h"
#include "tests/model/tokenizer_test_util.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::ReadFile;
using testing::SharedModel;

struct VectorCase {
    std::string text;
    std::vector<int32_t> ids;
};

// The .inp file holds strings separated by lines "__ggml_vocab_test__" (the file ends with one).
// As llama.cpp's test-tokenizer-0 reads it, a string is the text between two separator lines
// without the newline that precedes the next separator.
std::vector<std::string> SplitInputs(const std::string& inp) {
    const std::string sep = "__ggml_vocab_test__\n";
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t pos = 0; pos < inp.size();) {
        const size_t line_end = inp.find('\n', pos);
        const size_t next = line_end == std::string::npos ? inp.size() : line_end + 1;
        if (inp.compare(pos, next - pos, sep) == 0) {
            // The text ends before the newline that precedes the separator line.
            out.push_back(inp.substr(start, pos > start ? pos - 1 - start : 0));
            start = next;
        }
        pos = next;
    }
    return out;
}

std::vector<std::vector<int32_t>> ReadOutputs(const std::string& out) {
    std::vector<std::vector<int32_t>> lines;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
        std::istringstream ids(line);
        std::vector<int32_t> v;
        for (int32_t id; ids >> id;) v.push_back(id);
        lines.push_back(v);
    }
    return lines;
}

class TokenizerVectorTest : public ::testing::TestWithParam<const char*> {
  protected:
    void SetUp() override {
        const std::string rel = std::string("tokenizer-tests/") + GetParam();
        path_ = SharedModel(rel);
        if (path_.empty()) GTEST_SKIP() << "fixture not found: " << rel;
        auto gguf = GgufFile::Open(path_);
        ASSERT_TRUE(gguf.ok()) << gguf.status().ToString();
        auto data = TokenizerDataFromGguf(**gguf);
        ASSERT_TRUE(data.ok()) << data.status().ToString();
        auto tok = Tokenizer::Create(*data);
        ASSERT_TRUE(tok.ok()) << tok.status().ToString();
        tokenizer_ = std::move(tok).value();

        const std::vector<std::string> inputs = SplitInputs(ReadFile(path_ + ".inp"));
        const auto outputs = ReadOutputs(ReadFile(path_ + ".out"));
        ASSERT_EQ(inputs.size(), outputs.size()) << "the .inp strings and .out lines must pair up";
        ASSERT_FALSE(inputs.empty());
        for (size_t i = 0; i < inputs.size(); ++i) cases_.push_back({inputs[i], outputs[i]});
    }

    std::string path_;
    std::unique_ptr<Tokenizer> tokenizer_;
    std::vector<VectorCase> cases_;
};

TEST_P(TokenizerVectorTest, EveryLineMatchesLlamaCpp) {
    int passed = 0;
    for (size_t i = 0; i < cases_.size(); ++i) {
        const auto ids = tokenizer_->Encode(cases_[i].text, {});
        if (ids == cases_[i].ids) {
            ++passed;
        } else {
            ADD_FAILURE() << GetParam() << " line " << i + 1 << ": \"" << cases_[i].text
                          << "\"\n  expected: " << testing::JoinIds(cases_[i].ids)
                          << "\n  got:      " << testing::JoinIds(ids);
        }
    }
    EXPECT_EQ(passed, static_cast<int>(cases_.size()));
    std::printf("%s: %d of %zu vector lines pass\n", GetParam(), passed, cases_.size());
}

TEST_P(TokenizerVectorTest, DecodeInvertsEncode) {
    // SentencePiece adds a dummy-prefix space that Decode keeps unless the text follows BOS.
    const bool spm = tokenizer_->data().kind == TokenizerKind::kSentencePiece;
    for (const VectorCase& c : cases_) {
        const auto ids = tokenizer_->Encode(c.text, {});
        const std::string expected = spm && !c.text.empty() ? " " + c.text : c.text;
        EXPECT_EQ(tokenizer_->Decode(ids), expected) << "\"" << c.text << "\"";
        if (spm && !c.text.empty()) {
            EncodeOptions with_bos;
            with_bos.add_bos = true;
            EXPECT_EQ(tokenizer_->Decode(tokenizer_->Encode(c.text, with_bos)), c.text);
        }
    }
}

INSTANTIATE_TEST_SUITE_P(LlamaCpp, TokenizerVectorTest,
                         ::testing::Values("ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf"),
                         [](const auto& info) {
                             std::string name = info.param;
                             for (char& c : name) {
                                 if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                             }
                             return name;
                         });

TEST(TokenizerVectorFiles, SplitMatchesLlamaCppReading) {
    const std::string inp =
        "a\n__ggml_vocab_test__\n\n__ggml_vocab_test__\n\n\n__ggml_vocab_test__\n";
    EXPECT_EQ(SplitInputs(inp), (std::vector<std::string>{"a", "", "\n"}));
}

}  // namespace
}  // namespace kvshard
