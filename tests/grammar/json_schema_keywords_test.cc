// JSON Schema keywords beyond OpenAI's strict subset: pattern, format, integer bounds.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>

#include "grammar/compilers.h"
#include "grammar/grammar.h"

namespace kvshard::grammar {
namespace {

using nlohmann::json;

bool Accepts(const std::shared_ptr<const Grammar>& g, const std::string& text) {
    GrammarState s(g);
    return s.AdvanceBytes(text) && s.CanEnd();
}

std::shared_ptr<const Grammar> Schema(const json& schema) {
    auto g = CompileJsonSchema(schema, "schema");
    EXPECT_TRUE(g.ok()) << g.status().ToString();
    return g.ok() ? *g : nullptr;
}

struct Row {
    const char* text;
    bool ok;
};

void ExpectTable(const json& schema, std::initializer_list<Row> rows) {
    auto g = Schema(schema);
    ASSERT_NE(g, nullptr);
    for (const Row& r : rows) EXPECT_EQ(Accepts(g, r.text), r.ok) << schema << " " << r.text;
}

// Every integer in [lo - 300, hi + 300] (and around the 16-digit edge when a side is open) is
// accepted exactly when it is in [lo, hi].
void ExpectExactRange(const json& schema, int64_t lo, int64_t hi) {
    auto g = Schema(schema);
    ASSERT_NE(g, nullptr);
    for (int64_t v = lo - 300; v <= hi + 300;
         v = v < lo + 5000 || v >= hi - 5000 ? v + 1 : hi - 5000) {
        ASSERT_EQ(Accepts(g, std::to_string(v)), v >= lo && v <= hi) << schema << " " << v;
    }
}

TEST(JsonSchemaKeywordsTest, IntegerBoundsAreExactOverWholeRanges) {
    ExpectExactRange({{"type", "integer"}, {"minimum", 0}, {"maximum", 1000}}, 0, 1000);
    ExpectExactRange({{"type", "integer"}, {"minimum", -123}, {"maximum", 4567}}, -123, 4567);
    ExpectExactRange({{"type", "integer"}, {"exclusiveMinimum", -50}, {"exclusiveMaximum", -3}},
                     -49, -4);
    ExpectExactRange({{"type", "integer"}, {"minimum", 7}, {"maximum", 7}}, 7, 7);
    ExpectExactRange({{"type", "integer"}, {"minimum", 1.5}, {"maximum", 99.5}}, 2, 99);
    ExpectExactRange({{"type", "integer"}, {"exclusiveMinimum", 1.5}, {"exclusiveMaximum", 3.0}}, 2,
                     2);
    ExpectExactRange({{"type", "integer"}, {"minimum", -100000}, {"maximum", -99000}}, -100000,
                     -99000);
    ExpectExactRange(
        {{"type", "integer"}, {"minimum", 123456789012LL}, {"maximum", 123456799999LL}},
        123456789012LL, 123456799999LL);
    // One side open: up to the 16 digits every JSON integer here is held to.
    ExpectExactRange({{"type", "integer"}, {"minimum", 9999999999990000LL}}, 9999999999990000LL,
                     9999999999999999LL);
    ExpectExactRange({{"type", "integer"}, {"maximum", -9999999999990000LL}}, -9999999999999999LL,
                     -9999999999990000LL);
    ExpectTable({{"type", "integer"}, {"minimum", -5}, {"maximum", 5}}, {{"0", true},
                                                                         {"-0", false},
                                                                         {"05", false},
                                                                         {"+3", false},
                                                                         {"5.0", false},
                                                                         {"1e0", false},
                                                                         {"", false},
                                                                         {"-", false}});
}

TEST(JsonSchemaKeywordsTest, RandomIntegerRangesNeverAdmitAValueOutside) {
    std::mt19937_64 rng(14);
    for (int i = 0; i < 100; ++i) {
        const int64_t scale = int64_t{1} << (rng() % 40);
        int64_t lo = static_cast<int64_t>(rng() % (2 * scale)) - scale;
        int64_t hi = lo + static_cast<int64_t>(rng() % scale);
        auto g = Schema({{"type", "integer"}, {"minimum", lo}, {"maximum", hi}});
        ASSERT_NE(g, nullptr);
        for (int64_t v : {lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, -lo, -hi, lo * 10, hi * 10}) {
            ASSERT_EQ(Accepts(g, std::to_string(v)), v >= lo && v <= hi) << lo << ".." << hi;
        }
        for (int k = 0; k < 50; ++k) {
            const int64_t v = lo - scale + static_cast<int64_t>(rng() % (3 * scale + 1));
            ASSERT_EQ(Accepts(g, std::to_string(v)), v >= lo && v <= hi)
                << lo << ".." << hi << " " << v;
        }
    }
}

TEST(JsonSchemaKeywordsTest, PatternMatchesTheWholeStringWithJsonEscapes) {
    ExpectTable({{"type", "string"}, {"pattern", R"(^[A-Z]{2}-\d{3}$)"}},
                {{R"("AB-123")", true},
                 {R"("AB-12")", false},
                 {R"("ab-123")", false},
                 {R"(AB-123)", false},
                 {R"("xAB-123")", false}});
    // '"' and '\' appear only escaped; a control character only as its escape.
    ExpectTable({{"type", "string"}, {"pattern", R"(say "[a\\"]+"\n)"}},
                {{R"("say \"a\\\"\"\n")", true},
                 {R"("say \"a"a\"\n")", false},
                 {"\"say \\\"a\\\"\n\"", false}});
    ExpectTable({{"type", "string"}, {"pattern", "^.{2}$"}},
                {{R"("a\"")", true}, {R"("ab")", true}, {"\"a\tb\"", false}, {R"("abc")", false}});
}

TEST(JsonSchemaKeywordsTest, FormatsGenerateOnlyValidValues) {
    ExpectTable({{"type", "string"}, {"format", "date"}}, {{R"("2024-02-28")", true},
                                                           {R"("1999-12-31")", true},
                                                           {R"("0001-04-30")", true},
                                                           {R"("2024-02-30")", false},
                                                           {R"("2024-04-31")", false},
                                                           {R"("2024-13-01")", false},
                                                           {R"("0000-01-01")", false},
                                                           {R"("2024-1-01")", false}});
    ExpectTable({{"type", "string"}, {"format", "time"}}, {{R"("23:59:59Z")", true},
                                                           {R"("00:00:00.123456+05:30")", true},
                                                           {R"("24:00:00Z")", false},
                                                           {R"("12:60:00Z")", false},
                                                           {R"("12:00:00")", false}});
    ExpectTable({{"type", "string"}, {"format", "date-time"}},
                {{R"("2026-12-02T04:30:00Z")", true}, {R"("2026-12-02 04:30:00Z")", false}});
    ExpectTable({{"type", "string"}, {"format", "uuid"}},
                {{R"("123e4567-e89b-12d3-a456-426614174000")", true},
                 {R"("123e4567e89b12d3a456426614174000")", false},
                 {R"("123e4567-e89b-12d3-a456-42661417400g")", false}});
    ExpectTable({{"type", "string"}, {"format", "email"}}, {{R"("a.b+c@mail.example.org")", true},
                                                            {R"("x@y.io")", true},
                                                            {R"("@y.io")", false},
                                                            {R"("x@y")", false},
                                                            {R"("a..b@y.io")", false}});
    ExpectTable({{"type", "string"}, {"format", "ipv4"}}, {{R"("192.168.0.255")", true},
                                                           {R"("0.0.0.0")", true},
                                                           {R"("256.1.1.1")", false},
                                                           {R"("01.1.1.1")", false},
                                                           {R"("1.1.1")", false}});
}

TEST(JsonSchemaKeywordsTest, WhatIsNotSupportedIsRefusedByPath) {
    struct Case {
        const char* schema;
        const char* message;
    };
    for (const Case& c : {
             Case{R"({"type":"number","minimum":0})", "schema.minimum: JSON Schema keyword"},
             Case{R"({"properties":{"s":{"type":"string","pattern":"(a)\\1"}},"type":"object"})",
                  "schema.properties.s.pattern: regex: "},
             Case{R"({"type":"string","format":"hostname"})",
                  "schema.format: format 'hostname' is not supported"},
             Case{R"({"type":"string","pattern":"a","maxLength":3})",
                  "schema.maxLength: not supported together with pattern"},
             Case{R"({"type":"string","pattern":"a","format":"date"})", "schema.format"},
             Case{R"({"type":"integer","exclusiveMinimum":true})",
                  "schema.exclusiveMinimum: must be a number"},
             Case{R"({"type":"integer","minimum":5,"maximum":4})", "schema: no integer"},
             Case{R"({"type":"integer","minimum":1e17})", "schema: no integer"},
             Case{R"({"type":"integer","multipleOf":2})", "schema.multipleOf"},
         }) {
        auto g = CompileJsonSchema(json::parse(c.schema), "schema");
        ASSERT_FALSE(g.ok()) << c.schema;
        EXPECT_EQ(g.status().message().rfind(c.message, 0), 0u) << g.status().message();
    }
}

}  // namespace
}  // namespace kvshard::grammar
