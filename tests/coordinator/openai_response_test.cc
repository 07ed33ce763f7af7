// Response bodies and SSE chunks in the OpenAI shapes.
#include "coordinator/openai_response.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::SseData;

std::string TokenBytes(int32_t id) {
    if (id == 0xC3) return "\xC3";  // half a character
    return std::string(1, static_cast<char>(id));
}

ResponseContext Context(ApiEndpoint endpoint, int n = 1, bool logprobs = false,
                        bool include_usage = false) {
    ResponseContext c;
    c.endpoint = endpoint;
    c.id = endpoint == ApiEndpoint::kCompletions ? "cmpl-1" : "chatcmpl-1";
    c.created = 1700000000;
    c.model = "smol";
    c.n = n;
    c.logprobs = logprobs;
    c.include_usage = include_usage;
    return c;
}

GenerationDelta Delta(int index, std::string text, std::vector<int32_t> ids,
                      std::optional<FinishReason> finish = std::nullopt) {
    GenerationDelta d;
    d.index = index;
    d.text = std::move(text);
    d.token_ids = std::move(ids);
    d.finish_reason = finish;
    return d;
}

GeneratedTokenLogprob Token(int32_t id, float lp, std::vector<TokenLogprob> top = {}) {
    return {id, lp, std::move(top)};
}

const GenerationUsage kUsage{7, 3, 4};

TEST(OpenAiResponse, CompletionBody) {
    CompletionAccumulator acc(Context(ApiEndpoint::kCompletions, 2), TokenBytes);
    acc.Add(Delta(0, "He", {'H', 'e'}));
    acc.Add(Delta(1, "Yo", {'Y'}, FinishReason::kStop));
    acc.Add(Delta(0, "y", {'y'}, FinishReason::kLength));
    const json b = json::parse(acc.Body(kUsage));
    EXPECT_EQ(b["id"], "cmpl-1");
    EXPECT_EQ(b["object"], "text_completion");
    EXPECT_EQ(b["created"], 1700000000);
    EXPECT_EQ(b["model"], "smol");
    ASSERT_EQ(b["choices"].size(), 2u);
    EXPECT_EQ(b["choices"][0]["index"], 0);
    EXPECT_EQ(b["choices"][0]["text"], "Hey");
    EXPECT_EQ(b["choices"][0]["finish_reason"], "length");
    EXPECT_TRUE(b["choices"][0]["logprobs"].is_null());
    EXPECT_EQ(b["choices"][1]["text"], "Yo");
    EXPECT_EQ(b["choices"][1]["finish_reason"], "stop");
    EXPECT_EQ(b["usage"]["prompt_tokens"], 7);
    EXPECT_EQ(b["usage"]["completion_tokens"], 3);
    EXPECT_EQ(b["usage"]["total_tokens"], 10);
    EXPECT_EQ(b["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
}

TEST(OpenAiResponse, ChatBodyWithLogprobs) {
    CompletionAccumulator acc(Context(ApiEndpoint::kChatCompletions, 1, true), TokenBytes);
    GenerationDelta d = Delta(0, "Hi", {'H', 'i'}, FinishReason::kStop);
    d.logprobs = {Token('H', -0.25f, {{'H', -0.25f}, {'A', -2.0f}}),
                  Token('i', -std::numeric_limits<float>::infinity())};
    acc.Add(d);
    const json b = json::parse(acc.Body(kUsage));
    EXPECT_EQ(b["object"], "chat.completion");
    const json& c = b["choices"][0];
    EXPECT_EQ(c["message"]["role"], "assistant");
    EXPECT_EQ(c["message"]["content"], "Hi");
    EXPECT_EQ(c["finish_reason"], "stop");
    const json& content = c["logprobs"]["content"];
    ASSERT_EQ(content.size(), 2u);
    EXPECT_EQ(content[0]["token"], "H");
    EXPECT_DOUBLE_EQ(content[0]["logprob"].get<double>(), -0.25);
    EXPECT_EQ(content[0]["bytes"], json::array({72}));
    ASSERT_EQ(content[0]["top_logprobs"].size(), 2u);
    EXPECT_EQ(content[0]["top_logprobs"][1]["token"], "A");
    EXPECT_DOUBLE_EQ(content[0]["top_logprobs"][1]["logprob"].get<double>(), -2.0);
    EXPECT_DOUBLE_EQ(content[1]["logprob"].get<double>(), -9999.0);  // -inf as the API writes it
}

TEST(OpenAiResponse, CompletionLogprobsShapeAndOffsets) {
    CompletionAccumulator acc(Context(ApiEndpoint::kCompletions, 1, true), TokenBytes);
    GenerationDelta d = Delta(0, "ab\xC3", {'a', 'b', 0xC3}, FinishReason::kLength);
    d.text = "ab";
    d.logprobs = {Token('a', -1.0f, {{'a', -1.0f}}), Token('b', -2.0f, {{'b', -2.0f}}),
                  Token(0xC3, -3.0f)};
    acc.Add(d);
    const json lp = json::parse(acc.Body(kUsage))["choices"][0]["logprobs"];
    EXPECT_EQ(lp["tokens"], json::array({"a", "b", "\xEF\xBF\xBD"}));  // half a char -> U+FFFD
    EXPECT_EQ(lp["token_logprobs"], json::array({-1.0, -2.0, -3.0}));
    EXPECT_EQ(lp["top_logprobs"][0], json({{"a", -1.0}}));
    EXPECT_EQ(lp["text_offset"], json::array({0, 1, 2}));
}

TEST(OpenAiResponse, CompletionStream) {
    StreamFormatter f(Context(ApiEndpoint::kCompletions, 1, false, true), TokenBytes);
    std::string out = f.Start();
    EXPECT_EQ(out, "");
    out += f.Delta(Delta(0, "He", {'H', 'e'}));
    EXPECT_EQ(f.Delta(Delta(0, "", {'x'})), "");  // nothing visible: no event
    out += f.Delta(Delta(0, "y", {'y'}, FinishReason::kLength));
    out += f.Finish(kUsage);
    const std::vector<std::string> data = SseData(out);
    ASSERT_EQ(data.size(), 4u);
    const json c0 = json::parse(data[0]);
    EXPECT_EQ(c0["object"], "text_completion");
    EXPECT_EQ(c0["id"], "cmpl-1");
    EXPECT_EQ(c0["choices"][0]["text"], "He");
    EXPECT_TRUE(c0["choices"][0]["finish_reason"].is_null());
    EXPECT_TRUE(c0["usage"].is_null());
    EXPECT_TRUE(c0.contains("usage"));
    EXPECT_EQ(json::parse(data[1])["choices"][0]["finish_reason"], "length");
    const json usage = json::parse(data[2]);
    EXPECT_TRUE(usage["choices"].empty());
    EXPECT_EQ(usage["usage"]["total_tokens"], 10);
    EXPECT_EQ(data[3], "[DONE]");
    // Framing: every event is "data: ...\n\n".
    EXPECT_EQ(out.substr(0, 6), "data: ");
    EXPECT_EQ(out.substr(out.size() - 14), "data: [DONE]\n\n");
}

TEST(OpenAiResponse, ChatStreamOpensEveryChoiceWithTheRole) {
    StreamFormatter f(Context(ApiEndpoint::kChatCompletions, 2, true), TokenBytes);
    std::string out = f.Start();
    GenerationDelta d = Delta(1, "Hi", {'H'});
    d.logprobs = {Token('H', -0.5f)};
    out += f.Delta(d);
    out += f.Delta(Delta(0, "", {}, FinishReason::kStop));
    out += f.Finish(kUsage);
    const std::vector<std::string> data = SseData(out);
    ASSERT_EQ(data.size(), 5u);
    for (int i = 0; i < 2; ++i) {
        const json c = json::parse(data[i]);
        EXPECT_EQ(c["object"], "chat.completion.chunk");
        EXPECT_EQ(c["choices"][0]["index"], i);
        EXPECT_EQ(c["choices"][0]["delta"]["role"], "assistant");
        EXPECT_FALSE(c.contains("usage"));  // include_usage off
    }
    const json c2 = json::parse(data[2]);
    EXPECT_EQ(c2["choices"][0]["delta"]["content"], "Hi");
    EXPECT_EQ(c2["choices"][0]["logprobs"]["content"][0]["token"], "H");
    const json c3 = json::parse(data[3]);
    EXPECT_EQ(c3["choices"][0]["delta"], json::object());
    EXPECT_EQ(c3["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(data[4], "[DONE]");  // no usage chunk without include_usage
}

// The role chunks wait for the first generated text (vLLM sends them with its first output): a
// client timing the first event measures time to first token, not the time to accept.
TEST(OpenAiResponse, ChatRoleComesWithTheFirstToken) {
    StreamFormatter f(Context(ApiEndpoint::kChatCompletions, 2, false), TokenBytes);
    EXPECT_EQ(f.Start(), "");
    EXPECT_EQ(f.Delta(Delta(0, "", {'x'})), "");  // a token with no text yet: still nothing
    const std::vector<std::string> data = SseData(f.Delta(Delta(1, "Hi", {'H'})));
    ASSERT_EQ(data.size(), 3u);
    EXPECT_EQ(json::parse(data[0])["choices"][0]["delta"],
              json({{"role", "assistant"}, {"content", ""}}));
    EXPECT_EQ(json::parse(data[1])["choices"][0]["index"], 1);
    EXPECT_EQ(json::parse(data[2])["choices"][0]["delta"]["content"], "Hi");
    // Once only.
    EXPECT_EQ(SseData(f.Delta(Delta(0, "Ho", {'H'}))).size(), 1u);
    // A stream that ends before any text still opens with the role.
    StreamFormatter empty(Context(ApiEndpoint::kChatCompletions, 1, false), TokenBytes);
    const std::vector<std::string> end = SseData(empty.Finish(kUsage));
    ASSERT_EQ(end.size(), 2u);
    EXPECT_EQ(json::parse(end[0])["choices"][0]["delta"]["role"], "assistant");
    EXPECT_EQ(end[1], "[DONE]");
}

TEST(OpenAiResponse, StreamError) {
    StreamFormatter f(Context(ApiEndpoint::kCompletions), TokenBytes);
    const std::vector<std::string> data = SseData(f.Error(BadRequest("boom")));
    ASSERT_EQ(data.size(), 2u);
    EXPECT_EQ(json::parse(data[0])["error"]["message"], "boom");
    EXPECT_EQ(data[1], "[DONE]");
}

}  // namespace
}  // namespace kvshard
