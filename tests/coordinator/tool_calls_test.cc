// Tool calling: the tools prompt of each convention, and the parser that turns a model's output
// back into text and calls, whole and split at every byte as a stream would deliver it.
#include "coordinator/tool_calls.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

TEST(ToolCallSyntax, ByTemplateStyle) {
    EXPECT_EQ(*ToolCallSyntaxFor(ChatTemplateStyle::kChatMl), ToolCallSyntax::kHermes);
    EXPECT_EQ(*ToolCallSyntaxFor(ChatTemplateStyle::kLlama3), ToolCallSyntax::kLlama3Json);
    EXPECT_FALSE(ToolCallSyntaxFor(ChatTemplateStyle::kLlama2).ok());
}

}  // namespace
}  // namespace kvshard
