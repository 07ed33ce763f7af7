// libFuzzer target for the HTTP layer, raw bytes in: the bytes go through a Beast request parser
// set up as a session sets it up (ConfigureRequestParser), the header checks, the read-error
// answers, the routing with API keys and draining (RouteRequest), and for a generation route
// ApiService::Parse and Prepare (chat template, tokenization, context check): everything a
// session does before Engine::Submit, without a socket. Up to 4 pipelined requests per input.
// The first byte chooses whether an API key is required and whether the server is draining.
//
// Nothing may throw or crash; every answer must serialize, and an error answer must carry an
// OpenAI error body.
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http.hpp>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "coordinator/api_service.h"
#include "coordinator/fuzz/fuzz_util.h"
#include "coordinator/http_routes.h"

namespace {

using namespace kvshard;
namespace http = boost::beast::http;
namespace net = boost::asio;

// Answers what routing asks of an engine; Submit is never reached.
class IdleEngine : public Engine {
  public:
    Status Submit(GenerationRequest, std::shared_ptr<RequestSink>) override { std::abort(); }
    void Abort(const std::string&) override {}
    EngineStats Stats() const override { return {}; }
    int64_t max_context() const override { return 256; }
};

struct Server {
    Server() : tokenizer(fuzz::ByteTokenizer()) {
        for (bool keyed : {false, true}) {
            ApiServiceOptions o;
            o.model = {"m", "/models/m.gguf", tokenizer->vocab_size()};
            o.chat_template =
                ChatTemplate::FromStyle(ChatTemplateStyle::kChatMl, {"", "<|im_end|>"});
            if (keyed) o.http.api_keys = {"k"};
            api[keyed] = std::make_unique<ApiService>(engine, *tokenizer,
                                                      std::make_shared<ServerMetrics>("m"), o);
        }
        config.max_body_bytes = 4096;
    }
    IdleEngine engine;
    std::unique_ptr<Tokenizer> tokenizer;
    std::unique_ptr<ApiService> api[2];
    HttpConfig config;
};

void CheckAnswer(const HttpAnswer& a) {
    KVSHARD_FUZZ_CHECK(a.status >= 200 && a.status < 600);
    if (a.status >= 400) {
        // An OpenAI error body, or /health's {"status": ...}.
        const nlohmann::json j = nlohmann::json::parse(a.body, nullptr, false);
        KVSHARD_FUZZ_CHECK(j.is_object());
        if (!j.contains("status")) {
            KVSHARD_FUZZ_CHECK(j.contains("error") && j["error"].is_object() &&
                               j["error"].contains("message") && j["error"]["message"].is_string());
        }
    }
    http::response<http::string_body> res{static_cast<http::status>(a.status), 11};
    res.set(http::field::content_type, a.content_type);
    if (!a.allow.empty()) res.set(http::field::allow, a.allow);
    res.body() = a.body;
    res.prepare_payload();
    std::ostringstream os;
    os << res;
    KVSHARD_FUZZ_CHECK(!os.str().empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const Server server;
    if (size == 0) return 0;
    const ApiService& api = *server.api[(data[0] & 1) != 0];
    const bool draining = (data[0] & 2) != 0;
    std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);

    for (int message = 0; message < 4 && !rest.empty(); ++message) {
        HttpRequestParser parser;
        ConfigureRequestParser(parser, server.config);
        parser.eager(true);
        boost::beast::error_code ec;
        bool header_checked = false;
        std::optional<HttpAnswer> refused;
        while (!rest.empty() && !parser.is_done()) {
            const size_t used = parser.put(net::buffer(rest.data(), rest.size()), ec);
            rest.remove_prefix(used);
            if (ec == http::error::need_more) {
                ec = {};
                if (used == 0) break;
                continue;
            }
            if (ec) break;
            if (parser.is_header_done() && !header_checked) {
                header_checked = true;
                refused = CheckRequestHeader(parser.get());
                if (refused) break;
            }
        }
        if (refused) {
            CheckAnswer(*refused);
            return 0;
        }
        if (!ec && !parser.is_done()) {
            parser.put_eof(ec);
            if (!ec && !parser.is_done()) return 0;
        }
        if (ec) {
            if (std::optional<HttpAnswer> answer = AnswerReadError(ec, server.config)) {
                CheckAnswer(*answer);
            }
            return 0;
        }
        if (parser.is_header_done() && !header_checked) {
            if (std::optional<HttpAnswer> r = CheckRequestHeader(parser.get())) {
                CheckAnswer(*r);
                return 0;
            }
        }
        HttpRequest request = parser.release();
        RouteResult route = RouteRequest(request, api, draining);
        if (auto* answer = std::get_if<HttpAnswer>(&route)) {
            CheckAnswer(*answer);
            continue;
        }
        if (auto* tokenizer_route = std::get_if<TokenizerEndpoint>(&route)) {
            KVSHARD_FUZZ_CHECK(!draining);
            auto answer = api.TokenizerAnswer(*tokenizer_route, request.body());
            if (auto* e = std::get_if<ApiError>(&answer)) {
                CheckAnswer(ErrorAnswer(*e));
            } else {
                HttpAnswer a;
                a.body = std::get<std::string>(answer);
                CheckAnswer(a);
            }
            continue;
        }
        if (auto* anthropic = std::get_if<AnthropicEndpoint>(&route)) {
            KVSHARD_FUZZ_CHECK(!draining);
            if (*anthropic == AnthropicEndpoint::kCountTokens) {
                auto answer = api.CountTokensAnswer(request.body());
                if (auto* e = std::get_if<ApiError>(&answer)) {
                    CheckAnswer(ErrorAnswer(*e, false, ErrorShape::kAnthropic));
                }
                continue;
            }
            auto parsed = api.ParseAnthropic(*anthropic, request.body());
            if (auto* e = std::get_if<ApiError>(&parsed)) {
                CheckAnswer(ErrorAnswer(*e, false, ErrorShape::kAnthropic));
                continue;
            }
            auto prepared = api.PrepareAnthropic(std::get<AnthropicRequest>(parsed));
            if (auto* e = std::get_if<ApiError>(&prepared)) {
                CheckAnswer(ErrorAnswer(*e, false, ErrorShape::kAnthropic));
                continue;
            }
            const GenerationRequest& g = std::get<PreparedGeneration>(prepared).request;
            KVSHARD_FUZZ_CHECK(static_cast<int64_t>(g.prompt_token_ids.size()) + g.max_tokens <=
                               server.engine.max_context());
            KVSHARD_FUZZ_CHECK(g.cache_breakpoints.size() <= 4);
            continue;
        }
        const ApiEndpoint endpoint = std::get<ApiEndpoint>(route);
        KVSHARD_FUZZ_CHECK(!draining);
        auto parsed = api.Parse(endpoint, request.body());
        if (auto* e = std::get_if<ApiError>(&parsed)) {
            CheckAnswer(ErrorAnswer(*e));
            continue;
        }
        auto prepared = api.Prepare(std::get<OpenAiRequest>(parsed));
        if (auto* e = std::get_if<ApiError>(&prepared)) {
            CheckAnswer(ErrorAnswer(*e));
            continue;
        }
        const PreparedGeneration& p = std::get<PreparedGeneration>(prepared);
        KVSHARD_FUZZ_CHECK(!p.request.prompt_token_ids.empty());
        KVSHARD_FUZZ_CHECK(static_cast<int64_t>(p.request.prompt_token_ids.size()) +
                               p.request.max_tokens <=
                           server.engine.max_context());
        for (int32_t id : p.request.prompt_token_ids) {
            KVSHARD_FUZZ_CHECK(id >= 0 && id < server.tokenizer->vocab_size());
        }
    }
    return 0;
}
