// OpenAI's Responses API (POST /v1/responses): the request read into a chat request, refusals by
// name, the answer's shape whole and streamed, and the route end to end in front of a FakeEngine.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "coordinator/responses_protocol.h"
#include "coordinator/responses_response.h"
#include "grammar/grammar.h"
#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::Post;
using testing::TestServer;

const ServedModel kModel{"smol", "/models/SmolLM2.gguf", 1000};

ResponsesRequest ParseOk(const std::string& body) {
    auto r = ParseResponsesRequest(body, kModel);
    if (auto* e = std::get_if<ApiError>(&r)) {
        ADD_FAILURE() << body << " -> " << e->message;
        return {};
    }
    return std::get<ResponsesRequest>(r);
}

TEST(ResponsesProtocol, InputBecomesChatMessages) {
    ResponsesRequest r = ParseOk(
        R"({"model": "smol", "input": "Tell a story", "instructions": "Be brief.",
            "max_output_tokens": 20, "temperature": 0.7, "top_p": 0.9, "stream": true,
            "metadata": {"k": "v"}, "user": "u1", "store": false})");
    EXPECT_EQ(r.chat.endpoint, ApiEndpoint::kChatCompletions);
    ASSERT_EQ(r.chat.messages.size(), 2u);
    EXPECT_EQ(r.chat.messages[0].role, "system");
    EXPECT_EQ(r.chat.messages[0].content, "Be brief.");
    EXPECT_EQ(r.chat.messages[1].role, "user");
    EXPECT_EQ(r.chat.messages[1].content, "Tell a story");
    EXPECT_EQ(r.chat.max_tokens, 20);
    EXPECT_FLOAT_EQ(r.chat.sampling.temperature, 0.7f);
    EXPECT_FLOAT_EQ(r.chat.sampling.top_p, 0.9f);
    EXPECT_TRUE(r.chat.stream);
    EXPECT_EQ(r.chat.n, 1);
    EXPECT_DOUBLE_EQ(r.temperature, 0.7);
    EXPECT_EQ(r.metadata, R"({"k":"v"})");
    EXPECT_EQ(r.user, "u1");

    r = ParseOk(R"({"input": [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
        {"role": "user", "content": "d"}]})");
    ASSERT_EQ(r.chat.messages.size(), 4u);
    EXPECT_EQ(r.chat.messages[0].role, "system");
    EXPECT_EQ(r.chat.messages[1].content, "a\nb");
    EXPECT_EQ(r.chat.messages[2].role, "assistant");
    EXPECT_EQ(r.chat.messages[2].content, "c");
    EXPECT_FALSE(r.chat.max_tokens.has_value());
    EXPECT_FLOAT_EQ(r.chat.sampling.temperature, 1.0f);
    // vLLM's sampling extensions mean what they mean on the chat route.
    r = ParseOk(R"({"input": "x", "top_k": 5, "seed": 3, "text": {"format": {"type": "text"}},
                    "tool_choice": "auto", "tools": [], "truncation": "disabled"})");
    EXPECT_EQ(r.chat.sampling.top_k, 5);
    EXPECT_TRUE(r.chat.has_seed);
}

// text.format json_schema / json_object: the text is held to the grammar, as chat's
// response_format holds it; the format is echoed in the response object.
TEST(ResponsesProtocol, TextFormatHoldsTheOutputToTheSchema) {
    auto accepts = [](const ResponsesRequest& r, const std::string& text) {
        grammar::GrammarState s(r.chat.grammar);
        return s.AdvanceBytes(text) && s.CanEnd();
    };
    ResponsesRequest r = ParseOk(R"({"input": "x", "text": {"format": {"type": "json_schema",
        "name": "pick", "strict": true, "schema": {"type": "object", "properties":
        {"c": {"enum": ["red", "blue"]}}, "required": ["c"], "additionalProperties": false}}}})");
    ASSERT_NE(r.chat.grammar, nullptr);
    EXPECT_TRUE(accepts(r, R"({"c": "red"})"));
    EXPECT_FALSE(accepts(r, R"({"c": "green"})"));
    EXPECT_EQ(json::parse(r.text_format)["name"], "pick");
    r = ParseOk(R"({"input": "x", "text": {"format": {"type": "json_object"}}})");
    ASSERT_NE(r.chat.grammar, nullptr);
    EXPECT_TRUE(accepts(r, R"({"a": [1, 2]})"));
    EXPECT_FALSE(accepts(r, "[1]"));
    r = ParseOk(R"({"input": "x", "text": {"format": {"type": "text"}}})");
    EXPECT_EQ(r.chat.grammar, nullptr);
    // vLLM's extensions mean what they mean on chat.
    r = ParseOk(R"({"input": "x", "guided_choice": ["yes", "no"]})");
    ASSERT_NE(r.chat.grammar, nullptr);
    EXPECT_TRUE(accepts(r, "no"));

    ResponsesContext c;
    c.text_format = R"({"type":"json_object"})";
    ResponsesResponseWriter w(c);
    EXPECT_EQ(json::parse(w.Body(GenerationUsage{}))["text"]["format"]["type"], "json_object");
}

TEST(ResponsesProtocol, RefusesWhatItCannotDoByName) {
    struct Case {
        std::string body;
        int status;
        std::string param;
    };
    const Case cases[] = {
        {"{", 400, ""},
        {"[1]", 400, ""},
        {R"({})", 400, "input"},
        {R"({"input": 5})", 400, "input"},
        {R"({"input": []})", 400, "input"},
        {R"({"input": "x", "model": "gpt-5"})", 404, "model"},
        {R"({"input": [{"role": "tool", "content": "x"}]})", 400, "input[0].role"},
        {R"({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]})", 400,
         "input[0].type"},
        {R"({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]})",
         400, "input[0].content[0].type"},
        {R"({"input": "x", "tools": [{"type": "web_search"}]})", 400, "tools"},
        {R"({"input": "x", "previous_response_id": "resp_1"})", 400, "previous_response_id"},
        {R"({"input": "x", "conversation": "conv_1"})", 400, "conversation"},
        {R"({"input": "x", "store": true})", 400, "store"},
        {R"({"input": "x", "background": true})", 400, "background"},
        {R"({"input": "x", "include": ["message.output_text.logprobs"]})", 400, "include"},
        {R"({"input": "x", "reasoning": {"effort": "high"}})", 400, "reasoning"},
        {R"({"input": "x", "top_logprobs": 2})", 400, "top_logprobs"},
        {R"({"input": "x", "truncation": "auto"})", 400, "truncation"},
        {R"({"input": "x", "text": {"format": {"type": "xml"}}})", 400, "text.format.type"},
        {R"({"input": "x", "text": {"format": "json"}})", 400, "text.format"},
        {R"({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema":
            {"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}}}}})",
         400, "text.format.schema"},
        {R"({"input": "x", "guided_regex": "a+", "text": {"format": {"type": "json_object"}}})",
         400, "text.format"},
        {R"({"input": "x", "tool_choice": "required"})", 400, "tool_choice"},
        {R"({"input": "x", "max_output_tokens": 0})", 400, "max_output_tokens"},
        {R"({"input": "x", "max_tokens": 5})", 400, "max_tokens"},
        {R"({"input": "x", "n": 2})", 400, "n"},
        {R"({"input": "x", "temperature": 3})", 400, "temperature"},
        {R"({"input": "x", "guided_regex": "(a)\\1"})", 400, "guided_regex"},
        {R"({"input": "x", "stream_options": {"include_obfuscation": true}})", 400,
         "stream_options.include_obfuscation"},
        {R"({"input": "x", "metadata": {"k": 1}})", 400, "metadata.k"},
    };
    for (const Case& c : cases) {
        auto r = ParseResponsesRequest(c.body, kModel);
        ASSERT_TRUE(std::holds_alternative<ApiError>(r)) << c.body;
        const ApiError& e = std::get<ApiError>(r);
        EXPECT_EQ(e.http_status, c.status) << c.body << " -> " << e.message;
        EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.message;
        if (!c.param.empty() && c.status == 400) {
            EXPECT_NE(e.message.find(c.param.substr(0, c.param.find('['))), std::string::npos)
                << c.body << " -> " << e.message;
        }
    }
}

ResponsesContext Context() {
    ResponsesContext c;
    c.id = "resp_1";
    c.message_id = "msg_1";
    c.created_at = 1700000000;
    c.model = "smol";
    c.max_output_tokens = 3;
    c.instructions = "Be brief.";
    return c;
}

GenerationDelta Delta(const std::string& text, std::optional<FinishReason> finish = {}) {
    GenerationDelta d;
    d.text = text;
    d.token_ids = {1};
    d.finish_reason = finish;
    return d;
}

TEST(ResponsesResponse, WholeAnswer) {
    ResponsesResponseWriter w(Context());
    w.Add(Delta("Hello"));
    w.Add(Delta(" world", FinishReason::kStop));
    const json b = json::parse(w.Body({7, 2, 4, 0}));
    EXPECT_EQ(b["id"], "resp_1");
    EXPECT_EQ(b["object"], "response");
    EXPECT_EQ(b["status"], "completed");
    EXPECT_TRUE(b["incomplete_details"].is_null());
    EXPECT_EQ(b["instructions"], "Be brief.");
    EXPECT_EQ(b["max_output_tokens"], 3);
    ASSERT_EQ(b["output"].size(), 1u);
    const json& m = b["output"][0];
    EXPECT_EQ(m["type"], "message");
    EXPECT_EQ(m["id"], "msg_1");
    EXPECT_EQ(m["role"], "assistant");
    EXPECT_EQ(m["status"], "completed");
    EXPECT_EQ(m["content"][0]["type"], "output_text");
    EXPECT_EQ(m["content"][0]["text"], "Hello world");
    EXPECT_EQ(b["usage"]["input_tokens"], 7);
    EXPECT_EQ(b["usage"]["output_tokens"], 2);
    EXPECT_EQ(b["usage"]["total_tokens"], 9);
    EXPECT_EQ(b["usage"]["input_tokens_details"]["cached_tokens"], 4);
    EXPECT_EQ(b["store"], false);

    ResponsesResponseWriter cut(Context());
    cut.Add(Delta("abc", FinishReason::kLength));
    const json i = json::parse(cut.Body({1, 3, 0, 0}));
    EXPECT_EQ(i["status"], "incomplete");
    EXPECT_EQ(i["incomplete_details"]["reason"], "max_output_tokens");
    EXPECT_EQ(i["output"][0]["status"], "incomplete");
}

// Server-sent events: "event: <type>" and its data, whose type matches, in order.
std::vector<json> Events(const std::string& bytes) {
    std::vector<json> out;
    size_t pos = 0;
    while (pos < bytes.size()) {
        const size_t end = bytes.find("\n\n", pos);
        const std::string e = bytes.substr(pos, end - pos);
        pos = end + 2;
        const size_t nl = e.find('\n');
        EXPECT_EQ(e.substr(0, 7), "event: ");
        EXPECT_EQ(e.substr(nl + 1, 6), "data: ");
        json data = json::parse(e.substr(nl + 7));
        EXPECT_EQ(data["type"], e.substr(7, nl - 7));
        out.push_back(std::move(data));
    }
    return out;
}

TEST(ResponsesResponse, StreamEventSequence) {
    ResponsesResponseWriter w(Context());
    std::string bytes = w.StreamStart();
    EXPECT_EQ(Events(bytes).size(), 2u);  // created and in_progress at once
    bytes += w.StreamDelta(Delta("Hel"));
    EXPECT_EQ(w.StreamDelta(Delta("")), "");
    bytes += w.StreamDelta(Delta("lo", FinishReason::kStop));
    bytes += w.StreamFinish({5, 2, 0, 0});
    const std::vector<json> events = Events(bytes);
    const std::vector<std::string> expect = {
        "response.created",          "response.in_progress",     "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"};
    ASSERT_EQ(events.size(), expect.size()) << bytes;
    for (size_t i = 0; i < events.size(); ++i) {
        EXPECT_EQ(events[i]["type"], expect[i]);
        EXPECT_EQ(events[i]["sequence_number"], i);
    }
    EXPECT_EQ(events[0]["response"]["status"], "in_progress");
    EXPECT_TRUE(events[0]["response"]["output"].empty());
    EXPECT_EQ(events[4]["delta"], "Hel");
    EXPECT_EQ(events[4]["item_id"], "msg_1");
    EXPECT_EQ(events[6]["text"], "Hello");
    EXPECT_EQ(events[9]["response"]["output"][0]["content"][0]["text"], "Hello");
    EXPECT_EQ(events[9]["response"]["usage"]["output_tokens"], 2);

    ResponsesResponseWriter cut(Context());
    std::string cut_bytes = cut.StreamDelta(Delta("a", FinishReason::kLength));
    cut_bytes += cut.StreamFinish({1, 1, 0, 0});
    const std::vector<json> end = Events(cut_bytes);
    EXPECT_EQ(end.back()["type"], "response.incomplete");
    EXPECT_EQ(end.back()["response"]["incomplete_details"]["reason"], "max_output_tokens");

    ResponsesResponseWriter failed(Context());
    const std::vector<json> error = Events(failed.StreamError(BadRequest("boom", "", "oops")));
    ASSERT_EQ(error.size(), 1u);
    EXPECT_EQ(error[0]["type"], "response.failed");
    EXPECT_EQ(error[0]["response"]["status"], "failed");
    EXPECT_EQ(error[0]["response"]["error"]["message"], "boom");
}

TEST(ResponsesRoute, EndToEnd) {
    TestServer server;
    auto r = Post(server.port(), "/v1/responses",
                  R"({"model": "test-model", "input": "Hi", "instructions": "Be kind.",
                      "max_output_tokens": 3})");
    ASSERT_EQ(r.status, 200) << r.body;
    const json b = json::parse(r.body);
    EXPECT_EQ(b["id"].get<std::string>().rfind("resp_", 0), 0u);
    EXPECT_EQ(b["output"][0]["id"].get<std::string>().rfind("msg_", 0), 0u);
    EXPECT_EQ(b["output"][0]["content"][0]["text"], "Hello, world");
    EXPECT_EQ(b["status"], "incomplete");
    const auto submitted = server.engine().submitted();
    ASSERT_EQ(submitted.size(), 1u);
    EXPECT_EQ(submitted[0].max_tokens, 3);
    EXPECT_EQ(submitted[0].request_id, b["id"]);
    // Through the chat template (ChatML): the instructions, then the input.
    const std::string prompt(submitted[0].prompt_token_ids.begin(),
                             submitted[0].prompt_token_ids.end());
    EXPECT_NE(prompt.find("Be kind."), std::string::npos);
    EXPECT_LT(prompt.find("Be kind."), prompt.find("Hi"));
    EXPECT_EQ(b["usage"]["input_tokens"], static_cast<int64_t>(prompt.size()));

    auto s = Post(server.port(), "/v1/responses",
                  R"({"input": "Hi", "max_output_tokens": 4, "stream": true})");
    ASSERT_EQ(s.status, 200) << s.body;
    EXPECT_EQ(s.message[boost::beast::http::field::content_type], "text/event-stream");
    const std::vector<json> events = Events(s.body);
    ASSERT_FALSE(events.empty());
    EXPECT_EQ(events.front()["type"], "response.created");
    EXPECT_EQ(events.back()["type"], "response.incomplete");
    EXPECT_EQ(events.back()["response"]["output"][0]["content"][0]["text"], "Hello, world!");

    auto bad = Post(server.port(), "/v1/responses", R"({"input": "Hi", "store": true})");
    EXPECT_EQ(bad.status, 400);
    EXPECT_EQ(json::parse(bad.body)["error"]["param"], "store");
    auto too_long = Post(server.port(), "/v1/responses",
                         R"({"input": "Hi", "max_output_tokens": 100000})");
    EXPECT_EQ(too_long.status, 400);
    EXPECT_EQ(json::parse(too_long.body)["error"]["param"], "max_output_tokens");
    const std::string message = json::parse(too_long.body)["error"]["message"];
    EXPECT_NE(message.find("max_output_tokens (100000)"), std::string::npos) << message;
    EXPECT_EQ(message.find("max_tokens"), std::string::npos) << message;
    // text.format json_schema reaches the engine as the request's grammar.
    auto schema = Post(server.port(), "/v1/responses",
                       R"({"input": "Hi", "max_output_tokens": 3, "text": {"format":
                           {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}})");
    ASSERT_EQ(schema.status, 200) << schema.body;
    EXPECT_EQ(json::parse(schema.body)["text"]["format"]["type"], "json_schema");
    EXPECT_NE(server.engine().submitted().back().grammar, nullptr);
}

}  // namespace
}  // namespace kvshard
