// The HTTP layer's decisions, without the socket: the limits every request is parsed with, the
// headers refused before a body is read, the answer to a read that failed, and the routing of a
// whole request (paths, methods, API keys, draining, the GET endpoints). HttpSession
// (http_session.h) does the I/O around these; coordinator/fuzz/http_fuzz.cc feeds them raw bytes.
//
// Routes: POST /v1/completions, POST /v1/chat/completions, POST /tokenize, POST /detokenize
// (vLLM's), POST /v1/messages and POST /v1/messages/count_tokens (Anthropic's: their errors are
// in Anthropic's shape, and they take the API key as x-api-key as well), GET (and HEAD) /v1/models,
// /v1/models/{id}, /health, /metrics, /version. Unknown paths 404, wrong methods 405 with Allow,
// bodies over the limit 413, a header block over 16 KiB 431, malformed HTTP 400, a transfer coding
// other than chunked 501, a missing or wrong API key on /v1/*, /tokenize and /detokenize 401 with
// WWW-Authenticate, every POST while draining 503 with Retry-After.
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
#include <variant>

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

// A whole request: answered at once, or the endpoint whose body goes to ApiService (a generation,
// or a tokenizer route: both cost CPU in proportion to the body, so the session runs them on
// its prepare pool).
using RouteResult = std::variant<HttpAnswer, ApiEndpoint, TokenizerEndpoint, AnthropicEndpoint>;
RouteResult RouteRequest(const HttpRequest& request, const ApiService& api, bool draining);

}  // namespace kvshard
