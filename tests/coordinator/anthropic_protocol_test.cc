// Anthropic Messages requests: what a body becomes (messages, tool calls and results, cache
// marks, tools, sampling), and the 400s, each naming its field, for what kvshard refuses.
#include "coordinator/anthropic_protocol.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

namespace kvshard {
namespace {

using nlohmann::json;

const ServedModel kModel{"m", "/models/m.gguf", 300};

AnthropicRequest Parse(const json& body, AnthropicEndpoint e = AnthropicEndpoint::kMessages) {
    auto r = ParseAnthropicRequest(e, body.dump(), kModel);
    if (auto* error = std::get_if<ApiError>(&r)) {
        ADD_FAILURE() << body.dump() << " -> " << error->message;
        return {};
    }
    return std::get<AnthropicRequest>(r);
}

ApiError Error(const json& body, AnthropicEndpoint e = AnthropicEndpoint::kMessages) {
    auto r = ParseAnthropicRequest(e, body.dump(), kModel);
    if (auto* error = std::get_if<ApiError>(&r)) return *error;
    ADD_FAILURE() << body.dump() << " was accepted";
    return {};
}

json Body(json messages) {
    return {{"model", "m"}, {"max_tokens", 16}, {"messages", std::move(messages)}};
}

json User(json content) { return {{"role", "user"}, {"content", std::move(content)}}; }

TEST(AnthropicRequest, SystemTextBlocksAndSampling) {
    json body = Body({User("Hi"), {{"role", "assistant"}, {"content", "Hello"}}, User("Again")});
    body["system"] = json::array(
        {{{"type", "text"}, {"text", "Be brief."}}, {{"type", "text"}, {"text", "Be kind."}}});
    body["temperature"] = 0.5;
    body["top_p"] = 0.9;
    body["top_k"] = 40;
    body["stop_sequences"] = {"END"};
    body["stream"] = true;
    body["metadata"] = {{"user_id", "u-1"}};
    const AnthropicRequest r = Parse(body);
    ASSERT_EQ(r.messages.size(), 4u);
    EXPECT_EQ(r.messages[0].role, "system");
    EXPECT_EQ(r.messages[0].content, "Be brief.\nBe kind.");
    EXPECT_EQ(r.messages[1].content, "Hi");
    EXPECT_EQ(r.messages[2].role, "assistant");
    EXPECT_EQ(r.max_tokens, 16);
    EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
    EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
    EXPECT_EQ(r.sampling.top_k, 40);
    EXPECT_EQ(r.stop_sequences, std::vector<std::string>{"END"});
    EXPECT_TRUE(r.stream);
    // Anthropic's temperature default.
    EXPECT_FLOAT_EQ(Parse(Body({User("x")})).sampling.temperature, 1.0f);
}

TEST(AnthropicRequest, ToolUseAndToolResultBecomeCallsAndToolMessages) {
    json body =
        Body({User("Weather in Paris?"),
              {{"role", "assistant"},
               {"content",
                {{{"type", "text"}, {"text", "Checking."}},
                 {{"type", "tool_use"},
                  {"id", "toolu_1"},
                  {"name", "get_weather"},
                  {"input", {{"city", "Paris"}}}}}}},
              User({{{"type", "tool_result"}, {"tool_use_id", "toolu_1"}, {"content", "18 C"}},
                    {{"type", "text"}, {"text", "Thanks"}}})});
    body["tools"] = {{{"name", "get_weather"},
                      {"description", "Weather"},
                      {"input_schema", {{"type", "object"}}}}};
    body["tool_choice"] = {{"type", "tool"}, {"name", "get_weather"}};
    const AnthropicRequest r = Parse(body);
    ASSERT_EQ(r.messages.size(), 4u);
    EXPECT_EQ(r.messages[1].content, "Checking.");
    ASSERT_EQ(r.messages[1].tool_calls.size(), 1u);
    EXPECT_EQ(r.messages[1].tool_calls[0].id, "toolu_1");
    EXPECT_EQ(r.messages[1].tool_calls[0].name, "get_weather");
    EXPECT_EQ(json::parse(r.messages[1].tool_calls[0].arguments), json({{"city", "Paris"}}));
    EXPECT_EQ(r.messages[2].role, "tool");
    EXPECT_EQ(r.messages[2].tool_call_id, "toolu_1");
    EXPECT_EQ(r.messages[2].content, "18 C");
    EXPECT_EQ(r.messages[3].role, "user");
    EXPECT_EQ(r.messages[3].content, "Thanks");
    ASSERT_EQ(r.tools.size(), 1u);
    EXPECT_EQ(json::parse(r.tools[0].parameters), json({{"type", "object"}}));
    EXPECT_EQ(r.tool_choice.mode, ToolChoiceMode::kNamed);
    EXPECT_EQ(r.tool_choice.name, "get_weather");
}

TEST(AnthropicRequest, CacheControlMarksTheEndOfItsBlock) {
    json body = Body({User({{{"type", "text"}, {"text", "doc"}},
                            {{"type", "text"},
                             {"text", "question"},
                             {"cache_control", {{"type", "ephemeral"}, {"ttl", "1h"}}}}})});
    body["system"] = json::array(
        {{{"type", "text"}, {"text", "sys"}, {"cache_control", {{"type", "ephemeral"}}}}});
    body["tools"] = {{{"name", "t"},
                      {"input_schema", {{"type", "object"}}},
                      {"cache_control", {{"type", "ephemeral"}}}}};
    const AnthropicRequest r = Parse(body);
    EXPECT_EQ(r.num_cache_breakpoints, 3);
    ASSERT_EQ(r.messages[0].cache_marks.size(), 1u);
    EXPECT_EQ(r.messages[0].cache_marks[0].content_end, 3u);
    EXPECT_EQ(r.messages[0].cache_marks[0].ttl_ms, kCacheTtl5mMs);
    ASSERT_EQ(r.messages[1].cache_marks.size(), 1u);
    EXPECT_EQ(r.messages[1].content, "doc\nquestion");
    EXPECT_EQ(r.messages[1].cache_marks[0].content_end, r.messages[1].content.size());
    EXPECT_EQ(r.messages[1].cache_marks[0].ttl_ms, kCacheTtl1hMs);
    EXPECT_EQ(r.tools[0].cache_ttl_ms, kCacheTtl5mMs);
}

// Each mistake is a 400 whose message starts with the field it is about.
TEST(AnthropicRequest, ErrorsNameTheField) {
    const json ok = Body({User("x")});
    struct Case {
        json body;
        std::string param;
    };
    json no_max = ok;
    no_max.erase("max_tokens");
    json orphan =
        Body({User({{{"type", "tool_result"}, {"tool_use_id", "toolu_9"}, {"content", "r"}}})});
    json five = Body({User(json::array())});
    for (int i = 0; i < 5; ++i) {
        five["messages"][0]["content"].push_back(
            {{"type", "text"}, {"text", "b"}, {"cache_control", {{"type", "ephemeral"}}}});
    }
    json ttl = Body({User({{{"type", "text"},
                            {"text", "b"},
                            {"cache_control", {{"type", "ephemeral"}, {"ttl", "2h"}}}}})});
    json cc_type = Body(
        {User({{{"type", "text"}, {"text", "b"}, {"cache_control", {{"type", "persistent"}}}}})});
    json image = Body({User({{{"type", "image"}, {"source", json::object()}}})});
    json prefill = Body({User("x"), {{"role", "assistant"}, {"content", "{"}}});
    json role = Body({{{"role", "system"}, {"content", "x"}}});
    json temperature = ok;
    temperature["temperature"] = 1.5;
    json choice = ok;
    choice["tool_choice"] = {{"type", "any"}};
    json server_tool = ok;
    server_tool["tools"] = {{{"type", "web_search_20250305"}, {"name", "web_search"}}};
    json thinking = ok;
    thinking["thinking"] = {{"type", "enabled"}, {"budget_tokens", 1024}};
    json metadata = ok;
    metadata["metadata"] = {{"session", "s"}};
    json schema = ok;
    schema["tools"] = {{{"name", "t"}}};
    const Case cases[] = {
        {no_max, "max_tokens"},
        {orphan, "messages.0.content.0.tool_use_id"},
        {five, "messages.0.content.4.cache_control"},
        {ttl, "messages.0.content.0.cache_control.ttl"},
        {cc_type, "messages.0.content.0.cache_control.type"},
        {image, "messages.0.content.0.type"},
        {prefill, "messages.1.role"},
        {role, "messages.0.role"},
        {temperature, "temperature"},
        {choice, "tool_choice"},
        {server_tool, "tools.0.type"},
        {thinking, "thinking"},
        {metadata, "metadata.session"},
        {schema, "tools.0.input_schema"},
        {json::object(), "messages"},
    };
    for (const Case& c : cases) {
        json body = c.body;
        if (c.param == "messages" && !body.contains("max_tokens")) body["max_tokens"] = 1;
        const ApiError e = Error(body);
        EXPECT_EQ(e.http_status, 400) << body.dump();
        EXPECT_EQ(e.param, c.param) << body.dump() << " -> " << e.message;
        EXPECT_EQ(e.message.rfind(c.param + ": ", 0), 0u) << e.message;
    }
    // The Anthropic error body.
    const json b = json::parse(AnthropicErrorBody(Error(no_max)));
    EXPECT_EQ(b["type"], "error");
    EXPECT_EQ(b["error"]["type"], "invalid_request_error");
    EXPECT_EQ(b["error"]["message"], "max_tokens: Field required");
}

TEST(AnthropicRequest, ToolResultMustAnswerTheMessageBefore) {
    // The tool_use is two messages back: not an answer to it.
    const json body = Body(
        {User("q"),
         {{"role", "assistant"},
          {"content",
           {{{"type", "tool_use"}, {"id", "toolu_1"}, {"name", "t"}, {"input", json::object()}}}}},
         User({{{"type", "tool_result"}, {"tool_use_id", "toolu_1"}}}),
         {{"role", "assistant"}, {"content", "ok"}},
         User({{{"type", "tool_result"}, {"tool_use_id", "toolu_1"}}})});
    EXPECT_EQ(Error(body).param, "messages.4.content.0.tool_use_id");
}

TEST(AnthropicRequest, BodiesThatAreNotJsonAndTheModel) {
    for (std::string_view bad : {std::string_view("{"), std::string_view("[1]"),
                                 std::string_view("{\"a\":1}\0x", 9), std::string_view("\xff")}) {
        auto r = ParseAnthropicRequest(AnthropicEndpoint::kMessages, bad, kModel);
        ASSERT_TRUE(std::holds_alternative<ApiError>(r));
        EXPECT_EQ(std::get<ApiError>(r).http_status, 400);
    }
    json other = Body({User("x")});
    other["model"] = "claude-sonnet-4-5";
    const ApiError e = Error(other);
    EXPECT_EQ(e.http_status, 404);
    EXPECT_EQ(json::parse(AnthropicErrorBody(e))["error"]["type"], "not_found_error");
}

TEST(AnthropicRequest, CountTokensNeedsNoMaxTokens) {
    const json body = {{"model", "m"}, {"messages", {User("x")}}};
    EXPECT_EQ(Parse(body, AnthropicEndpoint::kCountTokens).messages.size(), 1u);
    EXPECT_EQ(Error(body).param, "max_tokens");
}

TEST(AnthropicErrorType, ByStatus) {
    EXPECT_EQ(AnthropicErrorType(400), "invalid_request_error");
    EXPECT_EQ(AnthropicErrorType(401), "authentication_error");
    EXPECT_EQ(AnthropicErrorType(404), "not_found_error");
    EXPECT_EQ(AnthropicErrorType(413), "request_too_large");
    EXPECT_EQ(AnthropicErrorType(429), "rate_limit_error");
    EXPECT_EQ(AnthropicErrorType(503), "overloaded_error");
    EXPECT_EQ(AnthropicErrorType(500), "api_error");
}

}  // namespace
}  // namespace kvshard
