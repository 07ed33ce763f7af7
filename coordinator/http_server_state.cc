#include "coordinator/http_server_state.h"

#include <array>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>

namespace kvshard {

namespace beast = boost::beast;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

// Connections being refused at once beyond which the next ones are closed unanswered.
constexpr int64_t kMaxRefusing = 64;
constexpr auto kRefusalTime = std::chrono::seconds(1);

}  // namespace

void HttpServerState::GenerationStarted() {
    std::lock_guard<std::mutex> lock(mu_);
    ++in_flight_;
}

void HttpServerState::GenerationEnded() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--in_flight_ == 0) idle_.notify_all();
}

int64_t HttpServerState::num_in_flight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_;
}

bool HttpServerState::WaitIdle(std::chrono::milliseconds timeout) const {
    std::unique_lock<std::mutex> lock(mu_);
    return idle_.wait_for(lock, timeout, [this] { return in_flight_ == 0; });
}

namespace {

// A connection beyond the limit: the 503, then a short drain so that the answer is not lost to
// a reset, then close.
class Refusal : public std::enable_shared_from_this<Refusal> {
  public:
    Refusal(tcp::socket socket, std::shared_ptr<HttpServerState> state)
        : stream_(std::move(socket)), state_(std::move(state)) {}
    ~Refusal() { state_->num_refusing.fetch_sub(1); }

    void Start() {
        stream_.expires_after(kRefusalTime);
        net::async_write(stream_, net::buffer(state_->refusal),
                         [self = shared_from_this()](beast::error_code ec, size_t) {
                             if (ec) return;
                             beast::error_code ignored;
                             self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
                             self->Drain();
                         });
    }

  private:
    void Drain() {
        stream_.async_read_some(net::buffer(buffer_),
                                [self = shared_from_this()](beast::error_code ec, size_t) {
                                    if (!ec) self->Drain();
                                });
    }

    beast::tcp_stream stream_;
    std::shared_ptr<HttpServerState> state_;
    std::array<char, 1024> buffer_;
};

}  // namespace

void RefuseConnection(tcp::socket socket, std::shared_ptr<HttpServerState> state) {
    if (state->num_refusing.fetch_add(1) >= kMaxRefusing) {
        state->num_refusing.fetch_sub(1);
        beast::error_code ec;
        socket.close(ec);
        return;
    }
    std::make_shared<Refusal>(std::move(socket), std::move(state))->Start();
}

}  // namespace kvshard
