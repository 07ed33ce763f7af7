// HttpSession: one client connection of the HTTP server (Boost.Beast, HTTP/1.1, keep-alive).
//
// A session reads a request and routes it (http_routes.h). A tokenizer request (POST /tokenize,
// /detokenize, /v1/messages/count_tokens) is answered from the server's prepare pool. A generation
// request is parsed on the session's strand, prepared (chat template, tokenization, context check)
// on the server's prepare pool, and handed back to the strand, which submits it to the engine with
// a StreamSink; the session then waits for the sink's events and either streams them as server-sent
// events (chunked transfer encoding) or collects them into one JSON answer, through the
// ResponseWriter of the request's API (OpenAI or Anthropic; errors too are in that API's shape).
// While a request generates, the session watches the socket: a client that goes away (EOF, reset, a
// write that fails or stalls past the idle timeout, a stream backlog past 4 MiB) gets its request
// aborted at once, so the engine frees its blocks.
//
// Memory per connection is bounded: the read buffer (kHttpReadBufferBytes), the body
// (max_body_bytes), the unwritten stream bytes (4 MiB).
//
// Thread-safety: every handler runs on the session's strand (the executor of its socket); the
// cross-thread entries are the sink's wake-up and the prepare pool's result, which post to that
// strand through the PostGate.
#pragma once

#include <array>
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>

#include "config/server_config.h"
#include "coordinator/api_service.h"
#include "coordinator/http_routes.h"
#include "coordinator/http_server_state.h"
#include "coordinator/stream_sink.h"

namespace kvshard {

class HttpSession : public std::enable_shared_from_this<HttpSession> {
  public:
    // REQUIRES: `socket`'s executor is a strand. `api`, `config` and `prepare_pool` outlive
    // every handler of the session (the server joins its threads before they go).
    HttpSession(boost::asio::ip::tcp::socket socket, const ApiService& api,
                const HttpConfig& config, std::shared_ptr<HttpServerState> state,
                boost::asio::thread_pool& prepare_pool);
    // Aborts a request still generating.
    ~HttpSession();

    void Start();

  private:
    struct Generation;

    void DoRead();
    void OnHeader(boost::beast::error_code ec);
    void OnRead(boost::beast::error_code ec);
    void HandleRequest(HttpRequest request);
    void SendAnswer(HttpAnswer answer);
    void SendError(const ApiError& error, bool close = false);
    // Access-Control-Allow-Origin (and Vary, Expose-Headers) when the request's origin is allowed.
    template <typename Message>
    void SetCorsHeaders(Message& message) const;
    void OnResponseWritten(bool close, boost::beast::error_code ec);
    void Close();
    void DrainAndClose();  // reads and drops what the client still sends, then closes
    void DrainSome();

    // A parsed generation request (or the error of its parse): prepared with `prepare` on the
    // prepare pool, then submitted (OnPrepared).
    template <typename Request, typename PrepareFn>
    void StartGeneration(std::variant<Request, ApiError> parsed, PrepareFn prepare);
    // Runs `answer` (a tokenizer route) on the prepare pool and sends what it returns.
    template <typename AnswerFn>
    void StartPreparedAnswer(AnswerFn answer);
    void OnPrepared(std::variant<PreparedGeneration, ApiError> prepared);
    void OnSinkEvents();
    void OnPartFinished(size_t part, const GenerationUsage& usage, const Status& status);
    void AbortParts(bool detach);
    void OnGenerationFinished(const GenerationUsage& usage, const Status& status);
    void WatchForDisconnect();
    void OnClientGone();
    void OnTimeout();
    void QueueStreamBytes(const std::string& data);
    void WriteStream();
    void OnStreamWritten(boost::beast::error_code ec);
    void EndInFlight();

    boost::beast::tcp_stream stream_;
    boost::beast::flat_buffer buffer_{kHttpReadBufferBytes};
    std::optional<HttpRequestParser> parser_;
    const ApiService& api_;
    const HttpConfig& config_;
    std::shared_ptr<HttpServerState> state_;
    boost::asio::thread_pool::executor_type prepare_;
    boost::asio::steady_timer timeout_timer_;
    std::array<char, 4096> drain_buffer_;

    // The request being answered.
    unsigned version_ = 11;
    bool keep_alive_ = false;
    ErrorShape error_shape_ = ErrorShape::kOpenAi;
    std::string cors_origin_;    // Access-Control-Allow-Origin of the answer; "": none
    bool in_flight_ = false;     // counted in state_'s generations in flight
    Clock::time_point arrival_;  // of the request being answered, on the engine's clock
    std::unique_ptr<Generation> generation_;
    uint64_t generation_seq_ = 0;  // tells stale socket watches from the current one
};

}  // namespace kvshard
