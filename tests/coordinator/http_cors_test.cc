// CORS for browser clients (server.cors_allowed_origins): preflights, the allow-origin header on
// answers, errors and streams, no CORS headers for other origins or with CORS off.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "config/server_config.h"
#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using testing::TestClient;
using testing::TestServer;
using testing::TestServerOptions;
namespace http = boost::beast::http;

constexpr char kPage[] = "https://chat.example.com";

TestServerOptions Cors(std::vector<std::string> origins, std::vector<std::string> keys = {}) {
    TestServerOptions o;
    o.http.cors_allowed_origins = std::move(origins);
    o.http.api_keys = std::move(keys);
    return o;
}

std::string Header(const testing::HttpReply& r, std::string_view name) {
    auto it = r.message.find(boost::beast::string_view(name.data(), name.size()));
    return it == r.message.end() ? "" : std::string(it->value());
}

TEST(HttpCors, PreflightForAnAllowedOriginNeedsNoKey) {
    TestServer server(Cors({"http://other.example", kPage}, {"secret"}));
    TestClient c(server.port());
    auto r = c.Send(http::verb::options, "/v1/chat/completions", "",
                    {{"Origin", kPage},
                     {"Access-Control-Request-Method", "POST"},
                     {"Access-Control-Request-Headers", "authorization, content-type, x-stainless-os"}});
    EXPECT_EQ(r.status, 204) << r.body;
    EXPECT_EQ(Header(r, "Access-Control-Allow-Origin"), kPage);
    EXPECT_EQ(Header(r, "Vary"), "Origin");
    EXPECT_NE(Header(r, "Access-Control-Allow-Methods").find("POST"), std::string::npos);
    EXPECT_EQ(Header(r, "Access-Control-Allow-Headers"),
              "authorization, content-type, x-stainless-os");
    EXPECT_EQ(Header(r, "Access-Control-Max-Age"), "600");
    // The connection stays usable.
    auto models = c.Send(http::verb::get, "/v1/models", "",
                         {{"Origin", kPage}, {"Authorization", "Bearer secret"}});
    EXPECT_EQ(models.status, 200);
    EXPECT_EQ(Header(models, "Access-Control-Allow-Origin"), kPage);
}

TEST(HttpCors, AnswersErrorsAndStreamsCarryTheOrigin) {
    TestServer server(Cors({kPage}, {"secret"}));
    const std::vector<std::pair<std::string, std::string>> page = {
        {"Origin", kPage}, {"Authorization", "Bearer secret"}};
    auto ok = testing::Post(server.port(), "/v1/completions", R"({"prompt": "Hi", "max_tokens": 2})",
                            page);
    EXPECT_EQ(ok.status, 200);
    EXPECT_EQ(Header(ok, "Access-Control-Allow-Origin"), kPage);
    EXPECT_NE(Header(ok, "Access-Control-Expose-Headers").find("Retry-After"), std::string::npos);
    auto stream = testing::Post(server.port(), "/v1/completions",
                                R"({"prompt": "Hi", "max_tokens": 2, "stream": true})", page);
    EXPECT_EQ(stream.status, 200);
    EXPECT_EQ(Header(stream, "Access-Control-Allow-Origin"), kPage);
    auto bad = testing::Post(server.port(), "/v1/completions", R"({"prompt": 5})", page);
    EXPECT_EQ(bad.status, 400);
    EXPECT_EQ(Header(bad, "Access-Control-Allow-Origin"), kPage);
    // A 401 a page can read, so it can tell the user the key is wrong.
    auto unauthorized = testing::Post(server.port(), "/v1/completions", R"({"prompt": "Hi"})",
                                      {{"Origin", kPage}});
    EXPECT_EQ(unauthorized.status, 401);
    EXPECT_EQ(Header(unauthorized, "Access-Control-Allow-Origin"), kPage);
    auto missing = testing::Get(server.port(), "/nothing");
    EXPECT_EQ(missing.status, 404);
    EXPECT_EQ(Header(missing, "Access-Control-Allow-Origin"), "");  // no Origin: no CORS
}

TEST(HttpCors, OtherOriginsGetNoCorsHeaders) {
    TestServer server(Cors({kPage}));
    TestClient c(server.port());
    auto pre = c.Send(http::verb::options, "/v1/completions", "",
                      {{"Origin", "https://evil.example"}, {"Access-Control-Request-Method", "POST"}});
    EXPECT_EQ(pre.status, 400);
    EXPECT_EQ(Header(pre, "Access-Control-Allow-Origin"), "");
    EXPECT_NE(pre.body.find("https://evil.example"), std::string::npos);
    auto r = testing::Post(server.port(), "/v1/completions", R"({"prompt": "Hi", "max_tokens": 1})",
                           {{"Origin", "https://evil.example"}});
    EXPECT_EQ(r.status, 200);  // a non-browser client is served; a browser hides the answer
    EXPECT_EQ(Header(r, "Access-Control-Allow-Origin"), "");
    // A prefix or suffix of an allowed origin is another origin.
    r = testing::Post(server.port(), "/v1/completions", R"({"prompt": "Hi", "max_tokens": 1})",
                      {{"Origin", std::string(kPage) + ".evil.example"}});
    EXPECT_EQ(Header(r, "Access-Control-Allow-Origin"), "");
}

TEST(HttpCors, StarAllowsEveryOrigin) {
    TestServer server(Cors({"*"}));
    TestClient c(server.port());
    auto pre = c.Send(http::verb::options, "/v1/messages", "",
                      {{"Origin", "http://localhost:3000"}, {"Access-Control-Request-Method", "POST"}});
    EXPECT_EQ(pre.status, 204);
    EXPECT_EQ(Header(pre, "Access-Control-Allow-Origin"), "*");
    EXPECT_EQ(Header(pre, "Vary"), "");
    auto models = testing::Get(server.port(), "/v1/models");
    EXPECT_EQ(Header(models, "Access-Control-Allow-Origin"), "");  // no Origin sent
}

TEST(HttpCors, OffByDefault) {
    TestServer server;
    TestClient c(server.port());
    auto pre = c.Send(http::verb::options, "/v1/completions", "",
                      {{"Origin", kPage}, {"Access-Control-Request-Method", "POST"}});
    EXPECT_EQ(pre.status, 405);
    EXPECT_EQ(Header(pre, "Access-Control-Allow-Origin"), "");
    auto r = testing::Post(server.port(), "/v1/completions", R"({"prompt": "Hi", "max_tokens": 1})",
                           {{"Origin", kPage}});
    EXPECT_EQ(Header(r, "Access-Control-Allow-Origin"), "");
}

}  // namespace
}  // namespace kvshard
