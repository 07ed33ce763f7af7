// The HTTP layer's decisions, without the socket: the limits every request is parsed with, the
// headers refused before a body is read, the answer to a read that failed, and the routing of a
// whole request (paths, methods, API keys, draining, the GET endpoints). HttpSession
// (http_session.h) does the I/O around these; coordinator/fuzz/http_fuzz.cc feeds them raw bytes.
//
// Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, POST /tokenize, POST
// /detokenize (vLLM's), POST /v1/messages and POST /v1/messages/count_tokens (Anthropic's: their
// errors are in Anthropic's shape, and they take the API key as x-api-key as well), GET (and HEAD)
// /v1/models, /v1/models/{id}, /v1/models/{id}/tokenizer and /v1/models/{id}/tokenizer_config (the
// Hugging Face tokenizer files), /health, /metrics, /version. Unknown paths 404, wrong methods 405
// with Allow, bodies over the limit 413, a header block over 16 KiB 431, malformed HTTP 400, a
// transfer coding other than chunked 501, a missing or wrong API key on /v1/*, /tokenize and
// /detokenize 401 with WWW-Authenticate, every POST while draining 503 with Retry-After. With CORS
// on (server.cors_allowed_origins), OPTIONS preflights on any path.
//
// Thread-safety: free functions over their arguments; RouteRequest calls only const ApiService
// methods.
#pragma once

#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "config/server_config.h"
#include "coordinator/api_service.h"
#include "coordinator/openai_protocol.h"

namespace kvshard {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpRequestParser = boost::beast::http::request_parser<boost::beast::http::string_body>;

// The request line and header fields together, at most.
constexpr size_t kHttpHeaderLimitBytes = 16 * 1024;
// A session's read buffer: the header, and one read's worth (64 KiB) of body or pipelined bytes.
constexpr size_t kHttpReadBufferBytes = kHttpHeaderLimitBytes + 64 * 1024;

// An answer written at once.
struct HttpAnswer {
    unsigned status = 200;
    std::string content_type = "application/json";
    std::string body;
    std::string allow;              // the Allow header of a 405
    int retry_after_s = 0;          // > 0: Retry-After
    bool www_authenticate = false;  // WWW-Authenticate: Bearer (401)
    bool close = false;             // close the connection once written
    bool head = false;              // a HEAD request: the GET answer's headers, no body
    // More header fields (a CORS preflight's Access-Control-Allow-*).
    std::vector<std::pair<std::string, std::string>> headers;
};

// Which API's error body a route answers with.
enum class ErrorShape { kOpenAi, kAnthropic };
// The Anthropic routes (and any path under /v1/messages) answer in Anthropic's shape.
ErrorShape ErrorShapeFor(std::string_view target);

// The error body for `error` in `shape`, with its Retry-After.
HttpAnswer ErrorAnswer(const ApiError& error, bool close = false,
                       ErrorShape shape = ErrorShape::kOpenAi);

// The body and header limits every request is read with.
void ConfigureRequestParser(HttpRequestParser& parser, const HttpConfig& config);

// REQUIRES: the parser has read the header. An answer when the request must be refused before
// its body is read: a transfer coding other than chunked ("gzip, chunked") is 501, since the
// server would otherwise take the still-encoded bytes as the body.
std::optional<HttpAnswer> CheckRequestHeader(const HttpRequest& header);

// A read that failed with `ec`: the answer to send before closing (413, 431, 400 in kvshard's
// words), or nullopt when the connection is simply closed (EOF, timeout, reset).
std::optional<HttpAnswer> AnswerReadError(boost::beast::error_code ec, const HttpConfig& config);

// CORS for browser clients (server.cors_allowed_origins; empty: off). The value of
// Access-Control-Allow-Origin for `request`: "*" when every origin is allowed, the request's
// Origin when it is one of the list, else "" (no CORS headers at all: the browser refuses to
// show the answer to the page).
std::string CorsAllowOrigin(const HttpRequest& request, const HttpConfig& config);
// An OPTIONS request with Origin and Access-Control-Request-Method while CORS is on: 204 with
// the allowed methods, the requested headers and a max age for an allowed origin; 400 without
// CORS headers for another. nullopt for any other request (OPTIONS with CORS off stays a 405).
// Preflights carry no credentials, so they need no API key.
std::optional<HttpAnswer> CorsPreflight(const HttpRequest& request, const HttpConfig& config);

// A whole request: answered at once, or the endpoint whose body goes to ApiService (a generation,
// or a tokenizer route: both cost CPU in proportion to the body, so the session runs them on
// its prepare pool).
using RouteResult =
    std::variant<HttpAnswer, ApiEndpoint, TokenizerEndpoint, AnthropicEndpoint, ResponsesEndpoint>;
RouteResult RouteRequest(const HttpRequest& request, const ApiService& api, bool draining);

}  // namespace kvshard
