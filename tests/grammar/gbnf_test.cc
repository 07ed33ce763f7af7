#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "grammar/compilers.h"
#include "grammar/grammar.h"

namespace kvshard::grammar {
namespace {

bool Accepts(const std::shared_ptr<const Grammar>& g, const std::string& text) {
    GrammarState s(g);
    return s.AdvanceBytes(text) && s.CanEnd();
}

std::shared_ptr<const Grammar> Gbnf(const std::string& text) {
    auto g = CompileGbnf(text);
    EXPECT_TRUE(g.ok()) << g.status().ToString();
    return g.ok() ? *g : nullptr;
}

std::string Utf8(uint32_t cp) {
    if (cp < 0x80) return std::string(1, static_cast<char>(cp));
    const int n = cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    std::string out(n, '\0');
    for (int i = n - 1; i > 0; --i, cp >>= 6) out[i] = static_cast<char>(0x80 | (cp & 0x3F));
    out[0] = static_cast<char>(((0xFF00 >> n) & 0xFF) | cp);
    return out;
}

TEST(GbnfTest, ArithmeticGrammarWithCommentsAndMultilineRules) {
    // clang-format off
    auto g = Gbnf(R"g(# integer arithmetic
root   ::= expr
expr   ::= term (ws [-+] ws term)*
term   ::= factor (ws [*/] ws factor)*   # products bind tighter
factor ::= num
         | "(" ws expr ws ")"
num    ::= "-"? [0-9]{1,4}
ws     ::= " "?
)g");
    // clang-format on
    struct Case {
        const char* text;
        bool ok;
    };
    for (const Case& c :
         {Case{"1", true}, Case{"12 + 3*4", true}, Case{"(1+2) / -3", true}, Case{"((7))", true},
          Case{"12345", false}, Case{"1 +", false}, Case{"1  + 2", false}, Case{"(1", false},
          Case{"", false}, Case{"a", false}}) {
        EXPECT_EQ(Accepts(g, c.text), c.ok) << c.text;
    }
}

TEST(GbnfTest, LiteralsClassesDotAndRepetitions) {
    auto g = Gbnf(
        "root ::= \"say \\\"\" word{2,3} \"\\\"\\n\" tail\n"
        "word ::= [a-zA-Z_\\-]+ \" \"\n"
        "tail ::= [^\\x00-\\x1F\\\\] . \"\\u00e9\\U0001F600\" x{2} x{1,} \"\" x{0,1}\n"
        "x    ::= \"x\"\n");
    EXPECT_TRUE(Accepts(g, "say \"ab c-d \"\n?\n\xC3\xA9\xF0\x9F\x98\x80xxx"));
    EXPECT_TRUE(Accepts(g,
                        "say \"a b c \"\n\xE2\x82\xAC"
                        "a\xC3\xA9\xF0\x9F\x98\x80xxxxx"));
    EXPECT_FALSE(Accepts(g, "say \"a \"\n?a\xC3\xA9\xF0\x9F\x98\x80xxx"));        // one word
    EXPECT_FALSE(Accepts(g, "say \"a b c d \"\n?a\xC3\xA9\xF0\x9F\x98\x80xxx"));  // four
    EXPECT_FALSE(Accepts(g, "say \"a b \"\n\\a\xC3\xA9\xF0\x9F\x98\x80xxx"));     // [^\\]
    EXPECT_FALSE(Accepts(g, "say \"a b \"\n\ta\xC3\xA9\xF0\x9F\x98\x80xxx"));     // [^\x00-\x1F]
    EXPECT_FALSE(Accepts(g, "say \"a b \"\n?a\xC3\xA9\xF0\x9F\x98\x80xx"));       // x{2} x{1,}
}

TEST(GbnfTest, UnicodeClassesMatchExactlyTheirCodePoints) {
    // Ranges across every UTF-8 length and a negation; checked code point by code point.
    auto g =
        Gbnf(R"(root ::= [a-c\u00e0-\u07ff\u4e00-\u9fff\U0001F300-\U0001F5FF] | [^\x00-\u3000])");
    for (uint32_t cp = 1; cp <= 0x10FFFF; cp += cp < 0x11000 ? 1 : 97) {
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        const bool in = (cp >= 'a' && cp <= 'c') || (cp >= 0xE0 && cp <= 0x7FF) ||
                        (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x1F300 && cp <= 0x1F5FF) ||
                        cp > 0x3000;
        ASSERT_EQ(Accepts(g, Utf8(cp)), in) << std::hex << cp;
    }
    EXPECT_FALSE(Accepts(g, "\xED\xA0\x80"));  // a surrogate is no character
}

TEST(GbnfTest, ErrorsNameTheRuleOrThePlace) {
    struct Case {
        const char* text;
        const char* error;
    };
    for (const Case& c : {
             Case{"root ::= a\n", "rule 'a' is used but never defined"},
             Case{"root ::= expr\nexpr ::= expr \"+\" \"1\" | \"1\"\n", "'expr' is left-recursive"},
             Case{"root ::= x\nx ::= (\"a\"?)*\n", "'x' is left-recursive"},
             Case{"root ::= \"a\"\nroot ::= \"b\"\n", "rule 'root' is defined twice"},
             Case{"expr ::= \"a\"\n", "no rule 'root'"},
             Case{"start: \"a\" | \"b\"\n", "not Lark EBNF"},
             Case{"?start: x\nx ::= \"a\"\n", "expected a rule name"},
             Case{"root: \"a\"\nx ::= \"b\"\n", "not Lark EBNF"},
             Case{"root ::= \"a\n", "unterminated string literal at line 1"},
             Case{"root ::= [a-\n", "unterminated '['"},
             Case{"root ::= (\"a\"\n", "unterminated '('"},
             Case{"root ::= \"a\"{1001}\n", "count above 1000"},
             Case{"root ::= \"a\"{3,2}\n", "n < m"},
             Case{"root ::= [z-a]\n", "out of order"},
             Case{"root ::= \"\\q\"\n", "the escape \\q is not GBNF"},
             Case{"root ::= \"a\" x ::= \"b\"\n", "a new rule 'x'"},
             Case{"", "no rule"},
         }) {
        auto g = CompileGbnf(c.text);
        ASSERT_FALSE(g.ok()) << c.text;
        EXPECT_NE(g.status().message().find(c.error), std::string::npos)
            << c.text << " -> " << g.status().message();
        EXPECT_EQ(g.status().message().rfind("gbnf: ", 0), 0u) << g.status().message();
    }
    EXPECT_FALSE(CompileGbnf(std::string(70'000, ' ') + "root ::= \"a\"").ok());
    // Repetitions are the one way a short text makes a large grammar: bounded.
    std::string big = "root ::=";
    for (int i = 0; i < 60; ++i) big += " \"a\"{0,1000}";
    auto g = CompileGbnf(big);
    ASSERT_FALSE(g.ok());
    EXPECT_NE(g.status().message().find("symbols"), std::string::npos) << g.status().message();
}

TEST(GbnfTest, AlternativesContinueOnLinesStartingWithBar) {
    auto g = Gbnf("root ::= \"a\"\n  | \"b\"\n\n  | \"c\" # last\nother ::= \"d\"\n");
    EXPECT_TRUE(Accepts(g, "a"));
    EXPECT_TRUE(Accepts(g, "b"));
    EXPECT_TRUE(Accepts(g, "c"));
    EXPECT_FALSE(Accepts(g, "d"));
}

}  // namespace
}  // namespace kvshard::grammar
