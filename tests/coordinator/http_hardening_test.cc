// The HTTP server against hostile or unlucky clients: numbers beyond a double, NUL bytes, odd
// transfer codings, huge headers, too many connections, no file descriptors left, megabyte
// prompts, draining for shutdown, and an engine that fails its requests.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/http_server.h"
#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::Get;
using testing::HttpReply;
using testing::Post;
using testing::SseData;
using testing::TestClient;
using testing::TestServer;
using testing::TestServerOptions;
namespace http = boost::beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using namespace std::chrono_literals;

constexpr char kCompletion[] = R"({"prompt": "Hi", "max_tokens": 4})";

// Writes raw bytes on a fresh connection and reads the answer.
HttpReply RawExchange(int port, const std::string& bytes) {
    TestClient client(port);
    client.SetReceiveTimeout(10);
    net::write(client.socket(), net::buffer(bytes));
    return client.Read();
}

// Waits for `done` (polled), false after 10 s.
template <typename F>
bool Eventually(F done) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!done()) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(1ms);
    }
    return true;
}

// Wraps a tokenizer; every Encode waits until Open(), so a test can hold requests in
// tokenization.
class GatedTokenizer : public Tokenizer {
  public:
    explicit GatedTokenizer(std::unique_ptr<Tokenizer> inner)
        : Tokenizer(std::make_shared<const TokenizerData>(inner->data())),
          inner_(std::move(inner)) {}

    std::vector<int32_t> Encode(std::string_view text, const EncodeOptions& o) const override {
        {
            std::unique_lock<std::mutex> lock(mu_);
            ++waiting_;
            cv_.notify_all();
            cv_.wait(lock, [this] { return open_; });
            --waiting_;
        }
        return inner_->Encode(text, o);
    }
    std::string TokenBytes(int32_t id) const override { return inner_->TokenBytes(id); }
    int32_t PieceToId(std::string_view piece) const override { return inner_->PieceToId(piece); }

    void Open() {
        std::lock_guard<std::mutex> lock(mu_);
        open_ = true;
        cv_.notify_all();
    }
    bool WaitForWaiting(int n) {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, 10s, [&] { return waiting_ >= n; });
    }

  private:
    std::unique_ptr<Tokenizer> inner_;
    mutable std::mutex mu_;
    mutable std::condition_variable cv_;
    mutable int waiting_ = 0;
    bool open_ = false;
};

// Once an uncaught nlohmann::out_of_range that ended the process.
TEST(HttpHardening, NumbersBeyondADoubleAre400) {
    TestServer server;
    for (const auto& [target, body] : std::vector<std::pair<std::string, std::string>>{
             {"/v1/completions", R"({"prompt": "a", "temperature": 1e400})"},
             {"/v1/completions", R"({"prompt": "a", "foo": 1e400})"},
             {"/v1/chat/completions",
              R"({"messages": [{"role": "user", "content": "a"}], "n": 1e309})"}}) {
        auto reply = Post(server.port(), target, body);
        EXPECT_EQ(reply.status, 400) << body;
        const std::string message = json::parse(reply.body)["error"]["message"];
        EXPECT_NE(message.find("too large"), std::string::npos) << message;
        EXPECT_EQ(message.find("json.exception"), std::string::npos) << message;
    }
    EXPECT_EQ(Get(server.port(), "/health").status, 200);
    EXPECT_TRUE(server.engine().submitted().empty());
}

// A chat request whose tool schema nested 100,000 deep once ended the process (a stack overflow
// in nlohmann's recursive dump). JSON nested past json_fields::kMaxJsonDepth, in the body or in a
// JSON text inside it, is a 400 naming the depth; the server goes on serving.
TEST(HttpHardening, JsonNestedTooDeepIs400) {
    TestServer server;
    const auto nested = [](int depth) {
        std::string s;
        for (int i = 0; i < depth; ++i) s += "{\"a\":";
        s += "1";
        s += std::string(static_cast<size_t>(depth), '}');
        return s;
    };
    const std::string messages = R"("messages": [{"role": "user", "content": "a"}])";
    for (const auto& [target, body] : std::vector<std::pair<std::string, std::string>>{
             {"/v1/chat/completions",
              "{" + messages + R"(, "tools": [{"type": "function", "function": )" +
                  R"({"name": "f", "parameters": )" + nested(100'000) + "}}]}"},
             {"/v1/completions", R"({"prompt": "a", "x": )" + nested(65) + "}"},
             {"/v1/chat/completions",
              "{" + messages + R"(, "guided_json": )" + json(nested(65)).dump() + "}"},
         }) {
        auto reply = Post(server.port(), target, body);
        EXPECT_EQ(reply.status, 400) << target << " " << body.substr(0, 120);
        const json answer = json::parse(reply.body, nullptr, false);
        ASSERT_TRUE(answer.is_object()) << reply.body;
        const std::string message = answer["error"]["message"];
        EXPECT_NE(message.find("deeper than 64 levels"), std::string::npos) << message;
    }
    EXPECT_EQ(Get(server.port(), "/health").status, 200);
    EXPECT_TRUE(server.engine().submitted().empty());
}

TEST(HttpHardening, MalformedRequestsInKvshardWords) {
    TestServer server;
    const std::string nul_body = std::string("{\"prompt\": \"Hi\"}\0{\"x\": 1}", 25);
    struct Case {
        std::string name;
        std::string bytes;
        int status;
        std::string code;
    };
    const Case cases[] = {
        {"NUL in the body",
         "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
             std::to_string(nul_body.size()) + "\r\n\r\n" + nul_body,
         400, "invalid_json"},
        {"gzip, chunked",
         "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
         "5\r\nhello\r\n0\r\n\r\n",
         501, "unsupported_transfer_encoding"},
        {"gzip alone",
         "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501,
         "unsupported_transfer_encoding"},
        {"header block over 16 KiB",
         "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(20000, 'a') + "\r\n\r\n", 431,
         "header_too_large"},
        {"bad content length",
         "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n", 400, ""},
    };
    for (const Case& c : cases) {
        HttpReply reply = RawExchange(server.port(), c.bytes);
        EXPECT_EQ(reply.status, c.status) << c.name;
        const json body = json::parse(reply.body, nullptr, false);
        ASSERT_TRUE(body.is_object()) << c.name << ": " << reply.body;
        EXPECT_EQ(body["error"]["code"].is_null() ? "" : body["error"]["code"].get<std::string>(),
                  c.code)
            << c.name;
        // No library text (Beast's messages read "bad content length" etc. with its category).
        const std::string message = body["error"]["message"];
        EXPECT_EQ(message.find("beast"), std::string::npos) << message;
        EXPECT_EQ(message.find("http."), std::string::npos) << message;
    }
    EXPECT_TRUE(server.engine().submitted().empty());
}

TEST(HttpHardening, HeadAnswersLikeGetWithoutABody) {
    TestServer server;
    const HttpReply get = Get(server.port(), "/v1/models");
    TestClient client(server.port());
    const HttpReply head = client.Send(http::verb::head, "/v1/models");
    EXPECT_EQ(head.status, 200);
    EXPECT_EQ(head.message[http::field::content_length], std::to_string(get.body.size()));
    EXPECT_TRUE(head.body.empty());
    // The connection stays usable: nothing but the headers was sent.
    EXPECT_EQ(client.Send(http::verb::get, "/health").status, 200);
    const HttpReply post_route = client.Send(http::verb::head, "/v1/completions");
    EXPECT_EQ(post_route.status, 405);
    EXPECT_EQ(post_route.message[http::field::allow], "POST");
    const HttpReply wrong = TestClient(server.port()).Send(http::verb::put, "/health");
    EXPECT_EQ(wrong.status, 405);
    EXPECT_EQ(wrong.message[http::field::allow], "GET, HEAD");
}

TEST(HttpHardening, RetryAfterAndWwwAuthenticate) {
    TestServerOptions busy;
    busy.engine.max_active = 0;  // every Submit: ResourceExhausted
    TestServer full(busy);
    const HttpReply queued = Post(full.port(), "/v1/completions", kCompletion);
    EXPECT_EQ(queued.status, 429);
    EXPECT_EQ(queued.message[http::field::retry_after], "1");

    TestServerOptions keyed;
    keyed.http.api_keys = {"secret"};
    TestServer server(keyed);
    const HttpReply denied = Post(server.port(), "/v1/completions", kCompletion);
    EXPECT_EQ(denied.status, 401);
    EXPECT_EQ(denied.message[http::field::www_authenticate], "Bearer");
    for (const char* auth : {"bearer secret", "BEARER secret", "Bearer  secret"}) {
        EXPECT_EQ(
            Post(server.port(), "/v1/completions", kCompletion, {{"Authorization", auth}}).status,
            200)
            << auth;
    }
    for (const char* auth : {"Bearersecret", "Basic secret", "bearer", "bearer secre"}) {
        EXPECT_EQ(
            Post(server.port(), "/v1/completions", kCompletion, {{"Authorization", auth}}).status,
            401)
            << auth;
    }
}

// Engine messages may name workers and steps; a client sees kvshard's words and the request id.
TEST(HttpHardening, EngineErrorsDoNotLeakInternals) {
    TestServerOptions o;
    o.engine.submit_status =
        Status(StatusCode::kInternal, "rank 1 at 10.1.2.3:7001 failed step 17");
    TestServer server(o);
    const HttpReply reply = Post(server.port(), "/v1/completions", kCompletion);
    EXPECT_EQ(reply.status, 500);
    const std::string message = json::parse(reply.body)["error"]["message"];
    EXPECT_EQ(message.find("10.1.2.3"), std::string::npos) << message;
    EXPECT_EQ(message.find("step"), std::string::npos) << message;
    EXPECT_NE(message.find("cmpl-"), std::string::npos) << message;  // the id to look up
}

TEST(HttpHardening, ConnectionsBeyondTheLimitGet503) {
    TestServerOptions o;
    o.http.max_connections = 2;
    TestServer server(o);
    auto a = std::make_unique<TestClient>(server.port());
    TestClient b(server.port());
    ASSERT_EQ(a->Send(http::verb::get, "/health").status, 200);
    ASSERT_EQ(b.Send(http::verb::get, "/health").status, 200);
    EXPECT_EQ(server.server().num_connections(), 2);

    TestClient c(server.port());
    c.SetReceiveTimeout(10);
    const HttpReply refused = c.Send(http::verb::get, "/health");
    EXPECT_EQ(refused.status, 503);
    EXPECT_EQ(refused.message[http::field::retry_after], "1");
    EXPECT_EQ(json::parse(refused.body)["error"]["code"], "too_many_connections");

    // A connection that goes makes room for the next.
    a.reset();
    ASSERT_TRUE(Eventually([&] { return server.server().num_connections() == 1; }));
    TestClient d(server.port());
    EXPECT_EQ(d.Send(http::verb::get, "/health").status, 200);
}

// Out of file descriptors, accept fails at once and forever: the server must wait between tries
// (not spin), and answer once descriptors are free again.
TEST(HttpHardening, AcceptBacksOffWhenOutOfDescriptors) {
#if defined(__SANITIZE_ADDRESS__)
    // The address mode also builds UBSan, whose vptr check tests that an object's memory is
    // readable by writing it to a pipe: with every descriptor taken it cannot make one, and
    // reports a valid shared_ptr control block as "invalid vptr / memory cannot be printed".
    GTEST_SKIP() << "needs every file descriptor taken, which the sanitizer runtime cannot bear";
#endif
    TestServer server;
    net::io_context io;
    // Opened (so holding their descriptors) before the limit bites; connected after.
    std::vector<tcp::socket> clients;
    for (int i = 0; i < 2; ++i) {
        clients.emplace_back(io);
        clients.back().open(tcp::v4());
    }
    rlimit old{};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
    rlimit low = old;
    low.rlim_cur = std::min<rlim_t>(old.rlim_cur, 512);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
    std::vector<int> hogs;
    for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) hogs.push_back(fd);
    ASSERT_EQ(errno, EMFILE);

    const tcp::endpoint endpoint(net::ip::make_address("127.0.0.1"),
                                 static_cast<unsigned short>(server.port()));
    for (tcp::socket& s : clients) s.connect(endpoint);  // lands in the backlog
    const bool failed = Eventually([&] { return server.server().num_accept_failures() > 0; });
    const auto start = std::chrono::steady_clock::now();
    const int64_t failures_at_start = server.server().num_accept_failures();
    std::this_thread::sleep_for(300ms);  // the window observed, not a synchronization
    const int64_t failures = server.server().num_accept_failures() - failures_at_start;
    const auto elapsed_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::steady_clock::now() - start)
                                .count();

    for (int fd : hogs) ::close(fd);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
    ASSERT_TRUE(failed);
    // A retry at most every 100 ms (a timer never fires early); a spinning loop makes thousands.
    EXPECT_LE(failures, elapsed_ms / 100 + 1) << "in " << elapsed_ms << " ms";

    for (tcp::socket& s : clients) {
        timeval tv{10, 0};
        ::setsockopt(s.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        net::write(s, net::buffer(std::string("GET /health HTTP/1.1\r\nHost: x\r\n\r\n")));
        boost::beast::flat_buffer buffer;
        http::response<http::string_body> res;
        http::read(s, buffer, res);
        EXPECT_EQ(res.result_int(), 200u);
    }
}

// Tokenizing runs on a pool of its own: /health answers while every tokenizer thread is busy.
TEST(HttpHardening, HealthAnswersWhileMegabytePromptsTokenize) {
    auto gated = std::make_shared<GatedTokenizer>(testing::ByteTokenizer());
    TestServerOptions o;
    o.tokenizer = gated;
    o.http.max_body_bytes = 4 << 20;
    o.http.max_prompt_bytes = 4 << 20;
    TestServer server(o);
    const std::string big = R"({"prompt": ")" + std::string(1 << 20, 'x') + R"("})";
    constexpr int kBig = 3;
    std::vector<int> statuses(kBig, 0);
    std::vector<std::thread> threads;
    for (int i = 0; i < kBig; ++i) {
        threads.emplace_back([&, i] {
            try {
                statuses[i] = Post(server.port(), "/v1/completions", big).status;
            } catch (const std::exception& e) {
                ADD_FAILURE() << e.what();
            }
        });
    }
    // Every thread that could tokenize is busy (the HTTP threads too, before the pool existed).
    ASSERT_TRUE(gated->WaitForWaiting(o.http.num_threads));
    TestClient health(server.port());
    health.SetReceiveTimeout(10);
    HttpReply reply;
    try {
        reply = health.Send(http::verb::get, "/health");
    } catch (const std::exception& e) {
        ADD_FAILURE() << "/health did not answer while prompts tokenize: " << e.what();
    }
    EXPECT_EQ(reply.status, 200);
    gated->Open();
    for (std::thread& t : threads) t.join();
    // The prompts were tokenized, and then too long for the context.
    for (int s : statuses) EXPECT_EQ(s, 400);
}

// A prompt over max_prompt_bytes is refused before the tokenizer sees it.
TEST(HttpHardening, PromptBytesAreCheckedBeforeTokenizing) {
    auto gated = std::make_shared<GatedTokenizer>(testing::ByteTokenizer());
    TestServerOptions o;
    o.tokenizer = gated;  // never opened: a request that reached it would not be answered
    o.http.max_prompt_bytes = 100;
    TestServer server(o);
    for (const auto& [target, body, param] :
         std::vector<std::tuple<std::string, std::string, std::string>>{
             {"/v1/completions", R"({"prompt": ")" + std::string(101, 'x') + R"("})", "prompt"},
             {"/v1/chat/completions",
              R"({"messages": [{"role": "system", "content": ")" + std::string(60, 'x') +
                  R"("}, {"role": "user", "content": ")" + std::string(41, 'y') + R"("}]})",
              "messages"}}) {
        TestClient client(server.port());
        client.SetReceiveTimeout(10);
        const HttpReply reply = client.Send(http::verb::post, target, body);
        EXPECT_EQ(reply.status, 400);
        const json e = json::parse(reply.body)["error"];
        EXPECT_EQ(e["param"], param);
        EXPECT_EQ(e["code"], "prompt_too_large");
    }
    gated->Open();
}

// Starts `body` on its own thread; the reply lands in `*reply`.
std::thread PostInBackground(int port, std::string target, std::string body, HttpReply* reply) {
    return std::thread([=] {
        try {
            TestClient client(port);
            client.SetReceiveTimeout(20);
            *reply = client.Send(http::verb::post, target, body);
        } catch (const std::exception& e) {
            ADD_FAILURE() << target << ": " << e.what();
        }
    });
}

TEST(HttpHardening, DrainRefusesNewWorkAndLetsInFlightFinish) {
    TestServerOptions o;
    o.engine.hold_after = 2;
    TestServer server(o);
    HttpReply streamed, plain;
    std::thread a =
        PostInBackground(server.port(), "/v1/completions",
                         R"({"prompt": "Hi", "max_tokens": 5, "stream": true})", &streamed);
    std::thread b = PostInBackground(server.port(), "/v1/completions",
                                     R"({"prompt": "Hi", "max_tokens": 5})", &plain);
    ASSERT_TRUE(server.engine().WaitForSubmitted(2, 10s));
    EXPECT_EQ(server.server().num_in_flight(), 2);

    server.server().BeginDrain();
    const HttpReply refused = Post(server.port(), "/v1/completions", kCompletion);
    EXPECT_EQ(refused.status, 503);
    EXPECT_FALSE(refused.message[http::field::retry_after].empty());
    const json e = json::parse(refused.body)["error"];
    EXPECT_EQ(e["code"], "shutting_down");
    EXPECT_NE(e["message"].get<std::string>().find("shutting down"), std::string::npos);
    const HttpReply health = Get(server.port(), "/health");
    EXPECT_EQ(health.status, 503);
    EXPECT_EQ(json::parse(health.body)["status"], "draining");
    EXPECT_EQ(Get(server.port(), "/v1/models").status, 200);  // reads still answer
    EXPECT_FALSE(server.server().WaitIdle(0ms));              // both are parked in the engine
    EXPECT_EQ(server.server().num_in_flight(), 2);

    server.engine().Release();
    a.join();
    b.join();
    EXPECT_TRUE(server.server().WaitIdle(10s));
    EXPECT_EQ(server.server().num_in_flight(), 0);
    ASSERT_EQ(plain.status, 200);
    EXPECT_EQ(json::parse(plain.body)["choices"][0]["text"], "Hello, world!Hello");
    const auto data = SseData(streamed.body);
    ASSERT_GE(data.size(), 2u) << streamed.body;
    EXPECT_EQ(json::parse(data[data.size() - 2])["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(data.back(), "[DONE]");
    EXPECT_EQ(server.engine().submitted().size(), 2u);  // the refused one never reached it
}

// The engine's Stop() fails what it still holds with Unavailable: a stream ends with an error
// event and [DONE], a plain request gets a JSON error, and WaitIdle sees both written.
TEST(HttpHardening, EngineFailureEndsEveryAnswer) {
    TestServerOptions o;
    o.engine.hold_after = 1;
    TestServer server(o);
    HttpReply streamed, plain;
    std::thread a = PostInBackground(server.port(), "/v1/chat/completions",
                                     R"({"messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 50, "stream": true})",
                                     &streamed);
    std::thread b = PostInBackground(server.port(), "/v1/completions",
                                     R"({"prompt": "Hi", "max_tokens": 50})", &plain);
    ASSERT_TRUE(server.engine().WaitForSubmitted(2, 10s));
    server.server().BeginDrain();
    server.engine().FailAll(
        Status(StatusCode::kUnavailable, "the engine stopped at 10.0.0.9:7000"));
    EXPECT_TRUE(server.server().WaitIdle(10s));
    a.join();
    b.join();
    EXPECT_EQ(plain.status, 503);
    EXPECT_FALSE(plain.message[http::field::retry_after].empty());
    EXPECT_EQ(plain.body.find("10.0.0.9"), std::string::npos) << plain.body;
    EXPECT_EQ(json::parse(plain.body)["error"]["type"], "server_unavailable");
    EXPECT_EQ(streamed.status, 200);
    const auto data = SseData(streamed.body);
    ASSERT_GE(data.size(), 2u) << streamed.body;
    EXPECT_EQ(data.back(), "[DONE]");
    const json error = json::parse(data[data.size() - 2]);
    ASSERT_TRUE(error.contains("error")) << data[data.size() - 2];
    EXPECT_EQ(error["error"]["type"], "server_unavailable");
    EXPECT_EQ(streamed.body.find("10.0.0.9"), std::string::npos);
}

// Special-token text in message content is text by default; the template's markers stay tokens.
TEST(HttpHardening, ChatContentSpecialTokensAreTextByDefault) {
    const std::string body =
        R"({"messages": [{"role": "user", "content": "a<|im_end|>"}], "max_tokens": 1})";
    std::vector<int32_t> text = {256};
    for (char c : std::string("user\na<|im_end|>")) text.push_back(static_cast<uint8_t>(c));
    std::vector<int32_t> control = {256};
    for (char c : std::string("user\na")) control.push_back(c);
    control.push_back(257);
    for (std::vector<int32_t>* tail : {&text, &control}) {
        tail->push_back(257);
        tail->push_back('\n');
        tail->push_back(256);
        for (char c : std::string("assistant\n")) tail->push_back(c);
    }
    for (const auto& [mode, expect] :
         {std::pair{HttpConfig::ContentSpecialTokens::kText, text},
          std::pair{HttpConfig::ContentSpecialTokens::kControl, control}}) {
        TestServerOptions o;
        o.http.content_special_tokens = mode;
        TestServer server(o);
        ASSERT_EQ(Post(server.port(), "/v1/chat/completions", body).status, 200);
        EXPECT_EQ(server.engine().submitted().at(0).prompt_token_ids, expect);
    }
}

}  // namespace
}  // namespace kvshard
