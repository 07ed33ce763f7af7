// Request JSON nested deeper than kMaxJsonDepth is refused before it is parsed (a body of brackets
// 100,000 deep once exhausted a server thread's stack when printed); brackets inside strings do
// not count.
#include <gtest/gtest.h>

#include <string>

#include "coordinator/json_fields.h"

namespace kvshard::json_fields {
namespace {

std::string Nested(int depth) {
    return std::string(static_cast<size_t>(depth), '[') + "1" +
           std::string(static_cast<size_t>(depth), ']');
}

TEST(JsonDepth, CountsArraysAndObjectsNotBracketsInStrings) {
    struct Case {
        const char* text;
        int depth;
    } cases[] = {
        {"1", 0},
        {"\"[[[{{{\"", 0},
        {"[]", 1},
        {"{\"a\": [1, {\"b\": []}]}", 4},
        {"[\"]\", [\"\\\"[\"]]", 2},  // an escaped quote does not end the string
        {"[[], [], [[]]]", 3},
        {"]]]][", 1},  // malformed: closing brackets never go below zero
    };
    for (const Case& c : cases) EXPECT_EQ(JsonNestingDepth(c.text), c.depth) << c.text;
}

TEST(JsonDepth, ParseJsonRefusesOneLevelPastTheLimit) {
    bool too_deep = true;
    nlohmann::json ok = ParseJson(Nested(kMaxJsonDepth), &too_deep);
    EXPECT_FALSE(ok.is_discarded());
    EXPECT_FALSE(too_deep);
    nlohmann::json deep = ParseJson(Nested(kMaxJsonDepth + 1), &too_deep);
    EXPECT_TRUE(deep.is_discarded());
    EXPECT_TRUE(too_deep);
    // 100,000 levels: refused by the scan, which stops counting past the limit.
    EXPECT_TRUE(ParseJson(Nested(100'000), &too_deep).is_discarded());
    EXPECT_TRUE(too_deep);
    // Not JSON at all: discarded, and not for its depth.
    EXPECT_TRUE(ParseJson("{\"a\":", &too_deep).is_discarded());
    EXPECT_FALSE(too_deep);
}

}  // namespace
}  // namespace kvshard::json_fields
