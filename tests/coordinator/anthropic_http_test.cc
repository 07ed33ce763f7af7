// POST /v1/messages and /v1/messages/count_tokens over HTTP, in front of a FakeEngine: the
// answer and the event stream, the breakpoints a request submits (counted in tokens of the
// rendered prompt), the tools prompt and a tool-use round trip, API keys as x-api-key, and
// errors in Anthropic's shape naming the field.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::Post;
using testing::TestServer;
using testing::TestServerOptions;

json Body(json messages, int max_tokens = 4) {
    return {{"model", "test-model"}, {"max_tokens", max_tokens}, {"messages", std::move(messages)}};
}

json User(json content) { return {{"role", "user"}, {"content", std::move(content)}}; }

testing::HttpReply Messages(TestServer& server, const json& body,
                            const std::vector<std::pair<std::string, std::string>>& headers = {
                                {"anthropic-version", "2023-06-01"}}) {
    return Post(server.port(), "/v1/messages", body.dump(), headers);
}

// The data of each "event: <type>\ndata: <json>" event, in order.
std::vector<std::string> EventData(const std::string& body) {
    std::vector<std::string> out;
    size_t pos = 0;
    while (pos < body.size()) {
        size_t end = body.find("\n\n", pos);
        if (end == std::string::npos) end = body.size();
        const std::string event = body.substr(pos, end - pos);
        const size_t data = event.find("\ndata: ");
        EXPECT_EQ(event.rfind("event: ", 0), 0u) << event;
        if (data != std::string::npos) out.push_back(event.substr(data + 7));
        pos = end + 2;
    }
    return out;
}

void ExpectAnthropicError(const testing::HttpReply& reply, int status, const std::string& type,
                          const std::string& field = "") {
    EXPECT_EQ(reply.status, status) << reply.body;
    const json b = json::parse(reply.body);
    EXPECT_EQ(b["type"], "error") << reply.body;
    EXPECT_EQ(b["error"]["type"], type) << reply.body;
    if (!field.empty()) {
        EXPECT_EQ(b["error"]["message"].get<std::string>().rfind(field + ": ", 0), 0u)
            << reply.body;
    }
}

TEST(AnthropicHttp, AMessageAndItsUsage) {
    TestServerOptions o;
    o.engine.cached_tokens = 3;
    TestServer server(o);
    const auto reply = Messages(server, Body({User("Hi")}));
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json b = json::parse(reply.body);
    EXPECT_EQ(b["id"].get<std::string>().rfind("msg_", 0), 0u);
    EXPECT_EQ(b["type"], "message");
    EXPECT_EQ(b["role"], "assistant");
    EXPECT_EQ(b["model"], "test-model");
    EXPECT_EQ(b["content"], json::parse(R"([{"type": "text", "text": "Hello, world!"}])"));
    EXPECT_EQ(b["stop_reason"], "max_tokens");
    ASSERT_EQ(server.engine().submitted().size(), 1u);
    const GenerationRequest g = server.engine().submitted()[0];
    const int64_t prompt = static_cast<int64_t>(g.prompt_token_ids.size());
    EXPECT_EQ(b["usage"]["input_tokens"], prompt - 3);
    EXPECT_EQ(b["usage"]["cache_read_input_tokens"], 3);
    EXPECT_EQ(b["usage"]["cache_creation_input_tokens"], 0);
    EXPECT_EQ(b["usage"]["output_tokens"], 4);
    EXPECT_EQ(g.max_tokens, 4);
    EXPECT_FLOAT_EQ(g.sampling.temperature, 1.0f);
    EXPECT_TRUE(g.cache_breakpoints.empty());
}

TEST(AnthropicHttp, StreamEvents) {
    TestServer server;
    json body = Body({User("Hi")});
    body["stream"] = true;
    const auto reply = Messages(server, body);
    ASSERT_EQ(reply.status, 200) << reply.body;
    EXPECT_EQ(reply.message[boost::beast::http::field::content_type], "text/event-stream");
    std::vector<std::string> types;
    std::string text;
    for (const std::string& data : EventData(reply.body)) {
        const json e = json::parse(data);
        types.push_back(e["type"]);
        if (e["type"] == "content_block_delta") text += e["delta"]["text"].get<std::string>();
    }
    ASSERT_GE(types.size(), 6u);
    EXPECT_EQ(types[0], "message_start");
    EXPECT_EQ(types[1], "ping");
    EXPECT_EQ(types[2], "content_block_start");
    EXPECT_EQ(types[types.size() - 3], "content_block_stop");
    EXPECT_EQ(types[types.size() - 2], "message_delta");
    EXPECT_EQ(types.back(), "message_stop");
    EXPECT_EQ(text, "Hello, world!");
    // Every data line follows an "event:" line naming the same type.
    EXPECT_NE(reply.body.find("event: message_start\ndata: {"), std::string::npos);
}

// A breakpoint counts the prompt tokens up to the end of its block: with a byte tokenizer,
// "<|im_start|>" (one token), "system\n" and the system text.
TEST(AnthropicHttp, CacheControlBecomesBreakpointsInTokens) {
    TestServer server;
    json body = Body({User(
        {{{"type", "text"}, {"text", "doc"}},
         {{"type", "text"}, {"text", "question"}, {"cache_control", {{"type", "ephemeral"}}}}})});
    body["system"] = json::array({{{"type", "text"},
                                   {"text", "You are terse."},
                                   {"cache_control", {{"type", "ephemeral"}, {"ttl", "1h"}}}}});
    ASSERT_EQ(Messages(server, body).status, 200);
    const GenerationRequest g = server.engine().submitted().at(0);
    ASSERT_EQ(g.cache_breakpoints.size(), 2u);
    const int64_t system_end = 1 + 7 + 14;
    EXPECT_EQ(g.cache_breakpoints[0], (CacheBreakpoint{system_end, 3'600'000}));
    // <|im_end|>\n<|im_start|>user\ndoc\nquestion
    EXPECT_EQ(g.cache_breakpoints[1], (CacheBreakpoint{system_end + 2 + 1 + 5 + 12, 300'000}));
    EXPECT_LT(g.cache_breakpoints[1].prefix_tokens,
              static_cast<int64_t>(g.prompt_token_ids.size()));

    // More than four: 400 naming the fifth.
    json five = Body({User(json::array())});
    for (int i = 0; i < 5; ++i) {
        five["messages"][0]["content"].push_back(
            {{"type", "text"}, {"text", "b"}, {"cache_control", {{"type", "ephemeral"}}}});
    }
    ExpectAnthropicError(Messages(server, five), 400, "invalid_request_error",
                         "messages.0.content.4.cache_control");
    json ttl = Body({User({{{"type", "text"},
                            {"text", "b"},
                            {"cache_control", {{"type", "ephemeral"}, {"ttl", "10m"}}}}})});
    ExpectAnthropicError(Messages(server, ttl), 400, "invalid_request_error",
                         "messages.0.content.0.cache_control.ttl");
    EXPECT_EQ(server.engine().submitted().size(), 1u);
}

json WeatherTool() {
    return {
        {"name", "get_weather"},
        {"description", "The weather of a city"},
        {"input_schema", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}};
}

TEST(AnthropicHttp, ToolUseRoundTrip) {
    TestServerOptions o;
    o.engine.script = {"<tool_call>", "\n{\"name\": \"get_weather\", ",
                       "\"arguments\": {\"city\": \"Paris\"}}", "\n</tool_call>"};
    TestServer server(o);
    json body = Body({User("Weather in Paris?")});
    body["tools"] = {WeatherTool()};
    const auto reply = Messages(server, body);
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json b = json::parse(reply.body);
    EXPECT_EQ(b["stop_reason"], "tool_use");
    ASSERT_EQ(b["content"].size(), 1u);
    const json& use = b["content"][0];
    EXPECT_EQ(use["type"], "tool_use");
    EXPECT_EQ(use["name"], "get_weather");
    EXPECT_EQ(use["input"], json({{"city", "Paris"}}));
    EXPECT_EQ(use["id"].get<std::string>().rfind("toolu_", 0), 0u);
    // The tools were in the prompt (Hermes convention, in the system turn).
    const std::vector<int32_t> ids = server.engine().submitted().at(0).prompt_token_ids;
    const std::string prompt(ids.begin(), ids.end());
    EXPECT_NE(prompt.find("<tools>\n{\"function\":{\"description\":\"The weather of a city\""),
              std::string::npos)
        << prompt;

    // The tool's result goes back with the call.
    json next = Body({User("Weather in Paris?"),
                      {{"role", "assistant"}, {"content", b["content"]}},
                      User({{{"type", "tool_result"},
                             {"tool_use_id", use["id"]},
                             {"content", "18 C and sunny"}}})});
    next["tools"] = {WeatherTool()};
    ASSERT_EQ(Messages(server, next).status, 200);
    const std::vector<int32_t> ids2 = server.engine().submitted().at(1).prompt_token_ids;
    const std::string prompt2(ids2.begin(), ids2.end());
    EXPECT_NE(prompt2.find("<tool_response>\n18 C and sunny\n</tool_response>"), std::string::npos);
    EXPECT_NE(prompt2.find("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                           "{\"city\":\"Paris\"}}\n</tool_call>"),
              std::string::npos)
        << prompt2;

    // tool_choice none: no tools in the prompt, and the output stays text.
    body["tool_choice"] = {{"type", "none"}};
    const auto none = Messages(server, body);
    ASSERT_EQ(none.status, 200);
    EXPECT_EQ(json::parse(none.body)["content"][0]["type"], "text");
    const std::vector<int32_t> ids3 = server.engine().submitted().at(2).prompt_token_ids;
    EXPECT_EQ(std::string(ids3.begin(), ids3.end()).find("<tools>"), std::string::npos);

    // A tool_result with no tool_use before it.
    json orphan = Body({User({{{"type", "tool_result"}, {"tool_use_id", "toolu_x"}}})});
    ExpectAnthropicError(Messages(server, orphan), 400, "invalid_request_error",
                         "messages.0.content.0.tool_use_id");
}

TEST(AnthropicHttp, CountTokensIsWhatMessagesSubmits) {
    TestServer server;
    json body = Body({User("How many?")});
    body["system"] = "Count.";
    body["tools"] = {WeatherTool()};
    ASSERT_EQ(Messages(server, body).status, 200);
    const size_t submitted = server.engine().submitted().at(0).prompt_token_ids.size();
    body.erase("max_tokens");
    const auto reply = Post(server.port(), "/v1/messages/count_tokens", body.dump());
    ASSERT_EQ(reply.status, 200) << reply.body;
    EXPECT_EQ(json::parse(reply.body), json({{"input_tokens", submitted}}));
    EXPECT_EQ(server.engine().submitted().size(), 1u);
}

TEST(AnthropicHttp, ApiKeysAndErrorShapes) {
    TestServerOptions o;
    o.http.api_keys = {"sk-ant-test"};
    TestServer server(o);
    const json body = Body({User("Hi")});
    ExpectAnthropicError(Messages(server, body), 401, "authentication_error");
    ExpectAnthropicError(Messages(server, body, {{"x-api-key", "wrong"}}), 401,
                         "authentication_error");
    EXPECT_EQ(Messages(server, body, {{"x-api-key", "sk-ant-test"}}).status, 200);
    EXPECT_EQ(Messages(server, body, {{"Authorization", "Bearer sk-ant-test"}}).status, 200);
    // x-api-key is the Anthropic routes' header only.
    EXPECT_EQ(
        Post(server.port(), "/v1/chat/completions",
             R"({"messages": [{"role": "user", "content": "x"}]})", {{"x-api-key", "sk-ant-test"}})
            .status,
        401);
    const auto missing =
        Messages(server, json{{"messages", {User("Hi")}}}, {{"x-api-key", "sk-ant-test"}});
    ExpectAnthropicError(missing, 400, "invalid_request_error", "max_tokens");
    ExpectAnthropicError(
        Post(server.port(), "/v1/messages/batches", "{}", {{"x-api-key", "sk-ant-test"}}), 404,
        "not_found_error");
    testing::TestClient client(server.port());
    ExpectAnthropicError(client.Send(boost::beast::http::verb::get, "/v1/messages"), 405,
                         "invalid_request_error");
}

}  // namespace
}  // namespace kvshard
