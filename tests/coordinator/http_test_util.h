// Helpers for the HTTP tests: a tiny byte-level tokenizer, a server on an ephemeral loopback port
// in front of a FakeEngine, and a small blocking Beast client.
#pragma once

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/server_config.h"
#include "coordinator/api_service.h"
#include "coordinator/http_server.h"
#include "coordinator/metrics.h"
#include "model/bpe_tokenizer.h"
#include "model/tokenizer.h"
#include "tests/coordinator/fake_engine.h"

namespace kvshard::testing {

// Byte-level BPE with no merges: token id = byte value, plus two control tokens
// <|im_start|> (256) and <|im_end|> (257, EOS). Prompt tokens = prompt bytes.
inline std::unique_ptr<Tokenizer> ByteTokenizer() {
    TokenizerData d;
    d.kind = TokenizerKind::kByteLevelBpe;
    for (const std::string& s : ByteLevelEncodeTable()) d.tokens.push_back(s);
    d.tokens.push_back("<|im_start|>");
    d.tokens.push_back("<|im_end|>");
    d.types.assign(d.tokens.size(), TokenType::kNormal);
    d.types[256] = TokenType::kControl;
    d.types[257] = TokenType::kControl;
    d.eos_id = 257;
    auto tok = Tokenizer::Create(std::move(d));
    EXPECT_TRUE(tok.ok()) << tok.status().ToString();
    return std::move(tok).value();
}

struct TestServerOptions {
    FakeEngine::Options engine;
    HttpConfig http;  // the API's settings too (api_keys, max_prompt_bytes, ...)
    bool chat_template = true;
    std::optional<ChatTemplate> custom_chat_template;  // set: used instead of ChatML
    std::shared_ptr<Tokenizer> tokenizer;              // null: ByteTokenizer()
    std::vector<std::string> model_aliases;             // ServedModel::aliases
    std::string tokenizer_json, tokenizer_config_json;  // GET /v1/models/{id}/tokenizer...
};

// FakeEngine + ApiService + HttpServer on 127.0.0.1, an ephemeral port.
class TestServer {
  public:
    explicit TestServer(TestServerOptions options = {})
        : metrics_(std::make_shared<ServerMetrics>("test-model")),
          engine_(WithObserver(options.engine, metrics_.get())) {
        tokenizer_ = options.tokenizer ? options.tokenizer : ByteTokenizer();
        ApiServiceOptions api;
        api.model = {"test-model", "/models/test-model.gguf", tokenizer_->vocab_size()};
        if (options.chat_template) {
            api.chat_template =
                ChatTemplate::FromStyle(ChatTemplateStyle::kChatMl, {"", "<|im_end|>"});
        }
        if (options.custom_chat_template) api.chat_template = options.custom_chat_template;
        api.http = options.http;
        api.model.aliases = options.model_aliases;
        api.tokenizer_json = options.tokenizer_json;
        api.tokenizer_config_json = options.tokenizer_config_json;
        api_ = std::make_unique<ApiService>(engine_, *tokenizer_, metrics_, api);
        HttpConfig http = options.http;
        http.host = "127.0.0.1";
        http.port = 0;
        auto server = HttpServer::Start(http, *api_);
        EXPECT_TRUE(server.ok()) << server.status().ToString();
        server_ = std::move(server).value();
    }
    ~TestServer() { server_->Stop(); }

    int port() const { return server_->port(); }
    FakeEngine& engine() { return engine_; }
    HttpServer& server() { return *server_; }

  private:
    static FakeEngine::Options WithObserver(FakeEngine::Options o, EngineObserver* observer) {
        o.observer = observer;
        return o;
    }

    std::shared_ptr<ServerMetrics> metrics_;  // the engine's observer: outlives it
    FakeEngine engine_;  // outlives the server: sessions abort into it when they close
    std::shared_ptr<Tokenizer> tokenizer_;
    std::unique_ptr<ApiService> api_;
    std::unique_ptr<HttpServer> server_;
};

struct HttpReply {
    int status = 0;
    std::string body;
    boost::beast::http::response<boost::beast::http::string_body> message;
};

// One connection; several requests may go over it (keep-alive).
class TestClient {
  public:
    explicit TestClient(int port) : socket_(io_) {
        namespace net = boost::asio;
        socket_.connect({net::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)});
    }

    HttpReply Send(boost::beast::http::verb method, const std::string& target,
                   const std::string& body = "",
                   const std::vector<std::pair<std::string, std::string>>& headers = {}) {
        namespace http = boost::beast::http;
        http::request<http::string_body> req{method, target, 11};
        req.set(http::field::host, "127.0.0.1");
        if (!body.empty() || method == http::verb::post) {
            req.set(http::field::content_type, "application/json");
            req.body() = body;
            req.prepare_payload();
        }
        for (const auto& [name, value] : headers) req.set(name, value);
        http::write(socket_, req);
        return Read(method == http::verb::head);
    }

    // `head`: the answer to a HEAD request (headers only, whatever Content-Length says).
    HttpReply Read(bool head = false) {
        namespace http = boost::beast::http;
        HttpReply reply;
        http::response_parser<http::string_body> parser;
        parser.body_limit(64 << 20);
        parser.skip(head);
        http::read(socket_, buffer_, parser);
        reply.message = parser.release();
        reply.status = static_cast<int>(reply.message.result_int());
        reply.body = reply.message.body();
        return reply;
    }

    // Blocking reads give up (throw) after `seconds`, so a server that never answers fails the
    // test instead of hanging it.
    void SetReceiveTimeout(int seconds) {
        timeval tv{seconds, 0};
        ::setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    }

    boost::asio::ip::tcp::socket& socket() { return socket_; }

  private:
    boost::asio::io_context io_;
    boost::asio::ip::tcp::socket socket_;
    boost::beast::flat_buffer buffer_;
};

inline HttpReply Post(int port, const std::string& target, const std::string& body,
                      const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    TestClient c(port);
    return c.Send(boost::beast::http::verb::post, target, body, headers);
}

inline HttpReply Get(int port, const std::string& target) {
    TestClient c(port);
    return c.Send(boost::beast::http::verb::get, target);
}

// The data lines of a server-sent event stream, in order ("[DONE]" included).
inline std::vector<std::string> SseData(const std::string& body) {
    std::vector<std::string> out;
    size_t pos = 0;
    while (pos < body.size()) {
        size_t end = body.find("\n\n", pos);
        if (end == std::string::npos) end = body.size();
        std::string event = body.substr(pos, end - pos);
        if (event.rfind("data: ", 0) == 0) out.push_back(event.substr(6));
        pos = end + 2;
    }
    return out;
}

}  // namespace kvshard::testing
