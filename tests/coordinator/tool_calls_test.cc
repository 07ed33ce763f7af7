// Tool calling: the tools prompt of each convention, and the parser that turns a model's output
// back into text and calls, whole and split at every byte as a stream would deliver it.
#include "coordinator/tool_calls.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "grammar/grammar.h"
#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;

ToolCallParserOptions Hermes(std::vector<std::string> names = {"get_weather", "add"}) {
    ToolCallParserOptions o;
    o.syntax = ToolCallSyntax::kHermes;
    o.allowed_names = std::move(names);
    o.id_prefix = "call_";
    return o;
}

// What a parser makes of `text` fed in pieces of `chunk` bytes: the text outputs joined, and
// "CALL name args" lines for calls, in order.
std::vector<std::string> Parse(ToolCallParserOptions options, const std::string& text,
                               size_t chunk) {
    ToolCallParser parser(std::move(options));
    std::vector<ToolCallOutput> all;
    for (size_t i = 0; i < text.size(); i += chunk) {
        for (ToolCallOutput& o : parser.Feed(text.substr(i, chunk))) all.push_back(std::move(o));
    }
    for (ToolCallOutput& o : parser.Finish()) all.push_back(std::move(o));
    std::vector<std::string> out;
    for (const ToolCallOutput& o : all) {
        if (o.call) {
            out.push_back("CALL " + o.call->id + " " + o.call->name + " " + o.call->arguments);
        } else if (!out.empty() && out.back().rfind("CALL ", 0) != 0) {
            out.back() += o.text;  // text split across feeds is one run of text
        } else {
            out.push_back(o.text);
        }
    }
    return out;
}

// Every split of the stream gives what the whole text gives.
void ExpectParse(ToolCallParserOptions options, const std::string& text,
                 const std::vector<std::string>& expected) {
    for (size_t chunk = 1; chunk <= text.size(); ++chunk) {
        EXPECT_EQ(Parse(options, text, chunk), expected) << "chunk " << chunk << ": " << text;
    }
}

TEST(ToolCallParser, HermesCallsWithTextAround) {
    ExpectParse(Hermes(),
                "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", "
                "\"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>",
                {"Let me check.", R"(CALL call_0 get_weather {"city":"Paris"})",
                 R"(CALL call_1 add {"a":1,"b":2})"});
}

TEST(ToolCallParser, PlainTextPassesThroughWhole) {
    ExpectParse(Hermes(), "Hello <tool world> 1 < 2\n", {"Hello <tool world> 1 < 2\n"});
    // A prefix of the tag at the end is text once the output is over.
    ExpectParse(Hermes(), "a <tool_ca", {"a <tool_ca"});
}

TEST(ToolCallParser, MalformedCallsStayText) {
    // Not JSON, a tool the request does not offer, arguments that are not an object.
    for (const std::string& body :
         {std::string("{\"name\": \"add\", \"arguments\": {\"a\": }"),
          std::string("{\"name\": \"rm_rf\", \"arguments\": {}}"),
          std::string("{\"name\": \"add\", \"arguments\": [1]}"), std::string("add(1, 2)")}) {
        const std::string text = "x <tool_call>" + body + "</tool_call> y";
        ExpectParse(Hermes(), text, {text});
    }
}

TEST(ToolCallParser, UnclosedCallAtTheEndIsACallWhenItParses) {
    ExpectParse(Hermes(), "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n",
                {R"(CALL call_0 add {"a":1})"});
    ExpectParse(Hermes(), "<tool_call>\n{\"name\": \"add\", \"argu",
                {"<tool_call>\n{\"name\": \"add\", \"argu"});
}

TEST(ToolCallParser, ArgumentsAsAJsonStringAndMaxCalls) {
    ExpectParse(Hermes(), R"(<tool_call>{"name": "add", "arguments": "{\"a\": 3}"}</tool_call>)",
                {R"(CALL call_0 add {"a":3})"});
    ToolCallParserOptions one = Hermes();
    one.max_calls = 1;
    const std::string second = R"(<tool_call>{"name": "add", "arguments": {}}</tool_call>)";
    ExpectParse(one, R"(<tool_call>{"name": "add", "arguments": {}}</tool_call>)" + second,
                {"CALL call_0 add {}", second});
}

TEST(ToolCallParser, Llama3JsonCalls) {
    ToolCallParserOptions o = Hermes();
    o.syntax = ToolCallSyntax::kLlama3Json;
    ExpectParse(
        o,
        R"( {"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Oslo"}})",
        {R"(CALL call_0 add {"a":1})", R"(CALL call_1 get_weather {"city":"Oslo"})"});
    ExpectParse(o, R"(<|python_tag|>{"name": "add", "parameters": {}})", {"CALL call_0 add {}"});
    // Text, and JSON that is no call, stay text.
    ExpectParse(o, "The answer is 3.", {"The answer is 3."});
    ExpectParse(o, R"({"answer": 3})", {R"({"answer": 3})"});
}

TEST(ToolCallParser, MistralCalls) {
    ToolCallParserOptions o = Hermes();
    o.syntax = ToolCallSyntax::kMistral;
    struct Case {
        std::string output;
        std::vector<std::string> expected;
    };
    const std::string two_calls =
        R"([TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, )"
        R"({"name": "add", "arguments": "{\"a\": 1}"}])";
    const Case cases[] = {
        // Content before the calls; several calls; arguments as a JSON string.
        {"Let me look." + two_calls,
         {"Let me look.", R"(CALL call_0 get_weather {"city":"Oslo"})",
          R"(CALL call_1 add {"a":1})"}},
        // The bare array, as it reads when the [TOOL_CALLS] control token's text is skipped.
        {R"( [{"name": "add", "arguments": {"b": [1, "]"]}}])",
         {R"(CALL call_0 add {"b":[1,"]"]})"}},
        {R"([TOOL_CALLS] {"name": "add", "arguments": {}})", {"CALL call_0 add {}"}},
        // Malformed output, calls of tools the request does not offer, and text stay text.
        {R"([TOOL_CALLS][{"name": "add", "arguments": {]")",
         {R"([TOOL_CALLS][{"name": "add", "arguments": {]")"}},
        {R"([TOOL_CALLS][{"name": "rm", "arguments": {}}])",
         {R"([TOOL_CALLS][{"name": "rm", "arguments": {}}])"}},
        {R"([TOOL_CALLS][{"name": "add", "arguments": 3}])",
         {R"([TOOL_CALLS][{"name": "add", "arguments": 3}])"}},
        {"[TOOL_CALLS] no call", {"[TOOL_CALLS] no call"}},
        {"[1, 2] are numbers.", {"[1, 2] are numbers."}},
        {"[TOOL", {"[TOOL"}},
        {"The answer is 3.", {"The answer is 3."}},
    };
    for (const Case& c : cases) ExpectParse(o, c.output, c.expected);

    // Mistral's 9-character ids: the prefix cut, then the index.
    o.id_prefix = "0123456789abcdef";
    o.id_length = 9;
    ExpectParse(o, two_calls,
                {R"(CALL 012345670 get_weather {"city":"Oslo"})", R"(CALL 012345671 add {"a":1})"});
}

TEST(RenderTools, HermesListsEachToolAndMarksBreakpoints) {
    std::vector<ToolDefinition> tools(2);
    tools[0].name = "get_weather";
    tools[0].description = "Weather of a city";
    tools[0].parameters = R"({"type":"object","properties":{"city":{"type":"string"}}})";
    tools[0].cache_ttl_ms = 300'000;
    tools[1].name = "add";
    const ChatTools t = RenderTools(ToolCallSyntax::kHermes, tools, {});
    EXPECT_NE(t.prompt.find("<tools>\n{"), std::string::npos);
    const size_t first = t.prompt.find("\"get_weather\"");
    const size_t second = t.prompt.find("\"add\"");
    ASSERT_NE(first, std::string::npos);
    ASSERT_NE(second, std::string::npos);
    EXPECT_LT(first, second);
    EXPECT_NE(t.prompt.find("<tool_call>"), std::string::npos);
    // The mark falls right after the first tool's line.
    ASSERT_EQ(t.cache_marks.size(), 1u);
    EXPECT_EQ(t.prompt.substr(t.cache_marks[0].content_end, 2), "\n{");
    const std::string line = t.prompt.substr(0, t.cache_marks[0].content_end);
    const json first_tool = json::parse(line.substr(line.rfind('\n') + 1));
    EXPECT_EQ(first_tool["function"]["name"], "get_weather");
    EXPECT_EQ(first_tool["function"]["parameters"]["properties"]["city"]["type"], "string");

    // "none" renders nothing; a named choice asks for that tool.
    EXPECT_TRUE(
        RenderTools(ToolCallSyntax::kHermes, tools, {ToolChoiceMode::kNone, ""}).prompt.empty());
    EXPECT_NE(RenderTools(ToolCallSyntax::kHermes, tools, {ToolChoiceMode::kNamed, "add"})
                  .prompt.find("\"add\"."),
              std::string::npos);
    EXPECT_NE(RenderTools(ToolCallSyntax::kLlama3Json, tools, {}).prompt.find("\"parameters\""),
              std::string::npos);
}

TEST(ToolCallGrammar, RequiredCallsFollowTheToolsSchemas) {
    std::vector<ToolDefinition> tools = {
        {"get_weather", "", R"({"type":"object","properties":{"city":{"type":"string"}},
            "required":["city"],"additionalProperties":false})"},
        {"get_time", "", R"({"type":"object","properties":{}})"}};
    auto accepts = [](const std::shared_ptr<const grammar::Grammar>& g, const std::string& t) {
        grammar::GrammarState s(g);
        return s.AdvanceBytes(t) && s.CanEnd();
    };
    auto any = ToolCallGrammar(ToolCallSyntax::kHermes, tools, {ToolChoiceMode::kRequired}, false);
    ASSERT_TRUE(any.ok()) << any.status().ToString();
    const std::string call =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
        "\"Oslo\"}}\n</tool_call>";
    EXPECT_TRUE(accepts(*any, call));
    EXPECT_TRUE(accepts(
        *any, call + "\n<tool_call>\n{\"name\":\"get_time\",\"arguments\":{}}\n</tool_call>"));
    EXPECT_FALSE(
        accepts(*any, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"));
    EXPECT_FALSE(accepts(*any, "Sure!"));
    // What the grammar lets through, the parser takes as a call.
    ToolCallParser parser({.syntax = ToolCallSyntax::kHermes, .allowed_names = {"get_weather"}});
    std::vector<ToolCallOutput> out = parser.Feed(call);
    for (ToolCallOutput& o : parser.Finish()) out.push_back(std::move(o));
    ASSERT_EQ(out.size(), 1u);
    ASSERT_TRUE(out[0].call.has_value());
    EXPECT_EQ(out[0].call->arguments, R"({"city":"Oslo"})");

    auto named = ToolCallGrammar(ToolCallSyntax::kLlama3Json, tools,
                                 {ToolChoiceMode::kNamed, "get_time"}, true);
    ASSERT_TRUE(named.ok());
    EXPECT_TRUE(accepts(*named, R"({"name": "get_time", "parameters": {}})"));
    EXPECT_FALSE(accepts(*named, R"({"name": "get_weather", "parameters": {"city": "x"}})"));

    // Mistral: one JSON array of calls (the [TOOL_CALLS] control token is not text to force).
    auto array =
        ToolCallGrammar(ToolCallSyntax::kMistral, tools, {ToolChoiceMode::kRequired}, false);
    ASSERT_TRUE(array.ok()) << array.status().ToString();
    const std::string mistral = R"([{"name": "get_weather", "arguments": {"city": "Oslo"}}])";
    EXPECT_TRUE(accepts(*array, mistral));
    EXPECT_TRUE(accepts(
        *array,
        R"([{"name":"get_time","arguments":{}}, {"name": "get_weather", "arguments": {"city": "x"}}])"));
    EXPECT_FALSE(accepts(*array, R"([{"name": "get_weather", "arguments": {}}])"));
    EXPECT_FALSE(accepts(*array, "[]"));
    EXPECT_FALSE(accepts(*array, "[TOOL_CALLS]" + mistral));
    EXPECT_FALSE(accepts(*array, "Sure!"));
    auto one = ToolCallGrammar(ToolCallSyntax::kMistral, tools,
                               {ToolChoiceMode::kNamed, "get_time"}, true);
    ASSERT_TRUE(one.ok());
    EXPECT_TRUE(accepts(*one, R"([{"name": "get_time", "arguments": {}}])"));
    EXPECT_FALSE(accepts(
        *one, R"([{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}])"));
    EXPECT_FALSE(accepts(*one, mistral));
    ToolCallParser mistral_parser(
        {.syntax = ToolCallSyntax::kMistral, .allowed_names = {"get_weather"}});
    out = mistral_parser.Feed(mistral);
    for (ToolCallOutput& o : mistral_parser.Finish()) out.push_back(std::move(o));
    ASSERT_EQ(out.size(), 1u);
    ASSERT_TRUE(out[0].call.has_value());
    EXPECT_EQ(out[0].call->arguments, R"({"city":"Oslo"})");

    tools[0].parameters = R"({"type":"object","properties":{"n":{"type":"number","maximum":3}}})";
    auto bad = ToolCallGrammar(ToolCallSyntax::kHermes, tools, {ToolChoiceMode::kRequired}, false);
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().message().rfind("tools[0].function.parameters.properties.n.maximum", 0),
              0u)
        << bad.status().message();
}

TEST(ToolCallSyntax, ByTemplateStyle) {
    EXPECT_EQ(*ToolCallSyntaxFor(ChatTemplateStyle::kChatMl), ToolCallSyntax::kHermes);
    EXPECT_EQ(*ToolCallSyntaxFor(ChatTemplateStyle::kLlama3), ToolCallSyntax::kLlama3Json);
    EXPECT_FALSE(ToolCallSyntaxFor(ChatTemplateStyle::kLlama2).ok());
    // An interpreted template that writes Mistral's markers; one of no family is refused.
    auto mistral = ChatTemplate::FromJinjaInterpreted(
        "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]"
        "{% endif %}{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{% endif %}"
        "{{ m.content }}{% endfor %}",
        {"<s>", "</s>"}, "test");
    ASSERT_TRUE(mistral.ok()) << mistral.status().ToString();
    EXPECT_EQ(*ToolCallSyntaxFor(*mistral), ToolCallSyntax::kMistral);
    auto plain = ChatTemplate::FromJinjaInterpreted(
        "{% for m in messages %}{{ m.content }}{% endfor %}", {"<s>", "</s>"}, "test");
    ASSERT_TRUE(plain.ok());
    EXPECT_FALSE(ToolCallSyntaxFor(*plain).ok());
}

// The OpenAI chat route with tools, over HTTP in front of a FakeEngine that "calls" a tool.
class OpenAiChatTools : public ::testing::Test {
  protected:
    OpenAiChatTools() : server_(Options()) {}
    static testing::TestServerOptions Options() {
        testing::TestServerOptions o;
        o.engine.script = {"<tool_call>", "\n{\"name\": \"get_weather\", ",
                           "\"arguments\": {\"city\": \"Paris\"}}", "\n</tool_call>"};
        return o;
    }
    testing::HttpReply Chat(json body) {
        body["max_tokens"] = 4;
        return testing::Post(server_.port(), "/v1/chat/completions", body.dump());
    }
    std::string Prompt(size_t i) {
        const std::vector<int32_t> ids = server_.engine().submitted().at(i).prompt_token_ids;
        return std::string(ids.begin(), ids.end());
    }
    static json Tools() {
        return json::parse(R"([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}}}}])");
    }
    testing::TestServer server_;
};

TEST_F(OpenAiChatTools, CallsAsMessageToolCalls) {
    const auto reply =
        Chat({{"messages", {{{"role", "user"}, {"content", "Weather?"}}}}, {"tools", Tools()}});
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json choice = json::parse(reply.body)["choices"][0];
    EXPECT_EQ(choice["finish_reason"], "tool_calls");
    EXPECT_TRUE(choice["message"]["content"].is_null());
    const json& call = choice["message"]["tool_calls"][0];
    EXPECT_EQ(call["type"], "function");
    EXPECT_EQ(call["function"]["name"], "get_weather");
    EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()),
              json({{"city", "Paris"}}));
    EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u);
    EXPECT_NE(Prompt(0).find("<tools>\n{\"function\":{\"description\":\"Weather\""),
              std::string::npos);

    // The call and its result go back: content null, role "tool" with the call's id.
    json history = {{{"role", "user"}, {"content", "Weather?"}},
                    {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call}}},
                    {{"role", "tool"}, {"tool_call_id", call["id"]}, {"content", "18 C"}}};
    ASSERT_EQ(Chat({{"messages", history}, {"tools", Tools()}}).status, 200);
    EXPECT_NE(Prompt(1).find("<tool_response>\n18 C\n</tool_response>"), std::string::npos);
    EXPECT_NE(Prompt(1).find("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                             "{\"city\":\"Paris\"}}\n</tool_call>"),
              std::string::npos)
        << Prompt(1);

    // tool_choice none: no tools rendered, the output is text.
    const auto none = Chat({{"messages", {{{"role", "user"}, {"content", "x"}}}},
                            {"tools", Tools()},
                            {"tool_choice", "none"}});
    ASSERT_EQ(none.status, 200);
    EXPECT_EQ(json::parse(none.body)["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(Prompt(2).find("<tools>"), std::string::npos);
}

TEST_F(OpenAiChatTools, StreamedAsDeltaToolCalls) {
    const auto reply = Chat({{"messages", {{{"role", "user"}, {"content", "Weather?"}}}},
                             {"tools", Tools()},
                             {"stream", true}});
    ASSERT_EQ(reply.status, 200) << reply.body;
    std::vector<json> calls;
    std::string finish, content;
    for (const std::string& data : testing::SseData(reply.body)) {
        if (data == "[DONE]") continue;
        const json c = json::parse(data)["choices"][0];
        if (c["delta"].contains("tool_calls")) calls.push_back(c["delta"]["tool_calls"][0]);
        if (c["delta"].contains("content")) content += c["delta"]["content"].get<std::string>();
        if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
    }
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0]["index"], 0);
    EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
    EXPECT_EQ(json::parse(calls[0]["function"]["arguments"].get<std::string>()),
              json({{"city", "Paris"}}));
    EXPECT_EQ(finish, "tool_calls");
    EXPECT_EQ(content, "");  // the role chunk's empty content only
}

TEST_F(OpenAiChatTools, BadToolsAndMessagesNameTheParam) {
    struct Case {
        json body;
        std::string param;
    };
    const json user = {{"role", "user"}, {"content", "x"}};
    const Case cases[] = {
        {{{"messages", {user, {{"role", "tool"}, {"tool_call_id", "nope"}, {"content", "r"}}}}},
         "messages[1].tool_call_id"},
        {{{"messages", {user}}, {"tools", {{{"type", "retrieval"}}}}}, "tools[0].type"},
        {{{"messages", {user}}, {"tool_choice", "required"}}, "tool_choice"},
        {{{"messages", {user}},
          {"tools", Tools()},
          {"tool_choice", {{"type", "function"}, {"function", {{"name", "other"}}}}}},
         "tool_choice"},
        {{{"messages",
           {user,
            {{"role", "assistant"},
             {"content", nullptr},
             {"tool_calls",
              {{{"id", "c"},
                {"type", "function"},
                {"function", {{"name", "f"}, {"arguments", "not json"}}}}}}}}}},
         "messages[1].tool_calls[0].function.arguments"},
    };
    for (const Case& c : cases) {
        const auto reply = Chat(c.body);
        EXPECT_EQ(reply.status, 400) << c.body.dump() << " -> " << reply.body;
        EXPECT_EQ(json::parse(reply.body)["error"]["param"], c.param) << reply.body;
    }
    json strict = Tools();
    strict[0]["function"]["strict"] = true;
    EXPECT_EQ(json::parse(Chat({{"messages", {user}}, {"tools", strict}}).body)["error"]["param"],
              "tools[0].function.strict");
}

// The chat route in front of Mistral Nemo's own template: the template renders the tools, the
// model's [TOOL_CALLS] array comes back as tool_calls with 9-character ids, and those ids go
// back through the template (which refuses any other length) with the tool's result.
class OpenAiChatMistralTools : public ::testing::Test {
  protected:
    OpenAiChatMistralTools() : server_(Options()) {}
    static testing::TestServerOptions Options() {
        testing::TestServerOptions o;
        o.engine.script = {"[TOOL_CALLS]", "[{\"name\": \"get_weather\", ",
                           "\"arguments\": {\"city\": \"Paris\"}}]"};
        const std::string file =
            std::string(KVSHARD_SOURCE_DIR) +
            "/tests/model/chat_templates/mistralai-Mistral-Nemo-Instruct-2407.jinja";
        std::ifstream in(file);
        std::stringstream jinja;
        jinja << in.rdbuf();
        auto t = ChatTemplate::FromJinja(jinja.str(), {"<s>", "</s>"}, file);
        EXPECT_TRUE(t.ok()) << t.status().ToString();
        if (t.ok()) o.custom_chat_template = std::move(t).value();
        return o;
    }
    testing::HttpReply Chat(json body) {
        body["max_tokens"] = 3;
        return testing::Post(server_.port(), "/v1/chat/completions", body.dump());
    }
    std::string Prompt(size_t i) {
        const std::vector<int32_t> ids = server_.engine().submitted().at(i).prompt_token_ids;
        return std::string(ids.begin(), ids.end());
    }
    static json Tools() {
        return json::parse(R"([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
    }
    testing::TestServer server_;
};

TEST_F(OpenAiChatMistralTools, CallsRoundTripThroughTheTemplate) {
    const json user = {{"role", "user"}, {"content", "Weather?"}};
    const json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
    for (bool stream : {false, true}) {
        const auto reply = Chat(
            {{"messages", {user}}, {"tools", Tools()}, {"tool_choice", named}, {"stream", stream}});
        ASSERT_EQ(reply.status, 200) << reply.body;
        json call;
        if (stream) {
            for (const std::string& data : testing::SseData(reply.body)) {
                if (data == "[DONE]") continue;
                const json d = json::parse(data)["choices"][0]["delta"];
                if (d.contains("tool_calls")) call = d["tool_calls"][0];
            }
        } else {
            call = json::parse(reply.body)["choices"][0]["message"]["tool_calls"][0];
        }
        ASSERT_TRUE(call.is_object()) << reply.body;
        EXPECT_EQ(call["function"]["name"], "get_weather");
        EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()),
                  json({{"city", "Paris"}}));
        const std::string id = call["id"];
        EXPECT_EQ(id.size(), 9u) << id;
        EXPECT_TRUE(std::all_of(id.begin(), id.end(), [](char c) { return std::isalnum(c); }))
            << id;
        if (stream) continue;

        EXPECT_NE(Prompt(0).find("[AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": "
                                 "{\"name\": \"get_weather\""),
                  std::string::npos)
            << Prompt(0);
        call["type"] = "function";
        const json history = {user,
                              {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call}}},
                              {{"role", "tool"}, {"tool_call_id", id}, {"content", "18 C"}}};
        const auto next = Chat({{"messages", history}, {"tools", Tools()}});
        ASSERT_EQ(next.status, 200) << next.body;
        EXPECT_NE(Prompt(1).find("[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": "
                                 "{\"city\": \"Paris\"}, \"id\": \"" +
                                 id + "\"}]</s>[TOOL_RESULTS]{\"content\": 18 C, \"call_id\": \"" +
                                 id + "\"}[/TOOL_RESULTS]"),
                  std::string::npos)
            << Prompt(1);

        // An id of another length: the template's own refusal, as a 400.
        json other = history;
        other[1]["tool_calls"][0]["id"] = "call_1";
        other[2]["tool_call_id"] = "call_1";
        const auto refused = Chat({{"messages", other}, {"tools", Tools()}});
        EXPECT_EQ(refused.status, 400) << refused.body;
        EXPECT_NE(refused.body.find("length 9"), std::string::npos) << refused.body;
    }
}

}  // namespace
}  // namespace kvshard
