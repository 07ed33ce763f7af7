// HttpSession: one client connection of the HTTP server (Boost.Beast, HTTP/1.1, keep-alive).
//
// A session reads a request, routes it, and answers. A generation request is handed to the engine
// with a StreamSink; the session then waits for the sink's events on its strand and either streams
// them as server-sent events (chunked transfer encoding) or collects them into one JSON answer.
// While a request generates, the session watches the socket: a client that goes away (EOF, reset,
// a write that fails or stalls past the idle timeout) gets its request aborted at once, so the
// engine frees its blocks.
//
// Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
// GET /metrics. Unknown paths 404, wrong methods 405, bodies over the limit 413, malformed HTTP or
// JSON 400, a missing or wrong API key on /v1/* 401, a full engine queue 429.
//
// Thread-safety: every handler runs on the session's strand (the executor of its socket); the only
// cross-thread entry is the sink's wake-up, which posts to that strand through the PostGate.
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "config/server_config.h"
#include "coordinator/api_service.h"
#include "coordinator/stream_sink.h"

namespace kvshard {

class HttpSession : public std::enable_shared_from_this<HttpSession> {
  public:
    // REQUIRES: `socket`'s executor is a strand. `api` and `gate` outlive every handler.
    HttpSession(boost::asio::ip::tcp::socket socket, const ApiService& api,
                const HttpConfig& config, std::shared_ptr<PostGate> gate);
    // Aborts a request still generating.
    ~HttpSession();

    void Start();

  private:
    using Request = boost::beast::http::request<boost::beast::http::string_body>;
    struct Generation;

    void DoRead();
    void OnHeader(boost::beast::error_code ec);
    void OnRead(boost::beast::error_code ec);
    void Route(Request request);
    void SendResponse(unsigned status, const char* content_type, std::string body,
                      bool close = false, const char* allow = nullptr);
    void SendError(const ApiError& error, bool close = false, const char* allow = nullptr);
    void OnResponseWritten(bool close, boost::beast::error_code ec);
    void Close();
    void DrainAndClose();  // reads and drops what the client still sends, then closes
    void DrainSome();

    void StartGeneration(ApiEndpoint endpoint, const std::string& body);
    void OnSinkEvents();
    void OnGenerationFinished(const GenerationUsage& usage, const Status& status);
    void WatchForDisconnect();
    void OnClientGone();
    void OnTimeout();
    void QueueStreamBytes(const std::string& data);
    void WriteStream();
    void OnStreamWritten(boost::beast::error_code ec);

    boost::beast::tcp_stream stream_;
    boost::beast::flat_buffer buffer_;
    std::optional<boost::beast::http::request_parser<boost::beast::http::string_body>> parser_;
    const ApiService& api_;
    const HttpConfig& config_;
    std::shared_ptr<PostGate> gate_;
    boost::asio::steady_timer timeout_timer_;

    // The request being answered.
    unsigned version_ = 11;
    bool keep_alive_ = false;
    std::chrono::steady_clock::time_point arrival_;
    std::unique_ptr<Generation> generation_;
    uint64_t generation_seq_ = 0;  // tells stale socket watches from the current one
};

}  // namespace kvshard
