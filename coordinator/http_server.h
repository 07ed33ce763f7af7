// HttpServer: the OpenAI-compatible HTTP front end. It listens on config.host:config.port and runs
// config.num_threads Boost.Asio threads; each connection is an HttpSession (http_session.h) that
// answers through the ApiService.
//
// Thread-safety: Start and Stop from one thread (the owner). Ownership: `api` (and what it refers
// to: engine, tokenizer, metrics) must outlive the server.
#pragma once

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

    // The bound port (the chosen one when config.port was 0).
    int port() const;

  private:
    struct Impl;
    explicit HttpServer(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvshard
