// The HTTP server end to end over loopback: routes and status codes, OpenAI bodies, SSE framing,
// keep-alive, API keys, queue limits, disconnects and timeouts aborting requests, concurrency.
#include "coordinator/http_server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::Get;
using testing::Post;
using testing::SseData;
using testing::TestClient;
using testing::TestServer;
using testing::TestServerOptions;
namespace http = boost::beast::http;
using namespace std::chrono_literals;

constexpr char kCompletion[] = R"({"model": "test-model", "prompt": "Hi", "max_tokens": 4})";

// An engine that cannot serve (its workers died) makes /health answer 503 with the reason, so a
// load balancer or Kubernetes probe takes the server out of rotation.
TEST(HttpServer, HealthIs503WhenTheEngineCannotServe) {
    TestServerOptions o;
    o.engine.health = Status(StatusCode::kUnavailable, "instance default: worker rank 1 died");
    TestServer server(o);
    auto health = Get(server.port(), "/health");
    EXPECT_EQ(health.status, 503);
    const json body = json::parse(health.body);
    EXPECT_EQ(body["status"], "unavailable");
    EXPECT_EQ(body["error"], "instance default: worker rank 1 died");
}

TEST(HttpServer, HealthModelsMetrics) {
    TestServer server;
    auto health = Get(server.port(), "/health");
    EXPECT_EQ(health.status, 200);
    EXPECT_EQ(json::parse(health.body)["status"], "ok");

    auto models = Get(server.port(), "/v1/models");
    EXPECT_EQ(models.status, 200);
    EXPECT_EQ(models.message[http::field::content_type], "application/json");
    const json m = json::parse(models.body);
    EXPECT_EQ(m["object"], "list");
    EXPECT_EQ(m["data"][0]["id"], "test-model");
    EXPECT_EQ(m["data"][0]["object"], "model");
    EXPECT_EQ(m["data"][0]["max_model_len"], 4096);
    EXPECT_EQ(m["data"][0]["root"], "test-model");
    EXPECT_TRUE(m["data"][0]["parent"].is_null());

    ASSERT_EQ(Post(server.port(), "/v1/completions", kCompletion).status, 200);
    auto metrics = Get(server.port(), "/metrics");
    EXPECT_EQ(metrics.status, 200);
    EXPECT_EQ(metrics.message[http::field::content_type].substr(0, 10), "text/plain");
    for (const char* name :
         {"kvshard:time_to_first_token_seconds_count{model_name=\"test-model\"} 1",
          "kvshard:inter_token_latency_seconds_count{model_name=\"test-model\"} 3",
          "kvshard:e2e_request_latency_seconds_count{model_name=\"test-model\"} 1",
          "kvshard:prompt_tokens_total{model_name=\"test-model\"} 2",
          "kvshard:generation_tokens_total{model_name=\"test-model\"} 4",
          "kvshard:kv_cache_usage_perc{model_name=\"test-model\"} 0.25",
          "kvshard:prefix_cache_hits_total{model_name=\"test-model\"} 40"}) {
        EXPECT_NE(metrics.body.find(name), std::string::npos) << name << "\n" << metrics.body;
    }
}

// Every error status the router and validation give, with an OpenAI error body.
TEST(HttpServer, ErrorStatuses) {
    TestServerOptions options;
    options.http.max_body_bytes = 1024;
    options.engine.max_context = 64;
    TestServer server(options);
    struct Case {
        http::verb method;
        std::string target;
        std::string body;
        int status;
        std::string code;  // error.code, "" for null
    };
    const Case cases[] = {
        {http::verb::get, "/nope", "", 404, "not_found"},
        {http::verb::post, "/v1/embeddings", "{}", 404, "not_found"},
        {http::verb::get, "/v1/completions", "", 405, "method_not_allowed"},
        {http::verb::post, "/health", "{}", 405, "method_not_allowed"},
        {http::verb::delete_, "/v1/models", "", 405, "method_not_allowed"},
        {http::verb::post, "/v1/completions", "{not json", 400, "invalid_json"},
        {http::verb::post, "/v1/completions", "\"\xff\"", 400, "invalid_utf8"},
        {http::verb::post, "/v1/completions", std::string(4096, ' '), 413, "request_too_large"},
        {http::verb::post, "/v1/completions", R"({"model": "other", "prompt": "x"})", 404,
         "model_not_found"},
        {http::verb::post, "/v1/completions", R"({"prompt": "x", "max_tokens": 0})", 400, ""},
        {http::verb::post, "/v1/completions", R"({"prompt": "x", "max_tokens": 64})", 400,
         "context_length_exceeded"},
        {http::verb::post, "/v1/completions", "{\"prompt\": \"" + std::string(100, 'x') + "\"}",
         400, "context_length_exceeded"},
        {http::verb::post, "/v1/completions", R"({"prompt": ""})", 400, ""},
        {http::verb::post, "/v1/chat/completions", R"({"messages": []})", 400, ""},
    };
    for (const Case& c : cases) {
        TestClient client(server.port());
        auto reply = client.Send(c.method, c.target, c.body);
        EXPECT_EQ(reply.status, c.status) << c.target << " " << c.body.substr(0, 60);
        const json body = json::parse(reply.body, nullptr, false);
        ASSERT_TRUE(body.is_object()) << reply.body;
        ASSERT_TRUE(body.contains("error")) << reply.body;
        for (const char* key : {"message", "type", "param", "code"}) {
            EXPECT_TRUE(body["error"].contains(key)) << key << " in " << reply.body;
        }
        EXPECT_EQ(body["error"]["code"].is_null() ? "" : body["error"]["code"].get<std::string>(),
                  c.code)
            << reply.body;
        if (c.status == 405) {
            EXPECT_FALSE(reply.message[http::field::allow].empty());
        }
    }
    EXPECT_TRUE(server.engine().submitted().empty());
}

TEST(HttpServer, MalformedHttpIs400) {
    TestServer server;
    TestClient client(server.port());
    boost::asio::write(client.socket(), boost::asio::buffer(std::string("GARBAGE\r\n\r\n")));
    EXPECT_EQ(client.Read().status, 400);
}

TEST(HttpServer, ExpectContinue) {
    TestServer server;
    TestClient client(server.port());
    const std::string body = kCompletion;
    const std::string head =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Expect: 100-continue\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n";
    boost::asio::write(client.socket(), boost::asio::buffer(head));
    // The go-ahead comes before the body is sent.
    std::string got(25, '\0');
    boost::asio::read(client.socket(), boost::asio::buffer(got));
    EXPECT_EQ(got, "HTTP/1.1 100 Continue\r\n\r\n");
    boost::asio::write(client.socket(), boost::asio::buffer(body));
    auto reply = client.Read();
    EXPECT_EQ(reply.status, 200);
    EXPECT_EQ(json::parse(reply.body)["choices"][0]["text"], "Hello, world!");
}

TEST(HttpServer, ApiKeys) {
    TestServerOptions options;
    options.http.api_keys = {"secret"};
    TestServer server(options);
    EXPECT_EQ(Post(server.port(), "/v1/completions", kCompletion).status, 401);
    auto wrong =
        Post(server.port(), "/v1/completions", kCompletion, {{"Authorization", "Bearer nope"}});
    EXPECT_EQ(wrong.status, 401);
    EXPECT_EQ(json::parse(wrong.body)["error"]["code"], "invalid_api_key");
    EXPECT_EQ(
        Post(server.port(), "/v1/completions", kCompletion, {{"Authorization", "secret"}}).status,
        401);
    EXPECT_EQ(
        Post(server.port(), "/v1/completions", kCompletion, {{"Authorization", "Bearer secret"}})
            .status,
        200);
    EXPECT_EQ(Get(server.port(), "/health").status, 200);  // open without a key
}

TEST(HttpServer, FullQueueIs429) {
    TestServerOptions options;
    options.engine.submit_status =
        Status(StatusCode::kResourceExhausted, "queue full (256 waiting)");
    TestServer server(options);
    auto reply = Post(server.port(), "/v1/completions", kCompletion);
    EXPECT_EQ(reply.status, 429);
    EXPECT_NE(json::parse(reply.body)["error"]["message"].get<std::string>().find("queue is full"),
              std::string::npos);
}

TEST(HttpServer, Completion) {
    TestServerOptions options;
    options.engine.cached_tokens = 1;
    TestServer server(options);
    auto reply = Post(server.port(), "/v1/completions",
                      R"({"prompt": "Hi", "max_tokens": 5, "temperature": 0, "seed": 7,
                          "stop": ["zz"], "logprobs": 1, "n": 2, "ignore_eos": true})");
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json b = json::parse(reply.body);
    EXPECT_EQ(b["object"], "text_completion");
    EXPECT_EQ(b["model"], "test-model");
    EXPECT_EQ(b["id"].get<std::string>().substr(0, 5), "cmpl-");
    ASSERT_EQ(b["choices"].size(), 2u);
    EXPECT_EQ(b["choices"][1]["text"], "Hello, world!Hello");
    EXPECT_EQ(b["choices"][1]["finish_reason"], "length");
    EXPECT_EQ(b["choices"][0]["logprobs"]["tokens"].size(), 5u);
    EXPECT_EQ(b["choices"][0]["logprobs"]["tokens"][0], "a");
    EXPECT_EQ(b["usage"]["prompt_tokens"], 2);
    EXPECT_EQ(b["usage"]["completion_tokens"], 10);
    EXPECT_EQ(b["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
    // What reached the engine.
    const auto submitted = server.engine().submitted();
    ASSERT_EQ(submitted.size(), 1u);
    const GenerationRequest& g = submitted[0];
    EXPECT_EQ(g.request_id, b["id"]);
    EXPECT_EQ(g.prompt_token_ids, (std::vector<int32_t>{'H', 'i'}));
    EXPECT_EQ(g.max_tokens, 5);
    EXPECT_EQ(g.n, 2);
    EXPECT_EQ(g.sampling.seed, 7u);
    EXPECT_EQ(g.sampling.temperature, 0.0f);
    EXPECT_EQ(g.stop, (std::vector<std::string>{"zz"}));
    EXPECT_TRUE(g.ignore_eos);
    EXPECT_EQ(g.num_top_logprobs, 1);
}

TEST(HttpServer, ChatAppliesTheTemplate) {
    TestServer server;
    auto reply = Post(server.port(), "/v1/chat/completions",
                      R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})");
    ASSERT_EQ(reply.status, 200) << reply.body;
    const json b = json::parse(reply.body);
    EXPECT_EQ(b["object"], "chat.completion");
    EXPECT_EQ(b["choices"][0]["message"]["role"], "assistant");
    EXPECT_EQ(b["choices"][0]["message"]["content"], "Hello,");
    // <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n with the markers as single tokens.
    std::vector<int32_t> expect = {256};
    for (char c : std::string("user\nHi")) expect.push_back(c);
    expect.push_back(257);
    expect.push_back('\n');
    expect.push_back(256);
    for (char c : std::string("assistant\n")) expect.push_back(c);
    EXPECT_EQ(server.engine().submitted().at(0).prompt_token_ids, expect);
    EXPECT_NE(server.engine().submitted().at(0).sampling.seed, 0u);  // a random seed was chosen
}

TEST(HttpServer, ChatWithoutTemplateIs400) {
    TestServerOptions options;
    options.chat_template = false;
    TestServer server(options);
    auto reply = Post(server.port(), "/v1/chat/completions",
                      R"({"messages": [{"role": "user", "content": "Hi"}]})");
    EXPECT_EQ(reply.status, 400);
    EXPECT_NE(reply.body.find("--chat-template"), std::string::npos);
}

TEST(HttpServer, StreamFramingEndsWithDone) {
    TestServer server;
    TestClient client(server.port());
    auto reply = client.Send(http::verb::post, "/v1/chat/completions",
                             R"({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                 "stream": true, "stream_options": {"include_usage": true}})");
    ASSERT_EQ(reply.status, 200) << reply.body;
    EXPECT_EQ(reply.message[http::field::content_type], "text/event-stream");
    EXPECT_TRUE(reply.message.chunked());
    const std::vector<std::string> data = SseData(reply.body);
    ASSERT_EQ(data.size(), 6u) << reply.body;  // role, 3 tokens, usage, [DONE]
    EXPECT_EQ(json::parse(data[0])["choices"][0]["delta"]["role"], "assistant");
    std::string text;
    for (int i = 1; i <= 3; ++i) text += json::parse(data[i])["choices"][0]["delta"]["content"];
    EXPECT_EQ(text, "Hello, world");
    EXPECT_EQ(json::parse(data[3])["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(json::parse(data[4])["usage"]["completion_tokens"], 3);
    EXPECT_EQ(data[5], "[DONE]");
    EXPECT_EQ(reply.body.substr(reply.body.size() - 14), "data: [DONE]\n\n");

    // The connection stays usable (keep-alive) for a second, non-streamed request.
    auto again = client.Send(http::verb::post, "/v1/completions", kCompletion);
    EXPECT_EQ(again.status, 200);
    EXPECT_EQ(json::parse(again.body)["choices"][0]["text"], "Hello, world!");
}

// Reads from a raw connection until `needle` has arrived.
void ReadUntil(boost::asio::ip::tcp::socket& socket, const std::string& needle) {
    std::string got;
    char buf[1024];
    while (got.find(needle) == std::string::npos) {
        const size_t n = socket.read_some(boost::asio::buffer(buf));
        got.append(buf, n);
    }
}

TEST(HttpServer, DisconnectMidStreamAborts) {
    TestServerOptions options;
    options.engine.hold_after = 2;  // two tokens, then the request parks until aborted
    TestServer server(options);
    {
        TestClient client(server.port());
        http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
        req.set(http::field::host, "127.0.0.1");
        req.body() = R"({"prompt": "Hi", "max_tokens": 100, "stream": true})";
        req.prepare_payload();
        http::write(client.socket(), req);
        ReadUntil(client.socket(), "Hello");
    }  // the client goes away
    ASSERT_TRUE(server.engine().WaitForAbort("", 10s));
    const auto submitted = server.engine().submitted();
    ASSERT_EQ(submitted.size(), 1u);
    EXPECT_EQ(server.engine().aborted().count(submitted[0].request_id), 1u);
    EXPECT_TRUE(server.engine().WaitIdle(10s));
}

TEST(HttpServer, DisconnectWhileWaitingForANonStreamedAnswerAborts) {
    TestServerOptions options;
    options.engine.hold_after = 1;
    TestServer server(options);
    {
        TestClient client(server.port());
        http::request<http::string_body> req{http::verb::post, "/v1/completions", 11};
        req.set(http::field::host, "127.0.0.1");
        req.body() = R"({"prompt": "Hi", "max_tokens": 100})";
        req.prepare_payload();
        http::write(client.socket(), req);
        // Hang up once the engine has the request.
        ASSERT_TRUE(server.engine().WaitForSubmitted(1, 10s));
    }
    EXPECT_TRUE(server.engine().WaitForAbort(server.engine().submitted()[0].request_id, 10s));
}

TEST(HttpServer, RequestTimeoutAborts) {
    TestServerOptions options;
    options.engine.hold_after = 1;
    options.http.request_timeout_s = 0.2;
    TestServer server(options);
    auto plain = Post(server.port(), "/v1/completions", R"({"prompt": "Hi", "max_tokens": 50})");
    EXPECT_EQ(plain.status, 504);
    EXPECT_EQ(json::parse(plain.body)["error"]["code"], "timeout");

    auto streamed = Post(server.port(), "/v1/completions",
                         R"({"prompt": "Hi", "max_tokens": 50, "stream": true})");
    EXPECT_EQ(streamed.status, 200);
    const std::vector<std::string> data = SseData(streamed.body);
    ASSERT_GE(data.size(), 3u) << streamed.body;
    EXPECT_EQ(json::parse(data[0])["choices"][0]["text"], "Hello");
    EXPECT_EQ(json::parse(data[data.size() - 2])["error"]["code"], "timeout");
    EXPECT_EQ(data.back(), "[DONE]");
    EXPECT_EQ(server.engine().aborted().size(), 2u);
}

TEST(HttpServer, SixtyFourConcurrentRequests) {
    TestServer server;
    constexpr int kClients = 64;
    std::atomic<int> ok{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < kClients; ++i) {
        threads.emplace_back([&, i] {
            const bool stream = i % 2 == 0;
            const std::string body = std::string(R"({"prompt": "client )") + std::to_string(i) +
                                     R"(", "max_tokens": 8, "stream": )" +
                                     (stream ? "true" : "false") + "}";
            testing::HttpReply reply;
            try {
                reply = Post(server.port(), "/v1/completions", body);
            } catch (const std::exception& e) {
                ADD_FAILURE() << "client " << i << ": " << e.what();
                return;
            }
            if (reply.status != 200) return;
            std::string text;
            if (stream) {
                const auto data = SseData(reply.body);
                if (data.empty() || data.back() != "[DONE]") return;
                for (size_t k = 0; k + 1 < data.size(); ++k) {
                    text += json::parse(data[k])["choices"][0]["text"].get<std::string>();
                }
            } else {
                text = json::parse(reply.body)["choices"][0]["text"];
            }
            if (text == "Hello, world!Hello, world!") ok.fetch_add(1);
        });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(ok.load(), kClients);
    EXPECT_EQ(server.engine().submitted().size(), static_cast<size_t>(kClients));
    EXPECT_TRUE(server.engine().aborted().empty());
}

TEST(HttpServer, PortInUseIsUnavailable) {
    TestServer first;
    // The tokenizer and service of a second server do not matter: binding fails first.
    HttpConfig config;
    config.host = "127.0.0.1";
    config.port = first.port();
    testing::FakeEngine engine;
    auto tok = testing::ByteTokenizer();
    ApiService api(engine, *tok, std::make_shared<ServerMetrics>("m"), {});
    auto second = HttpServer::Start(config, api);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(second.status().message().find(std::to_string(first.port())), std::string::npos);
}

}  // namespace
}  // namespace kvshard
