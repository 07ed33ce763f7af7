// Anthropic Messages answers: the whole message and the event stream built from engine deltas,
// with stop reasons, the stop sequence that matched, tool_use blocks (a call split across
// deltas) and usage that adds up to the prompt.
#include "coordinator/anthropic_response.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kvshard {
namespace {

using nlohmann::json;

AnthropicResponseContext Context() {
    AnthropicResponseContext c;
    c.id = "msg_1";
    c.model = "m";
    c.prompt_tokens = 100;
    // Token id = byte, as a byte tokenizer decodes.
    c.decode = [](const std::vector<int32_t>& ids) {
        std::string s;
        for (int32_t id : ids) s += static_cast<char>(id);
        return s;
    };
    return c;
}

ToolCallParserOptions Tools() {
    ToolCallParserOptions o;
    o.allowed_names = {"get_weather"};
    o.id_prefix = "toolu_x_";
    return o;
}

// Deltas of one token each, as the engine sends them; the last carries `finish`. `hidden` is text
// of extra tokens the engine withheld (a stop sequence).
std::vector<GenerationDelta> Deltas(const std::vector<std::string>& pieces, FinishReason finish,
                                    const std::string& hidden = "") {
    std::vector<GenerationDelta> out;
    for (const std::string& p : pieces) {
        GenerationDelta d;
        d.text = p;
        for (char c : p) d.token_ids.push_back(static_cast<unsigned char>(c));
        out.push_back(d);
    }
    for (char c : hidden) out.back().token_ids.push_back(static_cast<unsigned char>(c));
    out.back().finish_reason = finish;
    return out;
}

GenerationUsage Usage() {
    GenerationUsage u;
    u.prompt_tokens = 100;
    u.completion_tokens = 7;
    u.cached_tokens = 64;
    u.cache_creation_tokens = 16;
    return u;
}

json Whole(AnthropicResponseContext c, const std::vector<GenerationDelta>& deltas) {
    AnthropicResponseWriter w(std::move(c));
    for (const GenerationDelta& d : deltas) w.Add(d);
    return json::parse(w.Body(Usage()));
}

struct Event {
    std::string type;
    json data;
};

std::vector<Event> Stream(AnthropicResponseContext c, const std::vector<GenerationDelta>& deltas) {
    AnthropicResponseWriter w(std::move(c));
    std::string bytes = w.StreamStart();
    for (const GenerationDelta& d : deltas) bytes += w.StreamDelta(d);
    bytes += w.StreamFinish(Usage());
    std::vector<Event> out;
    size_t pos = 0;
    while (pos < bytes.size()) {
        const size_t end = bytes.find("\n\n", pos);
        EXPECT_NE(end, std::string::npos);
        const std::string event = bytes.substr(pos, end - pos);
        const size_t newline = event.find('\n');
        EXPECT_EQ(event.rfind("event: ", 0), 0u);
        EXPECT_EQ(event.compare(newline + 1, 6, "data: "), 0);
        Event e{event.substr(7, newline - 7), json::parse(event.substr(newline + 7))};
        EXPECT_EQ(e.data["type"], e.type);
        out.push_back(std::move(e));
        pos = end + 2;
    }
    return out;
}

std::vector<std::string> Types(const std::vector<Event>& events) {
    std::vector<std::string> out;
    for (const Event& e : events) out.push_back(e.type);
    return out;
}

TEST(AnthropicResponse, WholeTextMessageWithUsage) {
    const json b = Whole(Context(), Deltas({"Hel", "lo"}, FinishReason::kStop));
    EXPECT_EQ(b["id"], "msg_1");
    EXPECT_EQ(b["type"], "message");
    EXPECT_EQ(b["role"], "assistant");
    EXPECT_EQ(b["model"], "m");
    EXPECT_EQ(b["content"], json::parse(R"([{"type": "text", "text": "Hello"}])"));
    EXPECT_EQ(b["stop_reason"], "end_turn");
    EXPECT_TRUE(b["stop_sequence"].is_null());
    const json& u = b["usage"];
    EXPECT_EQ(u["input_tokens"], 20);
    EXPECT_EQ(u["cache_creation_input_tokens"], 16);
    EXPECT_EQ(u["cache_read_input_tokens"], 64);
    EXPECT_EQ(u["output_tokens"], 7);
    EXPECT_EQ(u["input_tokens"].get<int>() + u["cache_creation_input_tokens"].get<int>() +
                  u["cache_read_input_tokens"].get<int>(),
              100);
}

TEST(AnthropicResponse, StopReasons) {
    EXPECT_EQ(Whole(Context(), Deltas({"a"}, FinishReason::kLength))["stop_reason"], "max_tokens");
    AnthropicResponseContext c = Context();
    c.stop_sequences = {"STOP", "END"};
    // The engine's text ends before "END"; the ids still hold it.
    const json b = Whole(c, Deltas({"one ", "two"}, FinishReason::kStop, " END"));
    EXPECT_EQ(b["stop_reason"], "stop_sequence");
    EXPECT_EQ(b["stop_sequence"], "END");
    EXPECT_EQ(b["content"][0]["text"], "one two");
    // A stop token (nothing withheld) is the end of the turn.
    EXPECT_EQ(Whole(c, Deltas({"one"}, FinishReason::kStop))["stop_reason"], "end_turn");
}

TEST(AnthropicResponse, ToolUseBlocksFromACallSplitAcrossDeltas) {
    AnthropicResponseContext c = Context();
    c.tools = Tools();
    const std::vector<std::string> pieces = {"Let me look.\n<tool", "_call>\n{\"name\": \"get_",
                                             "weather\", \"arguments\": {\"ci",
                                             "ty\": \"Paris\"}}\n</tool_", "call>"};
    const json b = Whole(c, Deltas(pieces, FinishReason::kStop));
    EXPECT_EQ(b["stop_reason"], "tool_use");
    ASSERT_EQ(b["content"].size(), 2u);
    EXPECT_EQ(b["content"][0], json::parse(R"({"type": "text", "text": "Let me look."})"));
    EXPECT_EQ(b["content"][1], json::parse(R"({"type": "tool_use", "id": "toolu_x_0",
                                               "name": "get_weather",
                                               "input": {"city": "Paris"}})"));

    const std::vector<Event> events = Stream(c, Deltas(pieces, FinishReason::kStop));
    EXPECT_EQ(Types(events),
              (std::vector<std::string>{"message_start", "ping", "content_block_start",
                                        "content_block_delta", "content_block_stop",
                                        "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"}));
    EXPECT_EQ(events[2].data["index"], 0);
    EXPECT_EQ(events[3].data["delta"],
              json::parse(R"({"type": "text_delta", "text": "Let me look."})"));
    EXPECT_EQ(events[5].data["index"], 1);
    EXPECT_EQ(events[5].data["content_block"]["type"], "tool_use");
    EXPECT_EQ(events[5].data["content_block"]["name"], "get_weather");
    EXPECT_EQ(events[5].data["content_block"]["input"], json::object());
    EXPECT_EQ(events[6].data["delta"]["type"], "input_json_delta");
    EXPECT_EQ(json::parse(events[6].data["delta"]["partial_json"].get<std::string>()),
              json({{"city", "Paris"}}));
    EXPECT_EQ(events[8].data["delta"]["stop_reason"], "tool_use");
    EXPECT_EQ(events[8].data["usage"]["cache_read_input_tokens"], 64);
}

TEST(AnthropicResponse, StreamOfTextOpensOneBlock) {
    const std::vector<Event> events =
        Stream(Context(), Deltas({"Hel", "lo", "!"}, FinishReason::kLength));
    EXPECT_EQ(Types(events),
              (std::vector<std::string>{"message_start", "ping", "content_block_start",
                                        "content_block_delta", "content_block_delta",
                                        "content_block_delta", "content_block_stop",
                                        "message_delta", "message_stop"}));
    const json& message = events[0].data["message"];
    EXPECT_EQ(message["id"], "msg_1");
    EXPECT_EQ(message["content"], json::array());
    EXPECT_TRUE(message["stop_reason"].is_null());
    EXPECT_EQ(message["usage"]["input_tokens"], 100);
    EXPECT_EQ(events[2].data["content_block"], json::parse(R"({"type": "text", "text": ""})"));
    EXPECT_EQ(events[7].data["delta"]["stop_reason"], "max_tokens");
    EXPECT_EQ(events[7].data["usage"]["input_tokens"], 20);
    EXPECT_EQ(events[7].data["usage"]["output_tokens"], 7);
}

TEST(AnthropicResponse, MalformedCallIsText) {
    AnthropicResponseContext c = Context();
    c.tools = Tools();
    const std::string raw = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {]}</tool_call>";
    const json b = Whole(c, Deltas({raw}, FinishReason::kStop));
    EXPECT_EQ(b["stop_reason"], "end_turn");
    EXPECT_EQ(b["content"], json::array({{{"type", "text"}, {"text", raw}}}));
}

TEST(AnthropicResponse, AnEmptyAnswerAndAnError) {
    const std::vector<Event> events = Stream(Context(), Deltas({""}, FinishReason::kStop));
    EXPECT_EQ(Types(events),
              (std::vector<std::string>{"message_start", "ping", "message_delta", "message_stop"}));
    AnthropicResponseWriter w(Context());
    ApiError e;
    e.http_status = 503;
    e.message = "busy";
    const std::string error = w.StreamError(e);
    EXPECT_EQ(error.rfind("event: error\ndata: ", 0), 0u);
    EXPECT_EQ(json::parse(error.substr(19))["error"]["type"], "overloaded_error");
}

}  // namespace
}  // namespace kvshard
