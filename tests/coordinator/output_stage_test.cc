// The engine's output stage: each sampled token's outcome for its choice, without an engine.
#include "coordinator/output_stage.h"

#include <gtest/gtest.h>

#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using testing::ByteTokenizer;

constexpr int32_t kEos = 257;  // ByteTokenizer's <|im_end|>

SampledToken Token(int32_t id) {
    SampledToken t;
    t.seq_id = 1;
    t.token_id = id;
    return t;
}

GenerationRequest Request(int64_t max_tokens, std::vector<std::string> stop = {}) {
    GenerationRequest r;
    r.request_id = "r";
    r.prompt_token_ids = {'h', 'i'};
    r.max_tokens = max_tokens;
    r.stop = std::move(stop);
    return r;
}

TEST(OutputStage, StopTokenEndsTheChoiceWithoutText) {
    auto tok = ByteTokenizer();
    const OutputStage stage({kEos}, 100);
    const GenerationRequest req = Request(10);
    TextStream stream(*tok, {});
    const TokenOutcome out = stage.OnToken(req, 0, Token(kEos), stream, 3, 5);
    EXPECT_FALSE(out.append);
    EXPECT_EQ(out.finish, FinishReason::kStop);
    EXPECT_TRUE(out.delta.text.empty());
    EXPECT_TRUE(out.delta.token_ids.empty());
}

TEST(OutputStage, IgnoreEosMakesTheStopTokenAnOrdinaryOne) {
    auto tok = ByteTokenizer();
    const OutputStage stage({kEos}, 100);
    GenerationRequest req = Request(10);
    req.ignore_eos = true;
    TextStream stream(*tok, {});
    const TokenOutcome out = stage.OnToken(req, 0, Token(kEos), stream, 3, 5);
    EXPECT_TRUE(out.append);
    EXPECT_FALSE(out.finish.has_value());
    EXPECT_EQ(out.delta.token_ids, std::vector<int32_t>{kEos});
}

TEST(OutputStage, RequestStopTokenJoinsTheTextAndEndsTheChoiceEvenWithIgnoreEos) {
    auto tok = ByteTokenizer();
    const OutputStage stage({kEos}, 100);
    GenerationRequest req = Request(10);
    req.ignore_eos = true;
    req.stop_token_ids = {'!'};
    TextStream stream(*tok, {});
    const TokenOutcome first = stage.OnToken(req, 0, Token('o'), stream, 0, 2);
    EXPECT_FALSE(first.finish.has_value());
    const TokenOutcome out = stage.OnToken(req, 0, Token('!'), stream, 1, 3);
    EXPECT_TRUE(out.append);
    EXPECT_EQ(out.finish, FinishReason::kStop);
    EXPECT_EQ(first.delta.text + out.delta.text, "o!");
}

TEST(OutputStage, StopStringIsHeldBackAndEndsTheChoice) {
    auto tok = ByteTokenizer();
    const OutputStage stage({kEos}, 100);
    const GenerationRequest req = Request(10, {"END"});
    TextStream stream(*tok, {"END"});
    std::string text;
    int64_t generated = 0;
    std::optional<FinishReason> finish;
    for (char c : std::string("okEND")) {
        const TokenOutcome out = stage.OnToken(req, 0, Token(c), stream, generated, 2 + generated);
        EXPECT_TRUE(out.append);
        text += out.delta.text;
        generated++;
        if (out.finish) {
            finish = out.finish;
            break;
        }
        // "E" and "EN" may start the stop string: not sent yet.
        if (c == 'E' || c == 'N') {
            EXPECT_TRUE(out.delta.text.empty());
        }
    }
    EXPECT_EQ(finish, FinishReason::kStop);
    EXPECT_EQ(text, "ok");
}

TEST(OutputStage, MaxTokensAndContextEndWithLengthAndFlushTheText) {
    auto tok = ByteTokenizer();
    const OutputStage stage({kEos}, /*max_context=*/8);
    struct Row {
        int64_t max_tokens, generated, tokens;
        bool ends;
    } rows[] = {
        {4, 2, 4, false},  // the 3rd of 4 tokens
        {4, 3, 5, true},   // the 4th of 4
        {20, 5, 6, false}, // the context would hold 7 tokens after this one
        {20, 5, 7, true},  // ... 8: full
    };
    for (const Row& row : rows) {
        SCOPED_TRACE(std::to_string(row.max_tokens) + "/" + std::to_string(row.generated) + "/" +
                     std::to_string(row.tokens));
        const GenerationRequest req = Request(row.max_tokens, {"xyz"});
        TextStream stream(*tok, {"xyz"});
        // 'x' may start the stop string, so it is held back until the choice ends.
        const TokenOutcome out = stage.OnToken(req, 0, Token('x'), stream, row.generated, row.tokens);
        EXPECT_TRUE(out.append);
        EXPECT_EQ(out.finish.has_value(), row.ends);
        if (row.ends) {
            EXPECT_EQ(out.finish, FinishReason::kLength);
            EXPECT_EQ(out.delta.text, "x");
        } else {
            EXPECT_EQ(out.delta.text, "");
        }
    }
}

TEST(OutputStage, LogprobsOnlyWhenAsked) {
    auto tok = ByteTokenizer();
    const OutputStage stage({kEos}, 100);
    GenerationRequest req = Request(10);
    TextStream stream(*tok, {});
    EXPECT_TRUE(stage.OnToken(req, 0, Token('a'), stream, 0, 2).delta.logprobs.empty());
    req.num_top_logprobs = 0;
    EXPECT_EQ(stage.OnToken(req, 1, Token('b'), stream, 1, 3).delta.logprobs.size(), 1u);
    // The wire's token becomes the request's: id, logprob and alternatives, nothing else.
    SampledToken sampled = Token('d');
    sampled.logprob = -0.75f;
    sampled.top_logprobs = {{'d', -0.75f}, {'e', -1.5f}};
    sampled.rng_state = 12345;
    const std::vector<GeneratedTokenLogprob> expected = {
        {'d', -0.75f, {{'d', -0.75f}, {'e', -1.5f}}}};
    EXPECT_EQ(stage.OnToken(req, 1, sampled, stream, 2, 4).delta.logprobs, expected);
    EXPECT_EQ(stage.OnToken(req, 1, Token('c'), stream, 2, 4).delta.index, 1);
}

}  // namespace
}  // namespace kvshard
