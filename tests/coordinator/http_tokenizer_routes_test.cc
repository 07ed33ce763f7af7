// The routes around generation, over loopback: GET /v1/models/{id}, vLLM's POST /tokenize and
// POST /detokenize, GET /version. Tokenize must count what the generation routes submit.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::ByteTokenizer;
using testing::Get;
using testing::Post;
using testing::TestClient;
using testing::TestServer;
using testing::TestServerOptions;
namespace http = boost::beast::http;

std::vector<int32_t> Ids(const json& tokens) { return tokens.get<std::vector<int32_t>>(); }

constexpr int32_t kBos = 258;

// ByteTokenizer with a BOS <s> (258) that the tokenizer adds, as Llama's does.
std::shared_ptr<Tokenizer> ByteTokenizerWithBos() {
    TokenizerData d = ByteTokenizer()->data();
    d.tokens.push_back("<s>");
    d.types.push_back(TokenType::kControl);
    d.bos_id = kBos;
    d.add_bos = true;
    auto tok = Tokenizer::Create(std::move(d));
    EXPECT_TRUE(tok.ok()) << tok.status().ToString();
    return std::move(tok).value();
}

TEST(HttpModelRoute, TheServedModelByIdAnd404NamingAnUnknownOne) {
    TestServer server;
    const json list = json::parse(Get(server.port(), "/v1/models").body);
    for (const char* id : {"test-model", "test-model.gguf"}) {
        auto reply = Get(server.port(), std::string("/v1/models/") + id);
        ASSERT_EQ(reply.status, 200) << id << " " << reply.body;
        EXPECT_EQ(reply.message[http::field::content_type], "application/json");
        EXPECT_EQ(json::parse(reply.body), list["data"][0]) << id;
    }
    auto missing = Get(server.port(), "/v1/models/meta-llama%2FLlama-3-8B");
    EXPECT_EQ(missing.status, 404);
    const json error = json::parse(missing.body)["error"];
    EXPECT_EQ(error["code"], "model_not_found");
    EXPECT_EQ(error["param"], "model");
    EXPECT_NE(error["message"].get<std::string>().find("'meta-llama/Llama-3-8B'"),
              std::string::npos)
        << error;

    TestClient client(server.port());
    auto head = client.Send(http::verb::head, "/v1/models/test-model");
    EXPECT_EQ(head.status, 200);
    EXPECT_TRUE(head.body.empty());
    auto post = client.Send(http::verb::post, "/v1/models/test-model", "{}");
    EXPECT_EQ(post.status, 405);
    EXPECT_EQ(post.message[http::field::allow], "GET, HEAD");
}

TEST(HttpTokenizeRoute, PromptTextAsTheCompletionsRouteEncodesIt) {
    TestServer server;
    auto reply = Post(server.port(), "/tokenize", R"({"model": "test-model", "prompt": "Hi"})");
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json b = json::parse(reply.body);
    EXPECT_EQ(Ids(b["tokens"]), (std::vector<int32_t>{'H', 'i'}));
    EXPECT_EQ(b["count"], 2);
    EXPECT_EQ(b["max_model_len"], 4096);
    EXPECT_TRUE(b["token_strs"].is_null());  // vLLM: null unless asked for

    // Special-token text is the token, as in a completions prompt.
    auto special = json::parse(Post(server.port(), "/tokenize",
                                    R"({"prompt": "<|im_start|>x", "return_token_strs": true})")
                                   .body);
    EXPECT_EQ(Ids(special["tokens"]), (std::vector<int32_t>{256, 'x'}));
    EXPECT_EQ(special["token_strs"], json::array({"<|im_start|>", "x"}));

    // An empty prompt is a question with an answer.
    auto empty = Post(server.port(), "/tokenize", R"({"prompt": ""})");
    ASSERT_EQ(empty.status, 200) << empty.body;
    EXPECT_EQ(json::parse(empty.body)["count"], 0);
    EXPECT_TRUE(server.engine().submitted().empty());
}

TEST(HttpTokenizeRoute, MessagesCountWhatTheChatRouteSubmits) {
    TestServer server;
    const std::string messages =
        R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])";
    ASSERT_EQ(Post(server.port(), "/v1/chat/completions",
                   R"({"max_tokens": 2, "messages": )" + messages + "}")
                  .status,
              200);
    ASSERT_EQ(server.engine().submitted().size(), 1u);
    const std::vector<int32_t> chat_prompt = server.engine().submitted()[0].prompt_token_ids;

    auto reply = Post(server.port(), "/tokenize", R"({"messages": )" + messages + "}");
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json b = json::parse(reply.body);
    EXPECT_EQ(Ids(b["tokens"]), chat_prompt);
    EXPECT_EQ(b["count"], chat_prompt.size());

    auto no_prompt =
        json::parse(Post(server.port(), "/tokenize",
                         R"({"add_generation_prompt": false, "messages": )" + messages + "}")
                        .body);
    EXPECT_LT(no_prompt["count"].get<size_t>(), chat_prompt.size());
}

TEST(HttpTokenizeRoute, AddSpecialTokensControlsTheBos) {
    TestServerOptions o;
    o.tokenizer = ByteTokenizerWithBos();
    TestServer server(o);
    struct Case {
        std::string body;
        std::vector<int32_t> tokens;
    };
    const Case cases[] = {
        {R"({"prompt": "a"})", {kBos, 'a'}},
        {R"({"prompt": "a", "add_special_tokens": true})", {kBos, 'a'}},
        {R"({"prompt": "a", "add_special_tokens": false})", {'a'}},
        {R"({"prompt": ""})", {kBos}},
        {R"({"prompt": "", "add_special_tokens": false})", {}},
    };
    for (const Case& c : cases) {
        auto reply = Post(server.port(), "/tokenize", c.body);
        ASSERT_EQ(reply.status, 200) << c.body << " " << reply.body;
        EXPECT_EQ(Ids(json::parse(reply.body)["tokens"]), c.tokens) << c.body;
    }
    // Messages: the chat route's BOS by default, none when asked for none.
    const std::string messages = R"("messages": [{"role": "user", "content": "a"}])";
    ASSERT_EQ(Post(server.port(), "/v1/chat/completions", "{" + messages + "}").status, 200);
    const std::vector<int32_t> chat_prompt = server.engine().submitted().at(0).prompt_token_ids;
    ASSERT_EQ(chat_prompt.at(0), kBos);
    EXPECT_EQ(
        Ids(json::parse(Post(server.port(), "/tokenize", "{" + messages + "}").body)["tokens"]),
        chat_prompt);
    const json none = json::parse(
        Post(server.port(), "/tokenize", R"({"add_special_tokens": false, )" + messages + "}")
            .body);
    EXPECT_EQ(Ids(none["tokens"]),
              std::vector<int32_t>(chat_prompt.begin() + 1, chat_prompt.end()));
}

TEST(HttpDetokenizeRoute, TextWithControlTokensAndARoundTrip) {
    TestServer server;
    auto reply =
        Post(server.port(), "/detokenize", R"({"model": "test-model", "tokens": [72, 105, 257]})");
    ASSERT_EQ(reply.status, 200) << reply.body;
    EXPECT_EQ(json::parse(reply.body), (json{{"prompt", "Hi<|im_end|>"}}));

    const std::string text = "<|im_start|>user\nna\xc3\xafve<|im_end|>";
    const json tokens =
        json::parse(Post(server.port(), "/tokenize", json{{"prompt", text}}.dump()).body)["tokens"];
    const json back =
        json::parse(Post(server.port(), "/detokenize", json{{"tokens", tokens}}.dump()).body);
    EXPECT_EQ(back["prompt"], text);

    // Half a UTF-8 character is still valid JSON text: U+FFFD.
    auto half = Post(server.port(), "/detokenize", R"({"tokens": [195]})");
    ASSERT_EQ(half.status, 200);
    EXPECT_EQ(json::parse(half.body)["prompt"], "\xef\xbf\xbd");
    EXPECT_EQ(json::parse(Post(server.port(), "/detokenize", R"({"tokens": []})").body)["prompt"],
              "");
}

// Every refusal of the tokenizer routes, with an OpenAI error body naming what was wrong.
TEST(HttpTokenizerRoutes, Errors) {
    TestServerOptions o;
    o.http.max_body_bytes = 1024;
    TestServer server(o);
    struct Case {
        std::string target;
        std::string body;
        int status;
        std::string param;  // "" for null
        std::string in_message;
    };
    const Case cases[] = {
        {"/detokenize", R"({"tokens": [72, 258]})", 400, "tokens[1]", "258"},
        {"/detokenize", R"({"tokens": [-1]})", 400, "tokens[0]", "-1"},
        {"/detokenize", R"({"tokens": [18446744073709551615]})", 400, "tokens[0]", "outside"},
        {"/detokenize", R"({"tokens": ["a"]})", 400, "tokens[0]", "a string"},
        {"/detokenize", R"({"tokens": 5})", 400, "tokens", "an integer"},
        {"/detokenize", R"({})", 400, "tokens", "required"},
        {"/detokenize", R"({"model": "other", "tokens": [1]})", 404, "model", "'other'"},
        {"/tokenize", R"({"model": "other", "prompt": "x"})", 404, "model", "'other'"},
        {"/tokenize", R"({})", 400, "prompt", "required"},
        {"/tokenize", R"({"prompt": 5})", 400, "prompt", "a string"},
        {"/tokenize", R"({"prompt": "x", "messages": []})", 400, "prompt", "not both"},
        {"/tokenize", R"({"messages": []})", 400, "messages", "empty"},
        {"/tokenize", R"({"messages": [{"role": "user", "content": "x"}], "tools": [{}]})", 400,
         "tools", "not supported"},
        {"/tokenize",
         R"({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true})", 400,
         "continue_final_message", "not supported"},
        {"/tokenize", R"({"messages": [{"role": "user", "content": "x"}], "chat_template": "t"})",
         400, "chat_template", "not supported"},
        {"/tokenize", R"({"prompt": "x", "add_special_tokens": "yes"})", 400, "add_special_tokens",
         "boolean"},
        {"/tokenize", "{not json", 400, "", "not valid JSON"},
        {"/tokenize", "{\"prompt\": \"" + std::string(2000, 'x') + "\"}", 413, "", "1024"},
    };
    for (const Case& c : cases) {
        auto reply = Post(server.port(), c.target, c.body);
        EXPECT_EQ(reply.status, c.status) << c.target << " " << c.body.substr(0, 80);
        const json body = json::parse(reply.body, nullptr, false);
        ASSERT_TRUE(body.is_object() && body.contains("error")) << reply.body;
        const json& e = body["error"];
        EXPECT_EQ(e["param"].is_null() ? "" : e["param"].get<std::string>(), c.param) << reply.body;
        EXPECT_NE(e["message"].get<std::string>().find(c.in_message), std::string::npos)
            << reply.body;
    }
    // Unknown fields are ignored, as on the generation routes.
    EXPECT_EQ(Post(server.port(), "/tokenize", R"({"prompt": "x", "frobnicate": 1})").status, 200);
    EXPECT_EQ(Get(server.port(), "/tokenize").status, 405);
    EXPECT_EQ(Get(server.port(), "/detokenize").message[http::field::allow], "POST");
}

TEST(HttpTokenizerRoutes, ChatWithoutATemplateIs400) {
    TestServerOptions o;
    o.chat_template = false;
    TestServer server(o);
    auto reply =
        Post(server.port(), "/tokenize", R"({"messages": [{"role": "user", "content": "x"}]})");
    EXPECT_EQ(reply.status, 400);
    EXPECT_EQ(json::parse(reply.body)["error"]["code"], "chat_template_missing");
}

TEST(HttpTokenizerRoutes, PromptOverTheByteCapIs400BeforeTokenizing) {
    TestServerOptions o;
    o.http.max_prompt_bytes = 8;
    TestServer server(o);
    auto reply = Post(server.port(), "/tokenize", R"({"prompt": "123456789"})");
    EXPECT_EQ(reply.status, 400);
    EXPECT_EQ(json::parse(reply.body)["error"]["code"], "prompt_too_large");
    EXPECT_EQ(Post(server.port(), "/tokenize", R"({"prompt": "12345678"})").status, 200);
}

// API keys guard the tokenizer routes and /v1/models/{id}; /version is open like /health.
TEST(HttpTokenizerRoutes, ApiKeys) {
    TestServerOptions o;
    o.http.api_keys = {"secret"};
    TestServer server(o);
    const std::vector<std::pair<std::string, std::string>> key = {
        {"Authorization", "Bearer secret"}};
    for (const char* target : {"/tokenize", "/detokenize"}) {
        const std::string body =
            std::string(target) == "/tokenize" ? R"({"prompt": "x"})" : R"({"tokens": [120]})";
        auto refused = Post(server.port(), target, body);
        EXPECT_EQ(refused.status, 401) << target;
        EXPECT_EQ(refused.message[http::field::www_authenticate], "Bearer");
        EXPECT_EQ(Post(server.port(), target, body, key).status, 200) << target;
    }
    TestClient client(server.port());
    EXPECT_EQ(client.Send(http::verb::get, "/v1/models/test-model").status, 401);
    EXPECT_EQ(client.Send(http::verb::get, "/v1/models/test-model", "", key).status, 200);
    EXPECT_EQ(client.Send(http::verb::get, "/version").status, 200);
}

TEST(HttpVersionRoute, TheBuildsVersion) {
    TestServer server;
    auto reply = Get(server.port(), "/version");
    ASSERT_EQ(reply.status, 200);
    EXPECT_EQ(reply.message[http::field::content_type], "application/json");
    EXPECT_EQ(json::parse(reply.body), (json{{"version", KVSHARD_VERSION}}));
    EXPECT_FALSE(std::string(KVSHARD_VERSION).empty());
}

}  // namespace
}  // namespace kvshard
