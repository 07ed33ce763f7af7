// What the HTTP sessions of one server share with it (HttpServerState: the post gate, the
// drain flag, the counts of connections and of generations in flight), and the answer to a
// connection beyond http.max_connections (RefuseConnection). HttpSession (http_session.h) is one
// connection; HttpServer (http_server.h) owns the state and accepts.
#pragma once

#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "coordinator/stream_sink.h"

namespace kvshard {

// What the sessions of one server share with it. Held by shared_ptr, since an engine callback
// may still hold it after the server is gone.
// Thread-safety: every member may be used from any thread.
class HttpServerState {
  public:
    PostGate gate;                            // closed before the server's io_context goes
    std::atomic<bool> draining{false};        // BeginDrain was called
    std::atomic<int64_t> num_connections{0};  // sessions alive
    std::atomic<int64_t> num_refusing{0};     // connections being answered 503 and closed
    std::string refusal;                      // the whole 503 answer to a connection too many

    // A generation request is being answered / its answer was written (or the client is gone).
    void GenerationStarted();
    void GenerationEnded();
    int64_t num_in_flight() const;
    // True once no generation is in flight; false when `timeout` passes first.
    bool WaitIdle(std::chrono::milliseconds timeout) const;

  private:
    mutable std::mutex mu_;
    mutable std::condition_variable idle_;
    int64_t in_flight_ = 0;  // guarded by mu_
};

// Answers a connection beyond http.max_connections with state->refusal (503, Retry-After) and
// closes it; at most a few dozen at a time, beyond which they are closed unanswered.
void RefuseConnection(boost::asio::ip::tcp::socket socket, std::shared_ptr<HttpServerState> state);

}  // namespace kvshard
