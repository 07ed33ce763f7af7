// Prompt logprobs in the OpenAI answer shapes: completions' echo with logprobs (the prompt's
// tokens first, null for the first), non-streamed and streamed, for a list of prompts with n > 1;
// vLLM's prompt_logprobs per completions choice and per chat response.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "coordinator/openai_response.h"
#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::SseData;

// Token id c is the one-character text c.
std::string TokenBytes(int32_t id) { return std::string(1, static_cast<char>(id)); }

ResponseContext EchoContext(int n, std::vector<std::string> prompts) {
    ResponseContext c;
    c.endpoint = ApiEndpoint::kCompletions;
    c.id = "cmpl-1";
    c.model = "smol";
    c.n = n * static_cast<int>(prompts.size());
    c.choices_per_prompt = n;
    c.logprobs = true;
    c.echo_logprobs = true;
    for (const std::string& p : prompts) {
        c.echo.insert(c.echo.end(), n, p);
        c.prompt_token_ids.emplace_back(p.begin(), p.end());
    }
    return c;
}

// The scores of prompt `text`'s tokens 1.. (logprob -i for token i, top: 'z').
GenerationDelta PromptDelta(int index, const std::string& text) {
    GenerationDelta d;
    d.index = index;
    for (size_t i = 1; i < text.size(); ++i) {
        d.prompt_logprobs.push_back({.token_id = text[i],
                                     .logprob = -static_cast<float>(i),
                                     .rank = static_cast<int64_t>(i),
                                     .top = {{'z', -0.5f}}});
    }
    return d;
}

GenerationDelta TokenDelta(int index, char c, FinishReason finish) {
    GenerationDelta d;
    d.index = index;
    d.text = std::string(1, c);
    d.token_ids = {c};
    d.logprobs = {GeneratedTokenLogprob{c, -0.25f, {}}};
    d.finish_reason = finish;
    return d;
}

TEST(PromptLogprobsResponse, EchoLeadsEachChoiceWithItsPrompt) {
    // Two prompts, n = 2: choices 0, 1 answer "ab", choices 2, 3 answer "xyz"; the scores come on
    // each prompt's first choice.
    CompletionAccumulator acc(EchoContext(2, {"ab", "xyz"}), TokenBytes);
    acc.Add(PromptDelta(0, "ab"));
    acc.Add(PromptDelta(2, "xyz"));
    for (int i = 0; i < 4; ++i) acc.Add(TokenDelta(i, '!', FinishReason::kLength));
    const json body = json::parse(acc.Body({}));
    ASSERT_EQ(body["choices"].size(), 4u);
    for (int i = 0; i < 4; ++i) {
        const json& c = body["choices"][i];
        const std::string prompt = i < 2 ? "ab" : "xyz";
        EXPECT_EQ(c["text"], prompt + "!");
        const json& lp = c["logprobs"];
        std::vector<std::string> tokens;
        for (char ch : prompt + "!") tokens.push_back(std::string(1, ch));
        EXPECT_EQ(lp["tokens"], json(tokens)) << i;
        EXPECT_TRUE(lp["token_logprobs"][0].is_null());
        EXPECT_TRUE(lp["top_logprobs"][0].is_null());
        for (size_t k = 1; k < prompt.size(); ++k) {
            EXPECT_EQ(lp["token_logprobs"][k], -static_cast<double>(k));
            EXPECT_EQ(lp["top_logprobs"][k], json({{"z", -0.5}}));
        }
        EXPECT_EQ(lp["token_logprobs"][prompt.size()], -0.25);
        std::vector<int64_t> offsets;
        for (size_t k = 0; k <= prompt.size(); ++k) offsets.push_back(static_cast<int64_t>(k));
        EXPECT_EQ(lp["text_offset"], json(offsets));
        EXPECT_FALSE(c.contains("prompt_logprobs"));
    }
}

TEST(PromptLogprobsResponse, MaxTokensZeroWithAOneTokenPrompt) {
    // Nothing to score: the prompt's one token, null.
    CompletionAccumulator acc(EchoContext(1, {"a"}), TokenBytes);
    GenerationDelta end;
    end.finish_reason = FinishReason::kLength;
    acc.Add(end);
    const json body = json::parse(acc.Body({}));
    const json& lp = body["choices"][0]["logprobs"];
    EXPECT_EQ(lp["tokens"], json({"a"}));
    EXPECT_EQ(lp["token_logprobs"], json::array({nullptr}));
    EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
}

TEST(PromptLogprobsResponse, StreamedEchoSendsThePromptsEntriesFirst) {
    StreamFormatter f(EchoContext(1, {"ab"}), TokenBytes);
    const std::vector<std::string> first = SseData(f.Delta(PromptDelta(0, "ab")));
    ASSERT_EQ(first.size(), 1u);
    const json chunk = json::parse(first[0]);
    EXPECT_EQ(chunk["choices"][0]["text"], "ab");
    EXPECT_EQ(chunk["choices"][0]["logprobs"]["tokens"], json({"a", "b"}));
    EXPECT_EQ(chunk["choices"][0]["logprobs"]["token_logprobs"], json::array({nullptr, -1.0}));
    const json next = json::parse(SseData(f.Delta(TokenDelta(0, '!', FinishReason::kStop)))[0]);
    EXPECT_EQ(next["choices"][0]["text"], "!");
    EXPECT_EQ(next["choices"][0]["logprobs"]["tokens"], json({"!"}));
    EXPECT_EQ(next["choices"][0]["logprobs"]["text_offset"], json({2}));
}

TEST(PromptLogprobsResponse, VllmPromptLogprobsOnCompletionsAndChat) {
    for (ApiEndpoint endpoint : {ApiEndpoint::kCompletions, ApiEndpoint::kChatCompletions}) {
        ResponseContext c;
        c.endpoint = endpoint;
        c.n = 1;
        c.prompt_logprobs = true;
        c.prompt_token_ids = {{'a', 'b', 'c'}};
        CompletionAccumulator acc(c, TokenBytes);
        GenerationDelta d = PromptDelta(0, "abc");
        d.prompt_logprobs[1].top = {{'c', -2.0f}};  // the token among its top: one entry
        acc.Add(d);
        acc.Add(TokenDelta(0, '!', FinishReason::kStop));
        const json body = json::parse(acc.Body({}));
        const json& plp = endpoint == ApiEndpoint::kChatCompletions
                              ? body["prompt_logprobs"]
                              : body["choices"][0]["prompt_logprobs"];
        ASSERT_EQ(plp.size(), 3u);
        EXPECT_TRUE(plp[0].is_null());
        EXPECT_EQ(plp[1],
                  json({{"98", {{"logprob", -1.0}, {"rank", 1}, {"decoded_token", "b"}}},
                        {"122", {{"logprob", -0.5}, {"rank", 1}, {"decoded_token", "z"}}}}));
        EXPECT_EQ(plp[2], json({{"99", {{"logprob", -2.0}, {"rank", 2}, {"decoded_token", "c"}}}}));
    }
}

}  // namespace
}  // namespace kvshard
