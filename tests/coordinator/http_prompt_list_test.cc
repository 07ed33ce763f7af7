// POST /v1/completions with a list of prompts (LangChain's batch, lm-eval's local-completions):
// one engine request per prompt, choice i*n + j of the answer is choice j of prompt i, usage
// summed, streamed and whole; a prompt the engine refuses takes the others down with it.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::Post;
using testing::SseData;
using testing::TestServer;
using testing::TestServerOptions;
using namespace std::chrono_literals;

TEST(HttpPromptList, OneChoicePerPromptTimesN) {
    TestServer server;
    auto r = Post(server.port(), "/v1/completions",
                  R"({"prompt": ["Hi", "Hello", "Hey!"], "n": 2, "max_tokens": 3})");
    ASSERT_EQ(r.status, 200) << r.body;
    const json body = json::parse(r.body);
    ASSERT_EQ(body["choices"].size(), 6u);
    for (size_t i = 0; i < 6; ++i) {
        EXPECT_EQ(body["choices"][i]["index"], i);
        EXPECT_EQ(body["choices"][i]["text"], "Hello, world");
        EXPECT_EQ(body["choices"][i]["finish_reason"], "length");
    }
    // Byte tokenizer: 2 + 5 + 4 prompt tokens; 3 tokens for each of 6 choices.
    EXPECT_EQ(body["usage"]["prompt_tokens"], 11);
    EXPECT_EQ(body["usage"]["completion_tokens"], 18);
    EXPECT_EQ(body["usage"]["total_tokens"], 29);
    const auto submitted = server.engine().submitted();
    ASSERT_EQ(submitted.size(), 3u);
    std::map<std::string, std::string> prompts;  // request id -> prompt
    for (const GenerationRequest& g : submitted) {
        prompts[g.request_id] = std::string(g.prompt_token_ids.begin(), g.prompt_token_ids.end());
        EXPECT_EQ(g.n, 2);
        EXPECT_EQ(g.max_tokens, 3);
    }
    const std::string id = body["id"];
    EXPECT_EQ(prompts[id], "Hi");
    EXPECT_EQ(prompts[id + "-1"], "Hello");
    EXPECT_EQ(prompts[id + "-2"], "Hey!");
}

TEST(HttpPromptList, TokenIdListsAndStreaming) {
    TestServer server;
    auto r = Post(server.port(), "/v1/completions",
                  R"({"prompt": [[72, 105], [72]], "max_tokens": 2, "stream": true,
                      "stream_options": {"include_usage": true}})");
    ASSERT_EQ(r.status, 200) << r.body;
    const std::vector<std::string> events = SseData(r.body);
    ASSERT_FALSE(events.empty());
    EXPECT_EQ(events.back(), "[DONE]");
    std::map<int, std::string> text;
    std::map<int, std::string> finish;
    json usage;
    for (size_t i = 0; i + 1 < events.size(); ++i) {
        const json chunk = json::parse(events[i]);
        if (chunk["choices"].empty()) {
            usage = chunk["usage"];
            continue;
        }
        for (const json& c : chunk["choices"]) {
            text[c["index"]] += c["text"].get<std::string>();
            if (!c["finish_reason"].is_null()) finish[c["index"]] = c["finish_reason"];
        }
    }
    ASSERT_EQ(text.size(), 2u);
    EXPECT_EQ(text[0], "Hello,");
    EXPECT_EQ(text[1], "Hello,");
    EXPECT_EQ(finish[0], "length");
    EXPECT_EQ(finish[1], "length");
    EXPECT_EQ(usage["prompt_tokens"], 3);
    EXPECT_EQ(usage["completion_tokens"], 4);
    const auto submitted = server.engine().submitted();
    ASSERT_EQ(submitted.size(), 2u);
    EXPECT_EQ(submitted[0].prompt_token_ids, (std::vector<int32_t>{72, 105}));
    EXPECT_EQ(submitted[1].prompt_token_ids, (std::vector<int32_t>{72}));
}

// Each prompt gets its own token budget from the context: one that does not fit is a 400 naming
// it, before anything runs.
TEST(HttpPromptList, EachPromptIsCheckedAgainstTheContext) {
    TestServerOptions o;
    o.engine.max_context = 8;
    TestServer server(o);
    auto r = Post(server.port(), "/v1/completions",
                  R"({"prompt": ["Hi", "a long prompt"], "max_tokens": 2})");
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_NE(r.body.find("prompt[1]"), std::string::npos) << r.body;
    EXPECT_TRUE(server.engine().submitted().empty());
    // Without max_tokens each gets min(16, its room).
    r = Post(server.port(), "/v1/completions", R"({"prompt": ["Hi", "Hello"]})");
    ASSERT_EQ(r.status, 200) << r.body;
    const auto submitted = server.engine().submitted();
    ASSERT_EQ(submitted.size(), 2u);
    EXPECT_EQ(submitted[0].max_tokens, 6);
    EXPECT_EQ(submitted[1].max_tokens, 3);
}

// The engine refuses the second prompt (its queue is full): the first is aborted and the client
// gets the one 429.
TEST(HttpPromptList, ARefusedPromptAbortsTheOthers) {
    TestServerOptions o;
    o.engine.max_active = 1;
    o.engine.hold_after = 1;
    TestServer server(o);
    auto r = Post(server.port(), "/v1/completions", R"({"prompt": ["Hi", "Ho"], "max_tokens": 4})");
    EXPECT_EQ(r.status, 429) << r.body;
    ASSERT_EQ(server.engine().submitted().size(), 1u);
    EXPECT_TRUE(server.engine().WaitForAbort(server.engine().submitted()[0].request_id, 5s));
}

// A part that fails mid-way ends the answer with the error, and the other parts are aborted.
TEST(HttpPromptList, APartThatFailsEndsTheAnswer) {
    TestServerOptions o;
    o.engine.hold_after = 1;
    TestServer server(o);
    std::thread fail([&] {
        ASSERT_TRUE(server.engine().WaitForSubmitted(2, 5s));
        server.engine().FailAll(Status(StatusCode::kInternal, "worker died"));
    });
    auto r = Post(server.port(), "/v1/completions", R"({"prompt": ["Hi", "Ho"], "max_tokens": 4})");
    fail.join();
    EXPECT_EQ(r.status, 500) << r.body;
}

}  // namespace
}  // namespace kvshard

namespace kvshard {
namespace {

// echo: each choice's text starts with its prompt's, whole and streamed; token-id prompts are
// echoed as their text.
TEST(HttpEcho, ChoicesStartWithTheirPrompt) {
    TestServer server;
    auto r = Post(server.port(), "/v1/completions",
                  R"({"prompt": ["Hi", "Ho"], "n": 2, "max_tokens": 2, "echo": true})");
    ASSERT_EQ(r.status, 200) << r.body;
    const json body = json::parse(r.body);
    ASSERT_EQ(body["choices"].size(), 4u);
    EXPECT_EQ(body["choices"][0]["text"], "HiHello,");
    EXPECT_EQ(body["choices"][1]["text"], "HiHello,");
    EXPECT_EQ(body["choices"][2]["text"], "HoHello,");
    EXPECT_EQ(body["choices"][3]["text"], "HoHello,");
    EXPECT_EQ(body["usage"]["completion_tokens"], 8);  // the echo is not generated
    auto ids = Post(server.port(), "/v1/completions",
                    R"({"prompt": [[72, 111]], "max_tokens": 1, "echo": true})");
    ASSERT_EQ(ids.status, 200) << ids.body;
    EXPECT_EQ(json::parse(ids.body)["choices"][0]["text"], "HoHello");

    auto s = Post(server.port(), "/v1/completions",
                  R"({"prompt": "Hi", "max_tokens": 3, "echo": true, "stream": true})");
    ASSERT_EQ(s.status, 200) << s.body;
    const std::vector<std::string> events = SseData(s.body);
    ASSERT_GE(events.size(), 2u);
    EXPECT_EQ(json::parse(events[0])["choices"][0]["text"], "HiHello");
    std::string text;
    for (size_t i = 0; i + 1 < events.size(); ++i) {
        text += json::parse(events[i])["choices"][0]["text"].get<std::string>();
    }
    EXPECT_EQ(text, "HiHello, world");
    // Without echo, as before.
    auto plain = Post(server.port(), "/v1/completions", R"({"prompt": "Hi", "max_tokens": 2})");
    EXPECT_EQ(json::parse(plain.body)["choices"][0]["text"], "Hello,");
}

}  // namespace
}  // namespace kvshard
