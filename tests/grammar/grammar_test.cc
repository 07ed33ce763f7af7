#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "grammar/compilers.h"
#include "grammar/grammar.h"
#include "grammar/token_mask.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "tests/test_util.h"

namespace kvshard::grammar {
namespace {

using nlohmann::json;

bool Accepts(const std::shared_ptr<const Grammar>& g, const std::string& text) {
    GrammarState s(g);
    return s.AdvanceBytes(text) && s.CanEnd();
}

bool Prefix(const std::shared_ptr<const Grammar>& g, const std::string& text) {
    GrammarState s(g);
    return s.AdvanceBytes(text);
}

std::shared_ptr<const Grammar> Schema(const std::string& text) {
    auto g = CompileJsonSchema(json::parse(text), "schema");
    EXPECT_TRUE(g.ok()) << g.status().ToString();
    return g.ok() ? *g : nullptr;
}

TEST(GrammarTest, StateStepsByteByByteAndClonesIndependently) {
    auto g = *CompileChoice({"cat", "car", "dog"});
    GrammarState s(g);
    EXPECT_TRUE(s.AllowedBytes().Has('c'));
    EXPECT_FALSE(s.AllowedBytes().Has('x'));
    ASSERT_TRUE(s.Advance('c'));
    GrammarState copy = s;
    ASSERT_TRUE(copy.Advance('a'));
    ASSERT_TRUE(copy.Advance('t'));
    EXPECT_TRUE(copy.CanEnd());
    EXPECT_TRUE(copy.Finished());
    EXPECT_FALSE(s.CanEnd());  // the original did not move
    EXPECT_FALSE(s.Advance('x'));
    EXPECT_TRUE(s.Advance('a'));
    EXPECT_TRUE(s.AllowedBytes().Has('t') && s.AllowedBytes().Has('r'));
}

TEST(GrammarTest, LeftRecursionIsRefusedByName) {
    auto g = std::make_shared<Grammar>();
    const uint32_t r = g->Declare("expr");
    g->Define(r, {{Grammar::Ref(r), g->Byte('+')}, {g->Byte('x')}});
    const Status st = g->Finish(r);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("'expr' is left-recursive"), std::string::npos) << st.message();
}

TEST(GrammarTest, LongRepetitionsKeepAConstantStack) {
    auto g = *CompileRegex("a*b");
    GrammarState s(g);
    for (int i = 0; i < 10000; ++i) ASSERT_TRUE(s.Advance('a'));
    EXPECT_LT(s.arena().size(), 300u);  // compacted: 10,000 bytes leave no trail
    EXPECT_TRUE(s.Advance('b'));
    EXPECT_TRUE(s.CanEnd());
}

TEST(JsonSchemaTest, ObjectWithRequiredAndOptionalProperties) {
    auto g = Schema(R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},
        "c":{"type":"boolean"}},"required":["a","c"],"additionalProperties":false})");
    EXPECT_TRUE(Accepts(g, R"({"a":1,"b":"x","c":true})"));
    EXPECT_TRUE(Accepts(g, R"({"a": -12, "c": false})"));
    EXPECT_FALSE(Accepts(g, R"({"a":1})"));             // c is required
    EXPECT_FALSE(Accepts(g, R"({"c":true,"a":1})"));    // properties in order
    EXPECT_FALSE(Accepts(g, R"({"a":1,"c":true,"d":1})"));
    EXPECT_FALSE(Accepts(g, R"({ "a":1,"c":true})"));   // no free whitespace
    EXPECT_FALSE(Accepts(g, R"({"a":1,  "c":true})"));  // at most one space
    EXPECT_FALSE(Accepts(g, R"({"a":01,"c":true})"));
}

TEST(JsonSchemaTest, StringsNumbersEnumsConstAndNull) {
    auto s = Schema(R"({"type":"string","minLength":2,"maxLength":3})");
    EXPECT_TRUE(Accepts(s, R"("ab")"));
    EXPECT_TRUE(Accepts(s, R"("a\"c")"));
    EXPECT_TRUE(Accepts(s, "\"\xC3\xA9t\xC3\xA9\""));  // été: characters, not bytes
    EXPECT_FALSE(Accepts(s, R"("a")"));
    EXPECT_FALSE(Accepts(s, R"("abcd")"));
    EXPECT_FALSE(Accepts(s, "\"a\nb\""));
    auto n = Schema(R"({"type":"number"})");
    EXPECT_TRUE(Accepts(n, "-0.5e+10"));
    EXPECT_TRUE(Accepts(n, "3"));
    EXPECT_FALSE(Accepts(n, "1."));
    EXPECT_FALSE(Accepts(n, "12345678901234567"));  // 17 integer digits: beyond the bound
    auto e = Schema(R"({"enum":["red","green",3,null]})");
    EXPECT_TRUE(Accepts(e, R"("green")"));
    EXPECT_TRUE(Accepts(e, "3"));
    EXPECT_TRUE(Accepts(e, "null"));
    EXPECT_FALSE(Accepts(e, R"("blue")"));
    auto c = Schema(R"({"const":{"k":[1,2]}})");
    EXPECT_TRUE(Accepts(c, R"({"k":[1,2]})"));
    auto t = Schema(R"({"type":["integer","null"]})");
    EXPECT_TRUE(Accepts(t, "null"));
    EXPECT_TRUE(Accepts(t, "7"));
    EXPECT_FALSE(Accepts(t, "true"));
}

TEST(JsonSchemaTest, ArraysRefsAnyOfAndRecursion) {
    auto a = Schema(R"({"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":3})");
    EXPECT_TRUE(Accepts(a, "[1]"));
    EXPECT_TRUE(Accepts(a, "[1, 2,3]"));
    EXPECT_FALSE(Accepts(a, "[]"));
    EXPECT_FALSE(Accepts(a, "[1,2,3,4]"));
    auto tree = Schema(R"({"$ref":"#/$defs/node","$defs":{"node":{"type":"object",
        "properties":{"kids":{"type":"array","items":{"$ref":"#/$defs/node"}},
        "v":{"anyOf":[{"type":"string"},{"type":"null"}]}},"required":["kids","v"],
        "additionalProperties":false}}})");
    EXPECT_TRUE(Accepts(tree, R"({"kids":[{"kids":[],"v":null}],"v":"root"})"));
    EXPECT_FALSE(Accepts(tree, R"({"kids":[{"kids":[],"v":1}],"v":"root"})"));
    auto map = Schema(R"({"type":"object","additionalProperties":{"type":"integer"}})");
    EXPECT_TRUE(Accepts(map, R"({"x":1,"y":2})"));
    EXPECT_FALSE(Accepts(map, R"({"x":"1"})"));
}

TEST(JsonSchemaTest, JsonObjectAcceptsAnyObjectOnly) {
    auto g = CompileJsonObject();
    EXPECT_TRUE(Accepts(g, R"({"a":[1,{"b":null}],"c":"d"})"));
    EXPECT_TRUE(Accepts(g, "{}"));
    EXPECT_FALSE(Accepts(g, "[1]"));
    EXPECT_FALSE(Accepts(g, R"("x")"));
}

TEST(JsonSchemaTest, UnsupportedKeywordsAreRefusedByPath) {
    struct Case {
        const char* schema;
        const char* path;
    };
    for (const Case& c : {
             Case{R"({"type":"number","minimum":0})", "schema.minimum"},
             Case{R"({"type":"object","properties":{"s":{"type":"string","format":"iri"}}})",
                  "schema.properties.s.format"},
             Case{R"({"oneOf":[{"type":"string"}]})", "schema.oneOf"},
             Case{R"({"$ref":"#/$defs/missing"})", "schema.$ref"},
             Case{R"({"type":"object","properties":{"a":{}},"required":["b"]})",
                  "schema.required"},
         }) {
        auto g = CompileJsonSchema(json::parse(c.schema), "schema");
        ASSERT_FALSE(g.ok()) << c.schema;
        EXPECT_EQ(g.status().message().rfind(c.path, 0), 0u) << g.status().message();
    }
}

TEST(RegexTest, TheDocumentedSubset) {
    auto g = *CompileRegex(R"(^(\d{3})-[A-Z][a-z]+(?:, [a-z_]+)*\.?$)");
    EXPECT_TRUE(Accepts(g, "123-Alice"));
    EXPECT_TRUE(Accepts(g, "123-Alice, bob, c_d."));
    EXPECT_FALSE(Accepts(g, "12-Alice"));
    EXPECT_FALSE(Accepts(g, "123-alice"));
    auto alt = *CompileRegex("(yes|no|maybe)!{1,2}");
    EXPECT_TRUE(Accepts(alt, "maybe!!"));
    EXPECT_FALSE(Accepts(alt, "maybe!!!"));
    auto dot = *CompileRegex("[^,]+,.");
    EXPECT_TRUE(Accepts(dot, "\xE2\x82\xAC,\xC3\xA9"));  // non-ASCII characters are one each
    EXPECT_FALSE(Accepts(dot, "a,\n"));
    auto email = *CompileRegex(R"([\w.]+@\w+\.(com|org))");
    EXPECT_TRUE(Accepts(email, "a.b@example.org"));
    EXPECT_TRUE(Prefix(email, "a.b@exa"));
    EXPECT_FALSE(Prefix(email, "a b"));
}

TEST(RegexTest, UnsupportedConstructsAreRefused) {
    for (const char* p : {R"((a)\1)", "(?=a)b", R"(\bword)", "(a*)*", "a{2,1}", "[z-a]", "*a",
                          "a{5000}", "(ab"}) {
        auto g = CompileRegex(p);
        EXPECT_FALSE(g.ok()) << p;
        if (!g.ok()) {
            EXPECT_EQ(g.status().message().rfind("regex: ", 0), 0u) << g.status().message();
        }
    }
}

TEST(TokenMaskTest, MaskFollowsTheGrammarAndEndTokens) {
    // ids: 0 eos (end), 1 control (no bytes), 2 "{", 3 "}", 4 "{}", 5 "\"a\"", 6 " ", 7 "\"", 8 "a"
    auto vocab = std::make_shared<Vocabulary>(
        std::vector<std::string>{"</s>", "", "{", "}", "{}", "\"a\"", " ", "\"", "a"},
        std::vector<int32_t>{0});
    auto g = Schema(R"({"type":"object","properties":{"a":{"type":"string"}},
                        "additionalProperties":false})");
    Constraint c(g, vocab);
    auto allowed = [&] {
        std::vector<int32_t> ids;
        const TokenMask& m = c.Mask();
        for (int32_t id = 0; id < vocab->size(); ++id)
            if (MaskHas(m, id)) ids.push_back(id);
        return ids;
    };
    EXPECT_EQ(allowed(), (std::vector<int32_t>{2, 4}));
    ASSERT_TRUE(c.Accept(2));
    EXPECT_EQ(allowed(), (std::vector<int32_t>{3, 5, 7}));
    EXPECT_FALSE(c.Accept(8));
    ASSERT_TRUE(c.Accept(3));
    EXPECT_EQ(allowed(), (std::vector<int32_t>{0}));  // complete: only the end token
    EXPECT_TRUE(c.Accept(0));
}

TEST(TokenMaskTest, MaskEqualsTokenByTokenCheck) {
    // Every token of a small made-up vocabulary, checked alone against the trie walk's answer.
    std::vector<std::string> bytes = {"<eos>"};
    for (const char* t : {"{", "{\"", "\"", "\":", "\": ", ",", ", \"", "}", "}}", "ab", "a",
                          "b\"", "1", "12", "-", "true", "tr", "null", "[", "]", "[\"", " ", "\\",
                          "\\n", "é", "\xC3", "\xA9", "x y"}) {
        bytes.push_back(t);
    }
    auto vocab = std::make_shared<Vocabulary>(bytes, std::vector<int32_t>{0});
    auto g = Schema(R"({"type":"object","properties":{"ab":{"type":"array","items":
        {"anyOf":[{"type":"string"},{"type":"integer"},{"type":"boolean"}]}}},"required":["ab"]})");
    GrammarState s(g);
    ASSERT_TRUE(s.AdvanceBytes(R"({"ab": [1, "x)"));
    for (const std::string& prefix : {std::string(), std::string("\xC3"), std::string("\", ")}) {
        GrammarState at = s;
        ASSERT_TRUE(at.AdvanceBytes(prefix));
        TokenMask mask;
        vocab->ComputeMask(at, &mask);
        for (int32_t id = 1; id < vocab->size(); ++id) {
            GrammarState probe = at;
            EXPECT_EQ(MaskHas(mask, id), probe.AdvanceBytes(vocab->bytes(id)))
                << "token '" << vocab->bytes(id) << "' after '" << prefix << "'";
        }
    }
}

// The fast mask (per-top precomputation plus checks of the uncertain tokens) equals the full trie
// walk at every step of JSON texts, over a real 50k byte-level BPE vocabulary.
TEST(TokenMaskTest, FastMaskEqualsTheWalkOnARealVocabulary) {
    const std::string path = testing::SharedModel("tokenizer-tests/ggml-vocab-gpt-2.gguf");
    KV_REQUIRE_FIXTURE(path, "ggml-vocab-gpt-2.gguf");
    auto gguf = GgufFile::Open(path);
    ASSERT_TRUE(gguf.ok());
    auto data = TokenizerDataFromGguf(**gguf);
    ASSERT_TRUE(data.ok());
    auto tok = Tokenizer::Create(*data);
    ASSERT_TRUE(tok.ok());
    std::vector<std::string> bytes;
    for (int32_t id = 0; id < (*tok)->vocab_size(); ++id)
        bytes.push_back((*tok)->IsControl(id) ? std::string() : (*tok)->TokenBytes(id));
    auto vocab = std::make_shared<Vocabulary>(bytes, std::vector<int32_t>{(*tok)->eos_id()});
    auto g = Schema(R"({"type":"object","properties":{"name":{"type":"string"},
        "n":{"type":"array","items":{"type":"number"},"maxItems":4},"ok":{"type":"boolean"}},
        "required":["name","n"],"additionalProperties":false})");
    const std::string text = R"({"n": [1.5, -20e3], "name": "a \"quoted\" caf\u00e9 Ã©!", "ok": true})";
    GrammarState s(g);
    TokenMask fast, walk;
    for (size_t i = 0; i <= text.size(); ++i) {
        vocab->ComputeMask(s, &fast);
        vocab->ComputeMaskByWalk(s, &walk);
        ASSERT_EQ(fast, walk) << "after '" << text.substr(0, i) << "'";
        if (i < text.size()) {
            ASSERT_TRUE(s.Advance(static_cast<uint8_t>(text[i]))) << i;
        }
    }
    EXPECT_TRUE(s.CanEnd());
}

}  // namespace
}  // namespace kvshard::grammar
