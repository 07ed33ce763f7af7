// Served model names (--served-model-name a b: /v1/models lists both, requests may name either,
// answers carry the first) and the Hugging Face tokenizer files under
// GET /v1/models/{id}/tokenizer and /tokenizer_config, over loopback.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/coordinator/http_test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;
using testing::Get;
using testing::Post;
using testing::TestClient;
using testing::TestServer;
using testing::TestServerOptions;
namespace http = boost::beast::http;

TEST(HttpModelNames, EveryNameIsListedAndAcceptedAndAnswersCarryTheFirst) {
    TestServerOptions o;
    o.model_aliases = {"org/alias-model"};
    TestServer server(o);
    const json list = json::parse(Get(server.port(), "/v1/models").body);
    ASSERT_EQ(list["data"].size(), 2u) << list;
    EXPECT_EQ(list["data"][0]["id"], "test-model");
    EXPECT_EQ(list["data"][1]["id"], "org/alias-model");

    for (const char* id : {"org/alias-model", "org%2Falias-model"}) {
        auto one = Get(server.port(), std::string("/v1/models/") + id);
        ASSERT_EQ(one.status, 200) << id << " " << one.body;
        EXPECT_EQ(json::parse(one.body)["id"], "org/alias-model") << id;
    }
    auto reply = Post(server.port(), "/v1/completions",
                      R"({"model": "org/alias-model", "prompt": "Hi", "max_tokens": 2})");
    ASSERT_EQ(reply.status, 200) << reply.body;
    EXPECT_EQ(json::parse(reply.body)["model"], "test-model");

    auto missing = Post(server.port(), "/v1/completions",
                        R"({"model": "other", "prompt": "Hi", "max_tokens": 2})");
    EXPECT_EQ(missing.status, 404);
    const std::string message = json::parse(missing.body)["error"]["message"];
    EXPECT_NE(message.find("'test-model' (also named 'org/alias-model')"), std::string::npos)
        << message;
}

TEST(HttpTokenizerFiles, ServedUnderEveryNameElse404) {
    TestServerOptions o;
    o.model_aliases = {"org/alias-model"};
    o.tokenizer_json = R"({"version": "1.0"})";
    o.tokenizer_config_json = R"({"chat_template": "t"})";
    TestServer server(o);
    for (const std::string id :
         {"test-model", "test-model.gguf", "org/alias-model", "org%2Falias-model"}) {
        auto tok = Get(server.port(), "/v1/models/" + id + "/tokenizer");
        ASSERT_EQ(tok.status, 200) << id << " " << tok.body;
        EXPECT_EQ(tok.body, o.tokenizer_json) << id;
        EXPECT_EQ(tok.message[http::field::content_type], "application/json");
        auto config = Get(server.port(), "/v1/models/" + id + "/tokenizer_config");
        ASSERT_EQ(config.status, 200) << id << " " << config.body;
        EXPECT_EQ(config.body, o.tokenizer_config_json) << id;
    }
    auto unknown = Get(server.port(), "/v1/models/meta-llama/Llama-3-8B/tokenizer");
    EXPECT_EQ(unknown.status, 404);
    EXPECT_EQ(json::parse(unknown.body)["error"]["code"], "model_not_found");
    EXPECT_NE(unknown.body.find("'meta-llama/Llama-3-8B'"), std::string::npos) << unknown.body;
    auto other_file = Get(server.port(), "/v1/models/test-model/vocab");
    EXPECT_EQ(other_file.status, 404);

    TestClient client(server.port());
    auto head = client.Send(http::verb::head, "/v1/models/test-model/tokenizer");
    EXPECT_EQ(head.status, 200);
    EXPECT_TRUE(head.body.empty());
}

TEST(HttpTokenizerFiles, NeedTheApiKeyAndSayWhenTheServerHasNone) {
    TestServerOptions o;
    o.http.api_keys = {"secret"};
    TestServer server(o);
    EXPECT_EQ(Get(server.port(), "/v1/models/test-model/tokenizer").status, 401);
    TestClient client(server.port());
    auto none = client.Send(http::verb::get, "/v1/models/test-model/tokenizer", "",
                            {{"Authorization", "Bearer secret"}});
    EXPECT_EQ(none.status, 404);
    EXPECT_NE(none.body.find("no Hugging Face tokenizer files for 'test-model'"), std::string::npos)
        << none.body;
}

}  // namespace
}  // namespace kvshard
