#include "coordinator/http_routes.h"

#include <boost/beast/core/string.hpp>
#include <boost/beast/http/rfc7230.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/build_config.h"

namespace kvshard {

namespace beast = boost::beast;
namespace http = beast::http;

namespace {

ApiError RouteError(unsigned status, std::string message, std::string code) {
    ApiError e;
    e.http_status = static_cast<int>(status);
    e.message = std::move(message);
    e.code = std::move(code);
    return e;
}

// Beast's parse errors in kvshard's words (the library's text names its internals).
std::string MalformedHttpMessage(http::error e) {
    switch (e) {
        case http::error::bad_method:
            return "the request method is malformed";
        case http::error::bad_target:
            return "the request target is malformed";
        case http::error::bad_version:
            return "the request is not HTTP/1.0 or HTTP/1.1";
        case http::error::bad_field:
            return "a header field name is malformed";
        case http::error::bad_value:
            return "a header field value is malformed";
        case http::error::bad_content_length:
            return "Content-Length is malformed or given twice with different values";
        case http::error::bad_transfer_encoding:
            return "Transfer-Encoding is malformed or conflicts with Content-Length";
        case http::error::bad_chunk:
        case http::error::bad_chunk_extension:
            return "the chunked body is malformed";
        case http::error::bad_line_ending:
            return "a line of the request does not end in CRLF";
        case http::error::bad_obs_fold:
            return "folded header lines are not accepted";
        default:
            return "the request is not valid HTTP/1.1";
    }
}

}  // namespace

ErrorShape ErrorShapeFor(std::string_view target) {
    target = target.substr(0, target.find('?'));
    constexpr std::string_view kMessages = "/v1/messages";
    const bool anthropic = target.substr(0, kMessages.size()) == kMessages &&
                           (target.size() == kMessages.size() || target[kMessages.size()] == '/');
    return anthropic ? ErrorShape::kAnthropic : ErrorShape::kOpenAi;
}

HttpAnswer ErrorAnswer(const ApiError& error, bool close, ErrorShape shape) {
    HttpAnswer a;
    a.status = static_cast<unsigned>(error.http_status);
    a.body = shape == ErrorShape::kAnthropic ? AnthropicErrorBody(error) : ApiErrorBody(error);
    a.retry_after_s = error.retry_after_s;
    a.www_authenticate = error.http_status == 401;
    a.close = close;
    return a;
}

void ConfigureRequestParser(HttpRequestParser& parser, const HttpConfig& config) {
    parser.body_limit(static_cast<uint64_t>(config.max_body_bytes));
    parser.header_limit(kHttpHeaderLimitBytes);
}

std::optional<HttpAnswer> CheckRequestHeader(const HttpRequest& header) {
    const auto codings = header.equal_range(http::field::transfer_encoding);
    for (auto it = codings.first; it != codings.second; ++it) {
        bool any = false;
        for (const auto coding : http::token_list(it->value())) {
            any = true;
            if (beast::iequals(coding, "chunked")) continue;
            return ErrorAnswer(RouteError(501,
                                          "only the chunked transfer coding is supported; send "
                                          "the body as is (Content-Length) or chunked",
                                          "unsupported_transfer_encoding"),
                               /*close=*/true);
        }
        if (!any) {
            return ErrorAnswer(
                RouteError(400, "Transfer-Encoding is empty", "invalid_transfer_encoding"),
                /*close=*/true);
        }
    }
    return std::nullopt;
}

std::optional<HttpAnswer> AnswerReadError(beast::error_code ec, const HttpConfig& config) {
    if (ec == http::error::body_limit) {
        return ErrorAnswer(RouteError(413,
                                      "the request body is larger than " +
                                          std::to_string(config.max_body_bytes) + " bytes",
                                      "request_too_large"),
                           /*close=*/true);
    }
    if (ec == http::error::header_limit) {
        return ErrorAnswer(RouteError(431,
                                      "the request line and header fields are larger than " +
                                          std::to_string(kHttpHeaderLimitBytes) + " bytes",
                                      "header_too_large"),
                           /*close=*/true);
    }
    if (ec == http::error::end_of_stream || ec == http::error::partial_message) {
        return std::nullopt;
    }
    if (ec.category() == http::make_error_code(http::error::bad_target).category()) {
        return ErrorAnswer(BadRequest("malformed HTTP request: " +
                                      MalformedHttpMessage(static_cast<http::error>(ec.value()))),
                           /*close=*/true);
    }
    return std::nullopt;
}

std::string CorsAllowOrigin(const HttpRequest& request, const HttpConfig& config) {
    if (config.cors_allowed_origins.empty()) return "";
    const auto origin = request.find(http::field::origin);
    if (origin == request.end()) return "";
    const std::string_view value(origin->value().data(), origin->value().size());
    for (const std::string& allowed : config.cors_allowed_origins) {
        if (allowed == "*") return "*";
        // Origins compare as the browser serializes them: scheme, host and port, exactly.
        if (allowed == value) return std::string(value);
    }
    return "";
}

std::optional<HttpAnswer> CorsPreflight(const HttpRequest& request, const HttpConfig& config) {
    if (config.cors_allowed_origins.empty() || request.method() != http::verb::options) {
        return std::nullopt;
    }
    const auto origin = request.find(http::field::origin);
    const auto method = request.find(http::field::access_control_request_method);
    if (origin == request.end() || method == request.end()) return std::nullopt;
    const std::string allow = CorsAllowOrigin(request, config);
    if (allow.empty()) {
        return ErrorAnswer(RouteError(400,
                                      "the origin '" + std::string(origin->value()) +
                                          "' is not allowed (server.cors_allowed_origins)",
                                      "cors_origin_not_allowed"));
    }
    HttpAnswer a;
    a.status = 204;
    a.content_type.clear();
    a.headers = {{"Access-Control-Allow-Origin", allow},
                 {"Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS"},
                 {"Access-Control-Max-Age", "600"}};
    // Whatever headers the page's client sends (the OpenAI and Anthropic SDKs send their own
    // x-stainless-* and anthropic-* fields besides Authorization and Content-Type), as long as
    // the list is header names.
    const auto requested = request.find(http::field::access_control_request_headers);
    if (requested != request.end()) {
        const std::string_view names(requested->value().data(), requested->value().size());
        const bool token_list = names.find_first_not_of(
                                    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                    "0123456789!#$%&'*+-.^_`|~, ") == std::string_view::npos;
        if (token_list && !names.empty()) {
            a.headers.emplace_back("Access-Control-Allow-Headers", std::string(names));
        }
    }
    if (allow != "*") a.headers.emplace_back("Vary", "Origin");
    return a;
}

namespace {

enum class Route {
    kCompletions,
    kChatCompletions,
    kResponses,
    kMessages,
    kCountTokens,
    kTokenize,
    kDetokenize,
    kModels,
    kModel,  // /v1/models/{id}
    kHealth,
    kMetrics,
    kVersion,
};

// %XX escapes decoded (a client library may write a model id's "/" as %2F); a malformed escape
// stays as it is.
std::string PercentDecode(std::string_view s) {
    auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    };
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '%' && i + 2 < s.size() && hex(s[i + 1]) >= 0 && hex(s[i + 2]) >= 0) {
            out += static_cast<char>(hex(s[i + 1]) * 16 + hex(s[i + 2]));
            i += 2;
        } else {
            out += s[i];
        }
    }
    return out;
}

}  // namespace

RouteResult RouteRequest(const HttpRequest& request, const ApiService& api, bool draining) {
    std::string_view target(request.target().data(), request.target().size());
    target = target.substr(0, target.find('?'));
    const http::verb method = request.method();

    struct RouteEntry {
        std::string_view path;
        http::verb method;
        Route route;
        bool prefix;  // the path is followed by an id
        bool authenticated;
    };
    static constexpr RouteEntry kRoutes[] = {
        {"/v1/completions", http::verb::post, Route::kCompletions, false, true},
        {"/v1/chat/completions", http::verb::post, Route::kChatCompletions, false, true},
        {"/v1/responses", http::verb::post, Route::kResponses, false, true},
        {"/v1/messages", http::verb::post, Route::kMessages, false, true},
        {"/v1/messages/count_tokens", http::verb::post, Route::kCountTokens, false, true},
        {"/tokenize", http::verb::post, Route::kTokenize, false, true},
        {"/detokenize", http::verb::post, Route::kDetokenize, false, true},
        {"/v1/models", http::verb::get, Route::kModels, false, true},
        {"/v1/models/", http::verb::get, Route::kModel, true, true},
        {"/health", http::verb::get, Route::kHealth, false, false},
        {"/metrics", http::verb::get, Route::kMetrics, false, false},
        {"/version", http::verb::get, Route::kVersion, false, false},
    };
    const ErrorShape shape = ErrorShapeFor(target);
    auto error_answer = [shape](const ApiError& e) { return ErrorAnswer(e, false, shape); };
    const RouteEntry* route = nullptr;
    for (const RouteEntry& r : kRoutes) {
        const bool match =
            r.prefix ? target.size() > r.path.size() && target.substr(0, r.path.size()) == r.path
                     : target == r.path;
        if (match) route = &r;
    }
    if (route == nullptr) {
        return error_answer(RouteError(
            404, "no route for " + std::string(request.method_string()) + " " + std::string(target),
            "not_found"));
    }
    const bool get_route = route->method == http::verb::get;
    const bool head = get_route && method == http::verb::head;
    if (method != route->method && !head) {
        const char* allow = get_route ? "GET, HEAD" : "POST";
        HttpAnswer a = error_answer(RouteError(405,
                                               std::string(target) + " accepts " + allow +
                                                   ", not " + std::string(request.method_string()),
                                               "method_not_allowed"));
        a.allow = allow;
        return a;
    }
    if (route->authenticated) {
        auto auth = request.find(http::field::authorization);
        std::string_view value;
        if (auth != request.end())
            value = std::string_view(auth->value().data(), auth->value().size());
        bool authorized = api.Authorized(value);
        // Anthropic's clients send the key as x-api-key.
        auto x_api_key = request.find("x-api-key");
        if (!authorized && shape == ErrorShape::kAnthropic && x_api_key != request.end()) {
            authorized = api.AuthorizedKey(
                std::string_view(x_api_key->value().data(), x_api_key->value().size()));
        }
        if (!authorized) {
            return error_answer(RouteError(
                401,
                shape == ErrorShape::kAnthropic
                    ? "a valid API key is required: x-api-key: <key> or Authorization: Bearer <key>"
                    : "a valid API key is required: Authorization: Bearer <key>",
                "invalid_api_key"));
        }
    }
    if (!get_route && draining) {
        ApiError e = RouteError(503, "the server is shutting down; retry on another server",
                                "shutting_down");
        e.type = "server_unavailable";
        e.retry_after_s = 5;
        return error_answer(e);
    }
    HttpAnswer a;
    a.head = head;
    switch (route->route) {
        case Route::kCompletions:
            return ApiEndpoint::kCompletions;
        case Route::kChatCompletions:
            return ApiEndpoint::kChatCompletions;
        case Route::kResponses:
            return ResponsesEndpoint::kCreate;
        case Route::kMessages:
            return AnthropicEndpoint::kMessages;
        case Route::kCountTokens:
            return AnthropicEndpoint::kCountTokens;
        case Route::kTokenize:
            return TokenizerEndpoint::kTokenize;
        case Route::kDetokenize:
            return TokenizerEndpoint::kDetokenize;
        case Route::kModels:
            a.body = api.ModelsBody();
            break;
        case Route::kModel: {
            // {id} may hold "/" itself ("HuggingFaceTB/SmolLM2-135M-Instruct"): a path that is
            // not a served name but ends in a tokenizer file's name asks for that file.
            const std::string rest = PercentDecode(target.substr(route->path.size()));
            std::optional<TokenizerFile> file;
            std::string id = rest;
            if (!api.ServesModelName(rest)) {
                for (const auto& [suffix, which] :
                     {std::pair<std::string_view, TokenizerFile>{"/tokenizer",
                                                                 TokenizerFile::kTokenizerJson},
                      {"/tokenizer_config", TokenizerFile::kTokenizerConfig}}) {
                    if (rest.size() > suffix.size() &&
                        std::string_view(rest).substr(rest.size() - suffix.size()) == suffix) {
                        file = which;
                        id = rest.substr(0, rest.size() - suffix.size());
                    }
                }
            }
            auto body = file ? api.TokenizerFileBody(id, *file) : api.ModelBody(id);
            if (auto* error = std::get_if<ApiError>(&body)) {
                HttpAnswer e = ErrorAnswer(*error);
                e.head = head;
                return e;
            }
            a.body = std::move(std::get<std::string>(body));
            break;
        }
        case Route::kHealth:
            if (draining) {
                a.status = 503;
                a.body = R"({"status":"draining"})";
            } else {
                auto [status, body] = api.Health();
                a.status = static_cast<unsigned>(status);
                a.body = std::move(body);
            }
            break;
        case Route::kMetrics:
            a.content_type = "text/plain; version=0.0.4; charset=utf-8";
            a.body = api.MetricsBody();
            break;
        case Route::kVersion:
            a.body = R"({"version":")" KVSHARD_VERSION R"("})";
            break;
    }
    return a;
}

}  // namespace kvshard
