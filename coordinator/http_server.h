// HttpServer: the OpenAI-compatible HTTP front end. It listens on config.host:config.port and runs
// config.num_threads Boost.Asio threads; each connection is an HttpSession (http_session.h) that
// answers through the ApiService. A pool of its own (as many threads as config.num_threads)
// prepares generation requests (chat template, tokenization), so the I/O threads never tokenize.
//
// Hostile peers: at most config.max_connections connections are open; one more is answered 503
// with Retry-After and closed. When accept fails (out of file descriptors: EMFILE/ENFILE) the
// server stops accepting for 100 ms at a time, logging once per run of failures, and accepts
// again once descriptors are free.
//
// Shutdown (SIGTERM in `kvshard serve`): BeginDrain, then WaitIdle(drain timeout), then stop the
// engine (which ends what is left with an error), WaitIdle briefly so those error answers are
// written, then Stop.
//
// Thread-safety: Start and Stop from one thread (the owner); BeginDrain, num_in_flight,
// num_connections and WaitIdle from any thread. Ownership: `api` (and what it refers to: engine,
// tokenizer, metrics) must outlive the server.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "config/server_config.h"
#include "coordinator/api_service.h"

namespace kvshard {

class HttpServer {
  public:
    // Binds and starts serving. Unavailable when the address cannot be bound.
    static Result<std::unique_ptr<HttpServer>> Start(const HttpConfig& config,
                                                     const ApiService& api);
    // Stops accepting, ends every connection (aborting their requests) and joins the threads.
    ~HttpServer();
    void Stop();

    // From now on new generation requests get 503 ("the server is shutting down", Retry-After),
    // GET /health answers 503 {"status":"draining"}, and answers close their connection.
    // Requests already in flight go on.
    void BeginDrain();
    // Generation requests whose answer is not yet fully written (parsing, tokenizing, queued,
    // generating, or writing the last bytes: a failed stream's error event and "data: [DONE]").
    int64_t num_in_flight() const;
    // True once num_in_flight() is 0; false when `timeout` passes first.
    bool WaitIdle(std::chrono::milliseconds timeout) const;
    // Open client connections (not counting the ones being refused).
    int64_t num_connections() const;
    // Accepts that failed (e.g. out of file descriptors), since Start.
    int64_t num_accept_failures() const;

    // The bound port (the chosen one when config.port was 0).
    int port() const;

  private:
    struct Impl;
    explicit HttpServer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvshard
