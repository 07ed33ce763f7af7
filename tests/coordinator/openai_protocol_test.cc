// Request parsing and validation: one row per rule, each naming the HTTP status and the param the
// error must carry.
#include "coordinator/openai_protocol.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

namespace kvshard {
namespace {

using nlohmann::json;

const ServedModel kModel{"smol", "/models/SmolLM2.gguf", 1000};

constexpr ApiEndpoint kCmpl = ApiEndpoint::kCompletions;
constexpr ApiEndpoint kChat = ApiEndpoint::kChatCompletions;

OpenAiRequest ParseOk(ApiEndpoint endpoint, const std::string& body) {
    ParsedRequest r = ParseOpenAiRequest(endpoint, body, kModel);
    if (auto* e = std::get_if<ApiError>(&r)) {
        ADD_FAILURE() << body << " -> " << e->message;
        return {};
    }
    return std::get<OpenAiRequest>(r);
}

struct BadCase {
    ApiEndpoint endpoint;
    std::string body;
    int status;
    std::string param;         // "" when the error has no param
    std::string message_part;  // a piece of the message
};

TEST(OpenAiProtocol, RejectsBadRequests) {
    const std::string p = R"("prompt": "hi")";
    const std::string m = R"("messages": [{"role": "user", "content": "hi"}])";
    const BadCase cases[] = {
        // Body-level.
        {kCmpl, "{", 400, "", "not valid JSON"},
        {kCmpl, "", 400, "", "not valid JSON"},
        {kCmpl, "[1, 2]", 400, "", "must be a JSON object"},
        {kCmpl, "{\"prompt\": \"\xff\xfe\"}", 400, "", "not valid UTF-8"},
        {kCmpl, "{\"prompt\": \"\xc3\"}", 400, "", "not valid UTF-8"},
        {kCmpl, R"({"prompt": "\ud800"})", 400, "", "not valid JSON"},
        // Numbers beyond a double, in a known field or an unknown one (once an uncaught
        // nlohmann::out_of_range that ended the process).
        {kCmpl, R"({"prompt": "a", "temperature": 1e400})", 400, "", "number too large"},
        {kCmpl, R"({"prompt": "a", "foo": 1e400})", 400, "", "number too large"},
        {kCmpl, R"({"prompt": "a", "foo": -1e400})", 400, "", "number too large"},
        {kChat, "{" + m + R"(, "n": 1e309})", 400, "", "number too large"},
        // A NUL ends nlohmann's input; what follows must not be silently dropped.
        {kCmpl, std::string("{\"prompt\": \"a\"}\0junk", 19), 400, "", "NUL byte"},
        {kCmpl, std::string("{\"prompt\": \"a\0b\"}", 17), 400, "", "NUL byte"},
        // model
        {kCmpl, R"({"model": "gpt-4", "prompt": "hi"})", 404, "model", "'gpt-4' does not exist"},
        {kCmpl, R"({"model": 3, "prompt": "hi"})", 400, "model", "must be a string"},
        // prompt
        {kCmpl, "{}", 400, "prompt", "'prompt' is required"},
        {kCmpl, R"({"prompt": 5})", 400, "prompt", "must be a string or an array"},
        {kCmpl, R"({"prompt": []})", 400, "prompt", "must not be empty"},
        {kCmpl, R"({"prompt": ""})", 400, "prompt", "must not be empty"},
        {kCmpl, R"({"prompt": [""]})", 400, "prompt", "must not be empty"},
        {kCmpl, R"({"prompt": [1, "b"]})", 400, "prompt", "array of token ids"},
        {kCmpl, R"({"prompt": ["a", [1]]})", 400, "prompt", "not a mix ('prompt[1]'"},
        {kCmpl, R"({"prompt": [[1], "a"]})", 400, "prompt", "not a mix"},
        {kCmpl, R"({"prompt": ["a", ""]})", 400, "prompt", "'prompt[1]' must not be empty"},
        {kCmpl, R"({"prompt": [[1], []]})", 400, "prompt", "'prompt[1]' must not be empty"},
        {kCmpl, R"({"prompt": [[1], [1000]]})", 400, "prompt", "in 'prompt[1]' is outside"},
        {kCmpl, R"({"prompt": [1, 1000]})", 400, "prompt", "outside the vocabulary"},
        {kCmpl, R"({"prompt": [-1]})", 400, "prompt", "outside the vocabulary"},
        {kCmpl, R"({"prompt": [1.5]})", 400, "prompt", "array of token ids"},
        // messages
        {kChat, "{}", 400, "messages", "'messages' is required"},
        {kChat, R"({"messages": []})", 400, "messages", "must not be empty"},
        {kChat, R"({"messages": "hi"})", 400, "messages", "must be an array"},
        {kChat, R"({"messages": ["hi"]})", 400, "messages[0]", "must be an object"},
        {kChat, R"({"messages": [{"content": "hi"}]})", 400, "messages[0].role",
         "must be a string"},
        {kChat, R"({"messages": [{"role": "robot", "content": "x"}]})", 400, "messages[0].role",
         "system, developer, user, assistant or tool"},
        {kChat, R"({"messages": [{"role": "tool", "content": "x"}]})", 400,
         "messages[0].tool_call_id", "is required"},
        {kChat, R"({"messages": [{"role": "user"}]})", 400, "messages[0].content", "is required"},
        {kChat, R"({"messages": [{"role": "user", "content": null}]})", 400, "messages[0].content",
         "must not be null"},
        {kChat, R"({"messages": [{"role": "user", "content": 7}]})", 400, "messages[0].content",
         "string or an array of text parts"},
        {kChat,
         R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
         400, "messages[0].content[0]", "only text content parts"},
        {kChat, R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", 400,
         "messages[0].content[0].text", "must be a string"},
        // max_tokens
        {kCmpl, "{" + p + R"(, "max_tokens": 0})", 400, "max_tokens",
         "needs 'echo' or 'prompt_logprobs'"},
        {kCmpl, "{" + p + R"(, "max_tokens": -5})", 400, "max_tokens", "must be >= 0"},
        {kCmpl, "{" + p + R"(, "max_tokens": "10"})", 400, "max_tokens",
         "must be an integer, got a string"},
        {kCmpl, "{" + p + R"(, "max_tokens": 1.5})", 400, "max_tokens", "must be an integer"},
        {kChat, "{" + m + R"(, "max_completion_tokens": 0})", 400, "max_completion_tokens", "> 0"},
        {kChat, "{" + m + R"(, "max_tokens": 0})", 400, "max_tokens", "> 0"},
        // sampling
        {kCmpl, "{" + p + R"(, "temperature": 2.5})", 400, "temperature", "[0, 2]"},
        {kCmpl, "{" + p + R"(, "temperature": -0.1})", 400, "temperature", "[0, 2]"},
        {kCmpl, "{" + p + R"(, "temperature": "hot"})", 400, "temperature", "must be a number"},
        {kCmpl, "{" + p + R"(, "top_p": 0})", 400, "top_p", "(0, 1]"},
        {kCmpl, "{" + p + R"(, "top_p": 1.01})", 400, "top_p", "(0, 1]"},
        {kCmpl, "{" + p + R"(, "top_k": -2})", 400, "top_k", "-1 or 0"},
        {kCmpl, "{" + p + R"(, "top_k": 2.5})", 400, "top_k", "must be an integer"},
        {kCmpl, "{" + p + R"(, "min_p": 1.5})", 400, "min_p", "[0, 1]"},
        {kCmpl, "{" + p + R"(, "seed": "x"})", 400, "seed", "must be an integer"},
        {kCmpl, "{" + p + R"(, "presence_penalty": 2.5})", 400, "presence_penalty", "[-2, 2]"},
        {kCmpl, "{" + p + R"(, "frequency_penalty": -3})", 400, "frequency_penalty", "[-2, 2]"},
        {kCmpl, "{" + p + R"(, "repetition_penalty": 0})", 400, "repetition_penalty", "(0, 10]"},
        {kCmpl, "{" + p + R"(, "logit_bias": [5]})", 400, "logit_bias", "must be an object"},
        {kCmpl, "{" + p + R"(, "logit_bias": {"x": 1}})", 400, "logit_bias", "not a token id"},
        {kCmpl, "{" + p + R"(, "logit_bias": {"1000": 1}})", 400, "logit_bias", "0..999"},
        {kCmpl, "{" + p + R"(, "logit_bias": {"-1": 1}})", 400, "logit_bias", "not a token id"},
        {kCmpl, "{" + p + R"(, "logit_bias": {"5": 101}})", 400, "logit_bias", "[-100, 100]"},
        {kCmpl, "{" + p + R"(, "logit_bias": {"5": "up"}})", 400, "logit_bias", "[-100, 100]"},
        {kCmpl, "{" + p + R"(, "logit_bias": {"5": 1, "05": 2}})", 400, "logit_bias", "twice"},
        {kCmpl, "{" + p + R"(, "min_tokens": -1})", 400, "min_tokens", ">= 0"},
        {kCmpl, "{" + p + R"(, "min_tokens": 9, "max_tokens": 8})", 400, "min_tokens",
         "must not exceed"},
        {kCmpl, "{" + p + R"(, "stop_token_ids": 5})", 400, "stop_token_ids", "array"},
        {kCmpl, "{" + p + R"(, "stop_token_ids": [1000]})", 400, "stop_token_ids", "0..999"},
        {kCmpl, "{" + p + R"(, "include_stop_str_in_output": 1})", 400,
         "include_stop_str_in_output", "must be a boolean"},
        {kCmpl, "{" + p + R"(, "skip_special_tokens": "no"})", 400, "skip_special_tokens",
         "must be a boolean"},
        // vLLM and OpenAI options kvshard does not implement: refused by name, never ignored.
        // Structured outputs: what the grammar compilers do not support, named with its path.
        {kChat, "{" + m + R"(, "guided_json": {"type": "number", "minimum": 1}})", 400,
         "guided_json", "guided_json.minimum: JSON Schema keyword not supported"},
        {kChat, "{" + m + R"(, "guided_choice": []})", 400, "guided_choice", "non-empty"},
        {kCmpl, "{" + p + R"(, "guided_regex": "(a"})", 400, "guided_regex", "unterminated"},
        {kCmpl, "{" + p + R"(, "guided_grammar": "start: \"a\""})", 400, "guided_grammar",
         "kvshard accepts GBNF"},
        {kChat, "{" + m + R"(, "structured_outputs": {"grammar": "root ::= x"}})", 400,
         "structured_outputs.grammar", "rule 'x' is used but never defined"},
        {kChat, "{" + m + R"(, "guided_choice": ["a"], "guided_regex": "b"})", 400,
         "guided_choice", "give one"},
        {kChat, "{" + m + R"(, "response_format": {"type": "xml"}})", 400,
         "response_format.type", "must be"},
        {kChat, "{" + m + R"(, "response_format": {"type": "json_schema", "json_schema": {"name":
         "n", "schema": {"type": "object", "properties": {"s": {"type": "string", "format":
         "hostname"}}}}}})", 400, "response_format.json_schema.schema",
         "response_format.json_schema.schema.properties.s.format"},
        {kCmpl, "{" + p + R"(, "prompt_logprobs": 21})", 400, "prompt_logprobs", "0..20"},
        {kCmpl, "{" + p + R"(, "prompt_logprobs": -1})", 400, "prompt_logprobs", "0..20"},
        {kChat, "{" + m + R"(, "prompt_logprobs": 1, "stream": true})", 400, "prompt_logprobs",
         "not supported with 'stream'"},
        {kCmpl, "{" + p + R"(, "use_beam_search": true})", 400, "use_beam_search", "not supported"},
        {kCmpl, "{" + p + R"(, "return_tokens_as_token_ids": true})", 400,
         "return_tokens_as_token_ids", "not supported"},
        {kCmpl, "{" + p + R"(, "truncate_prompt_tokens": 5})", 400, "truncate_prompt_tokens",
         "not supported"},
        {kCmpl, "{" + p + R"(, "typical_p": 0.9})", 400, "typical_p", "not supported"},
        {kCmpl, "{" + p + R"(, "priority": 1})", 400, "priority", "first come, first served"},
        {kChat, "{" + m + R"(, "continue_final_message": true})", 400, "continue_final_message",
         "not supported"},
        // stop
        {kCmpl, "{" + p + R"(, "stop": ["a", "b", "c", "d", "e"]})", 400, "stop", "at most 4"},
        {kCmpl, "{" + p + R"(, "stop": [1]})", 400, "stop", "string or an array of strings"},
        {kCmpl, "{" + p + R"(, "stop": 5})", 400, "stop", "string or an array of strings"},
        {kCmpl, "{" + p + R"(, "stop": ""})", 400, "stop", "must not be empty"},
        // n
        {kCmpl, "{" + p + R"(, "n": 0})", 400, "n", "1..16"},
        {kCmpl, "{" + p + R"(, "n": 17})", 400, "n", "1..16"},
        {kCmpl, "{" + p + R"(, "best_of": 3})", 400, "best_of", "not supported"},
        // logprobs
        {kCmpl, "{" + p + R"(, "logprobs": 21})", 400, "logprobs", "0..20"},
        {kCmpl, "{" + p + R"(, "logprobs": true})", 400, "logprobs", "must be an integer"},
        {kChat, "{" + m + R"(, "logprobs": 2})", 400, "logprobs", "must be a boolean"},
        {kChat, "{" + m + R"(, "logprobs": true, "top_logprobs": 21})", 400, "top_logprobs",
         "0..20"},
        {kChat, "{" + m + R"(, "top_logprobs": 2})", 400, "top_logprobs", "needs 'logprobs'"},
        // streaming and flags
        {kCmpl, "{" + p + R"(, "stream": "yes"})", 400, "stream", "must be a boolean"},
        {kCmpl, "{" + p + R"(, "stream_options": {"include_usage": true}})", 400, "stream_options",
         "only allowed when 'stream' is true"},
        {kCmpl, "{" + p + R"(, "stream": true, "stream_options": 1})", 400, "stream_options",
         "must be an object"},
        {kCmpl, "{" + p + R"(, "stream": true, "stream_options": {"include_usage": 1}})", 400,
         "stream_options.include_usage", "must be a boolean"},
        {kCmpl, "{" + p + R"(, "ignore_eos": 1})", 400, "ignore_eos", "must be a boolean"},
        {kChat, "{" + m + R"(, "echo": true})", 400, "echo", "not supported on chat"},
        {kCmpl, "{" + p + R"(, "suffix": "x"})", 400, "suffix", "not supported"},
        {kCmpl, "{" + p + R"(, "user": 5})", 400, "user", "must be a string"},
        {kChat, "{" + m + R"(, "tools": [{"type": "function"}]})", 400, "tools[0].function",
         "must be an object"},
        {kChat, "{" + m + R"(, "tool_choice": "required"})", 400, "tool_choice",
         "there are no 'tools'"},
    };
    for (const BadCase& c : cases) {
        ParsedRequest r = ParseOpenAiRequest(c.endpoint, c.body, kModel);
        const ApiError* e = std::get_if<ApiError>(&r);
        ASSERT_NE(e, nullptr) << "accepted: " << c.body;
        EXPECT_EQ(e->http_status, c.status) << c.body;
        EXPECT_EQ(e->param, c.param) << c.body << " -> " << e->message;
        EXPECT_NE(e->message.find(c.message_part), std::string::npos)
            << c.body << " -> " << e->message;
        // kvshard's words, not the JSON library's.
        for (const char* library : {"json.exception", "parse_error", "out_of_range", "syntax"}) {
            EXPECT_EQ(e->message.find(library), std::string::npos)
                << c.body << " -> " << e->message;
        }
        // The body is OpenAI's error shape.
        const json body = json::parse(ApiErrorBody(*e));
        EXPECT_EQ(body["error"]["message"], e->message);
        EXPECT_TRUE(body["error"]["type"].is_string());
        EXPECT_EQ(body["error"]["param"].is_null(), c.param.empty());
        EXPECT_TRUE(body["error"].contains("code"));
    }
}

// Out-of-range numbers are echoed as %g does, not as the 309 digits of 1e308.
TEST(OpenAiProtocol, EchoedNumbersAreShort) {
    for (const char* body :
         {R"({"prompt": "a", "temperature": 1e308})", R"({"prompt": "a", "top_p": -1e300})",
          R"({"prompt": "a", "min_p": 1.7976931348623157e308})"}) {
        ParsedRequest r = ParseOpenAiRequest(kCmpl, body, kModel);
        const ApiError* e = std::get_if<ApiError>(&r);
        ASSERT_NE(e, nullptr) << body;
        EXPECT_LT(e->message.size(), 80u) << e->message;
        EXPECT_TRUE(e->message.find("e+308") != std::string::npos ||
                    e->message.find("e+300") != std::string::npos)
            << e->message;
    }
}

TEST(OpenAiProtocol, UnknownModelIsModelNotFound) {
    ParsedRequest r = ParseOpenAiRequest(kCmpl, R"({"model": "x", "prompt": "a"})", kModel);
    const ApiError& e = std::get<ApiError>(r);
    EXPECT_EQ(e.http_status, 404);
    EXPECT_EQ(e.code, "model_not_found");
    const json body = json::parse(ApiErrorBody(e));
    EXPECT_EQ(body["error"]["code"], "model_not_found");
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
}

TEST(OpenAiProtocol, AcceptsModelNameBaseNameOrNone) {
    for (const char* body :
         {R"({"model": "smol", "prompt": "a"})", R"({"model": "SmolLM2.gguf", "prompt": "a"})",
          R"({"prompt": "a"})", R"({"model": null, "prompt": "a"})"}) {
        EXPECT_TRUE(std::holds_alternative<OpenAiRequest>(ParseOpenAiRequest(kCmpl, body, kModel)))
            << body;
    }
}

TEST(OpenAiProtocol, CompletionDefaultsAndValues) {
    OpenAiRequest d = ParseOk(kCmpl, R"({"prompt": "Once"})");
    EXPECT_EQ(d.prompt, "Once");
    EXPECT_FALSE(d.prompt_is_token_ids);
    EXPECT_FALSE(d.max_tokens.has_value());
    EXPECT_FLOAT_EQ(d.sampling.temperature, 1.0f);  // the API's default
    EXPECT_FLOAT_EQ(d.sampling.top_p, 1.0f);
    EXPECT_EQ(d.sampling.top_k, 0);
    EXPECT_FALSE(d.has_seed);
    EXPECT_EQ(d.n, 1);
    EXPECT_EQ(d.num_top_logprobs, -1);
    EXPECT_FALSE(d.stream);

    OpenAiRequest r = ParseOk(kCmpl, R"({"prompt": ["Once"], "max_tokens": 32, "temperature": 0,
        "top_p": 0.9, "top_k": -1, "min_p": 0.05, "seed": -1, "stop": "\n", "n": 3, "logprobs": 2,
        "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true,
        "echo": false, "presence_penalty": 0, "user": "u", "best_of": 3, "unknown_field": [1]})");
    EXPECT_EQ(r.prompt, "Once");
    EXPECT_EQ(*r.max_tokens, 32);
    EXPECT_FLOAT_EQ(r.sampling.temperature, 0.0f);
    EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
    EXPECT_EQ(r.sampling.top_k, 0);
    EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
    EXPECT_TRUE(r.has_seed);
    EXPECT_EQ(r.sampling.seed, ~uint64_t{0});
    EXPECT_EQ(r.stop, (std::vector<std::string>{"\n"}));
    EXPECT_EQ(r.n, 3);
    EXPECT_EQ(r.num_top_logprobs, 2);
    EXPECT_TRUE(r.stream);
    EXPECT_TRUE(r.include_usage);
    EXPECT_TRUE(r.ignore_eos);

    OpenAiRequest ids = ParseOk(kCmpl, R"({"prompt": [[1, 2, 999]], "top_k": 40})");
    EXPECT_TRUE(ids.prompt_is_token_ids);
    EXPECT_EQ(ids.prompt_token_ids, (std::vector<int32_t>{1, 2, 999}));
    EXPECT_EQ(ids.sampling.top_k, 40);
    EXPECT_EQ(ParseOk(kCmpl, R"({"prompt": [5]})").prompt_token_ids, (std::vector<int32_t>{5}));
    EXPECT_EQ(*ParseOk(kCmpl, R"({"prompt": "a", "max_tokens": 8.0})").max_tokens, 8);
}

TEST(OpenAiProtocol, ListsOfPrompts) {
    OpenAiRequest r = ParseOk(kCmpl, R"({"prompt": ["a", "bc", "d"], "n": 2})");
    EXPECT_EQ(r.prompt, "a");
    EXPECT_FALSE(r.prompt_is_token_ids);
    ASSERT_EQ(r.more_prompts.size(), 2u);
    EXPECT_EQ(r.more_prompts[0].text, "bc");
    EXPECT_EQ(r.more_prompts[1].text, "d");
    EXPECT_EQ(r.n, 2);
    r = ParseOk(kCmpl, R"({"prompt": [[1, 2], [3]]})");
    EXPECT_EQ(r.prompt_token_ids, (std::vector<int32_t>{1, 2}));
    ASSERT_EQ(r.more_prompts.size(), 1u);
    EXPECT_TRUE(r.more_prompts[0].is_token_ids);
    EXPECT_EQ(r.more_prompts[0].token_ids, (std::vector<int32_t>{3}));
    EXPECT_FALSE(r.echo);
    EXPECT_TRUE(ParseOk(kCmpl, R"({"prompt": ["a", "b"], "echo": true})").echo);
    // One prompt in a list, and one token-id list, are a single prompt.
    r = ParseOk(kCmpl, R"({"prompt": ["a"]})");
    EXPECT_EQ(r.prompt, "a");
    EXPECT_TRUE(r.more_prompts.empty());
    r = ParseOk(kCmpl, R"({"prompt": [[7, 8]]})");
    EXPECT_EQ(r.prompt_token_ids, (std::vector<int32_t>{7, 8}));
    EXPECT_TRUE(r.more_prompts.empty());
    r = ParseOk(kCmpl, R"({"prompt": [7, 8]})");
    EXPECT_EQ(r.prompt_token_ids, (std::vector<int32_t>{7, 8}));
    EXPECT_TRUE(r.more_prompts.empty());

    // Too many prompts, or too many choices over them: 400s that say so.
    json many = {{"prompt", json::array()}};
    for (int i = 0; i < 257; ++i) many["prompt"].push_back("p");
    ParsedRequest bad = ParseOpenAiRequest(kCmpl, many.dump(), kModel);
    ASSERT_TRUE(std::holds_alternative<ApiError>(bad));
    EXPECT_NE(std::get<ApiError>(bad).message.find("at most 256 prompts"), std::string::npos);
    many["prompt"].erase(many["prompt"].begin() + 65, many["prompt"].end());
    many["n"] = 16;
    bad = ParseOpenAiRequest(kCmpl, many.dump(), kModel);
    ASSERT_TRUE(std::holds_alternative<ApiError>(bad));
    EXPECT_EQ(std::get<ApiError>(bad).param, "n");
    EXPECT_NE(std::get<ApiError>(bad).message.find("1040 choices"), std::string::npos);
    many["n"] = 15;
    EXPECT_TRUE(
        std::holds_alternative<OpenAiRequest>(ParseOpenAiRequest(kCmpl, many.dump(), kModel)));
}

TEST(OpenAiProtocol, ChatValues) {
    OpenAiRequest r = ParseOk(kChat, R"({"model": "smol", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "name": "bot"}],
        "max_tokens": 5, "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 3,
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"}})");
    ASSERT_EQ(r.messages.size(), 3u);
    EXPECT_EQ(r.messages[0].role, "system");
    EXPECT_EQ(r.messages[1].content, "a\nb");
    EXPECT_EQ(r.messages[2].content, "ok");
    EXPECT_EQ(*r.max_tokens, 7);  // max_completion_tokens wins
    EXPECT_EQ(r.num_top_logprobs, 3);
    EXPECT_TRUE(r.add_generation_prompt);
    EXPECT_EQ(
        ParseOk(kChat, R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})")
            .num_top_logprobs,
        0);
    EXPECT_EQ(
        ParseOk(kChat, R"({"messages": [{"role": "user", "content": "x"}], "logprobs": false})")
            .num_top_logprobs,
        -1);
}

TEST(OpenAiProtocol, SamplingAndOutputControls) {
    const OpenAiRequest r = ParseOk(kCmpl, R"({"prompt": "x", "presence_penalty": 0.5,
        "frequency_penalty": -1, "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 2.5},
        "min_tokens": 4, "max_tokens": 9, "stop_token_ids": [5, 6],
        "include_stop_str_in_output": true, "skip_special_tokens": false, "logprobs": 20,
        "use_beam_search": false, "typical_p": 1, "priority": 0, "prompt_logprobs": null})");
    EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
    EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -1.0f);
    EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.2f);
    EXPECT_EQ(r.sampling.logit_bias, (std::vector<TokenBias>{{3, 2.5f}, {7, -100.0f}}));
    EXPECT_EQ(r.sampling.min_tokens, 4);
    EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{5, 6}));
    EXPECT_TRUE(r.include_stop_str_in_output);
    EXPECT_FALSE(r.skip_special_tokens);
    EXPECT_EQ(r.num_top_logprobs, 20);
    const OpenAiRequest d = ParseOk(kCmpl, R"({"prompt": "x"})");
    EXPECT_EQ(d.sampling.repetition_penalty, 1.0f);
    EXPECT_TRUE(d.sampling.logit_bias.empty());
    EXPECT_TRUE(d.skip_special_tokens);
    EXPECT_FALSE(d.include_stop_str_in_output);
}

TEST(OpenAiProtocol, PromptLogprobsAndEchoWithLogprobs) {
    // lm-eval's loglikelihood call: the prompt scored with its top 1, nothing generated.
    const OpenAiRequest ll =
        ParseOk(kCmpl, R"({"prompt": "x y", "echo": true, "logprobs": 1, "max_tokens": 0})");
    EXPECT_TRUE(ll.echo);
    EXPECT_EQ(ll.max_tokens, 0);
    EXPECT_EQ(ll.num_top_logprobs, 1);
    EXPECT_EQ(ll.num_prompt_logprobs, 1);
    EXPECT_FALSE(ll.prompt_logprobs.has_value());
    const OpenAiRequest chat =
        ParseOk(kChat, R"({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 3})");
    EXPECT_EQ(chat.prompt_logprobs, 3);
    EXPECT_EQ(chat.num_prompt_logprobs, 3);
    // Both: the prompt is scored once, with the larger number of alternatives.
    EXPECT_EQ(ParseOk(kCmpl, R"({"prompt": "x", "echo": true, "logprobs": 5, "prompt_logprobs": 2,
        "max_tokens": 0})")
                  .num_prompt_logprobs,
              5);
    // Echo without logprobs, or logprobs without echo, scores nothing.
    EXPECT_EQ(ParseOk(kCmpl, R"({"prompt": "x", "echo": true})").num_prompt_logprobs, -1);
    EXPECT_EQ(ParseOk(kCmpl, R"({"prompt": "x", "logprobs": 2})").num_prompt_logprobs, -1);
}

TEST(OpenAiProtocol, DeveloperMessagesAreSystemInstructions) {
    const OpenAiRequest r = ParseOk(kChat, R"({"messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})");
    ASSERT_EQ(r.messages.size(), 2u);
    EXPECT_EQ(r.messages[0].role, "system");
    EXPECT_EQ(r.messages[0].content, "Be brief.");
}

TEST(OpenAiProtocol, CacheControlExtensionMarksBreakpoints) {
    const OpenAiRequest r = ParseOk(kChat, R"({"messages": [
        {"role": "system", "content": [
            {"type": "text", "text": "Rules.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "More", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {"role": "user", "content": "Hi", "cache_control": {"type": "ephemeral"}}]})");
    ASSERT_EQ(r.messages.size(), 2u);
    EXPECT_EQ(r.messages[0].content, "Rules.\nMore");
    ASSERT_EQ(r.messages[0].cache_marks.size(), 2u);
    EXPECT_EQ(r.messages[0].cache_marks[0].content_end, 6u);
    EXPECT_EQ(r.messages[0].cache_marks[0].ttl_ms, 5 * 60 * 1000);
    EXPECT_EQ(r.messages[0].cache_marks[1].content_end, 11u);
    EXPECT_EQ(r.messages[0].cache_marks[1].ttl_ms, 60 * 60 * 1000);
    ASSERT_EQ(r.messages[1].cache_marks.size(), 1u);
    EXPECT_EQ(r.messages[1].cache_marks[0].content_end, 2u);

    const std::string cc = R"("cache_control": {"type": "ephemeral"})";
    const std::string five = R"({"messages": [)" + [&] {
        std::string m;
        for (int i = 0; i < 5; ++i) {
            m += std::string(i ? ", " : "") + R"({"role": "user", "content": "x", )" + cc + "}";
        }
        return m;
    }() + "]}";
    const struct {
        std::string body, param, part;
    } bad[] = {
        {five, "messages[4].cache_control", "at most 4"},
        {R"({"messages": [{"role": "user", "content": "x", "cache_control": {"type": "x"}}]})",
         "messages[0].cache_control.type", "ephemeral"},
        {R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
            "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]})",
         "messages[0].content[0].cache_control.ttl", "\"5m\" or \"1h\""},
        {R"({"messages": [{"role": "user", "content": "x", "cache_control": true}]})",
         "messages[0].cache_control", "must be an object"},
    };
    for (const auto& c : bad) {
        ParsedRequest p = ParseOpenAiRequest(kChat, c.body, kModel);
        const auto* e = std::get_if<ApiError>(&p);
        ASSERT_NE(e, nullptr) << c.body;
        EXPECT_EQ(e->param, c.param) << c.body;
        EXPECT_NE(e->message.find(c.part), std::string::npos) << e->message;
    }
}

TEST(OpenAiProtocol, ResolveMaxTokens) {
    OpenAiRequest cmpl;
    cmpl.endpoint = kCmpl;
    EXPECT_EQ(std::get<int64_t>(ResolveMaxTokens(cmpl, 10, 100)), 16);  // the API's default
    EXPECT_EQ(std::get<int64_t>(ResolveMaxTokens(cmpl, 90, 100)), 10);
    OpenAiRequest chat;
    chat.endpoint = kChat;
    EXPECT_EQ(std::get<int64_t>(ResolveMaxTokens(chat, 10, 100)), 90);  // the rest of the context
    chat.max_tokens = 90;
    EXPECT_EQ(std::get<int64_t>(ResolveMaxTokens(chat, 10, 100)), 90);
    chat.max_tokens = 91;
    const ApiError over = std::get<ApiError>(ResolveMaxTokens(chat, 10, 100));
    EXPECT_EQ(over.http_status, 400);
    EXPECT_EQ(over.param, "max_tokens");
    EXPECT_EQ(over.code, "context_length_exceeded");
    const ApiError too_long = std::get<ApiError>(ResolveMaxTokens(cmpl, 100, 100));
    EXPECT_EQ(too_long.param, "prompt");
    EXPECT_NE(too_long.message.find("100 tokens"), std::string::npos);
    EXPECT_EQ(std::get<ApiError>(ResolveMaxTokens(chat, 150, 100)).param, "messages");
    // The error names the field the client sent.
    auto parsed = ParseOpenAiRequest(
        kChat, R"({"model": "smol", "messages": [{"role": "user", "content": "x"}],
                   "max_completion_tokens": 95})",
        kModel);
    const ApiError named =
        std::get<ApiError>(ResolveMaxTokens(std::get<OpenAiRequest>(parsed), 10, 100));
    EXPECT_EQ(named.param, "max_completion_tokens");
    EXPECT_NE(named.message.find("max_completion_tokens (95)"), std::string::npos) << named.message;
}

TEST(OpenAiProtocolTest, StructuredOutputsCompileIntoTheRequestsGrammar) {
    const std::string m = R"("model": "smol", "messages": [{"role": "user", "content": "x"}])";
    auto accepts = [](const OpenAiRequest& r, const std::string& text) {
        grammar::GrammarState s(r.grammar);
        return s.AdvanceBytes(text) && s.CanEnd();
    };
    EXPECT_EQ(ParseOk(ApiEndpoint::kChatCompletions, "{" + m + "}").grammar, nullptr);
    EXPECT_EQ(ParseOk(ApiEndpoint::kChatCompletions,
                      "{" + m + R"(, "response_format": {"type": "text"}})")
                  .grammar,
              nullptr);
    OpenAiRequest r = ParseOk(ApiEndpoint::kChatCompletions,
                              "{" + m + R"(, "response_format": {"type": "json_schema",
        "json_schema": {"name": "p", "strict": true, "schema": {"type": "object",
        "properties": {"n": {"type": "integer"}}, "required": ["n"],
        "additionalProperties": false}}}})");
    ASSERT_NE(r.grammar, nullptr);
    EXPECT_TRUE(accepts(r, R"({"n": 3})"));
    EXPECT_FALSE(accepts(r, R"({"n": "3"})"));
    r = ParseOk(ApiEndpoint::kChatCompletions,
                "{" + m + R"(, "response_format": {"type": "json_object"}})");
    EXPECT_TRUE(accepts(r, R"({"any": [1]})"));
    r = ParseOk(ApiEndpoint::kCompletions,
                R"({"model": "smol", "prompt": "x", "guided_json": "{\"type\": \"boolean\"}"})");
    EXPECT_TRUE(accepts(r, "false"));
    r = ParseOk(
        ApiEndpoint::kCompletions,
        R"({"model": "smol", "prompt": "x", "structured_outputs": {"choice": ["up", "down"]}})");
    EXPECT_TRUE(accepts(r, "down"));
    EXPECT_FALSE(accepts(r, "do"));
    r = ParseOk(ApiEndpoint::kChatCompletions, "{" + m + R"(, "guided_regex": "[0-9]{2}"})");
    EXPECT_TRUE(accepts(r, "42"));
}

}  // namespace
}  // namespace kvshard
