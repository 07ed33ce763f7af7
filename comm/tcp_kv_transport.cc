// TcpKvTransport: worker processes. One listening port per transport, served by one I/O thread
// (Boost.Asio) whose connections (comm/tcp_kv_session.h) read piece frames, stage them and answer
// each with an acknowledgement; senders (comm/tcp_kv_sender.h) keep one connection per
// destination and wait for the acknowledgement, so Send's status is the receiver's verdict
// (staged, refused as full, discarded) or a transport error. Frame layout: comm/tcp_kv_wire.h and
// docs/comm.md. Between processes of one host the payloads go through a shared-memory region per
// connection (comm/shm_region.h), a ring of slots the sender fills while the receiver copies the
// previous ones out; the socket then carries only headers, chunk frames and credits.
// This file: the transport itself, its listening side (accept, the sessions, the staging) and the
// factory; the send path lives in tcp_kv_sender.cc.
// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on

#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/kv_staging.h"
#include "comm/kv_transport.h"
#include "comm/tcp_kv_sender.h"
#include "comm/tcp_kv_session.h"
#include "comm/tcp_listen.h"
#include "common/logging.h"

namespace kvshard {

namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using internal::KvStaging;

// After a failed accept (e.g. out of file descriptors), wait this long before the next, rather
// than spinning on the error.
constexpr int64_t kAcceptRetryMs = 100;

class TcpKvTransport final : public KvTransport, private ClockListener {
  public:
    explicit TcpKvTransport(const KvTransportOptions& options)
        : options_(options),
          clock_(options.clock != nullptr ? *options.clock : kvshard::Clock::Real()),
          acceptor_(io_),
          work_(asio::make_work_guard(io_)),
          accept_retry_(io_) {}

    ~TcpKvTransport() override {
        clock_.RemoveListener(this);  // before the I/O thread stops: a move waits for it
        if (io_thread_.joinable()) {
            asio::post(io_, [this] {
                boost::system::error_code ignored;
                acceptor_.close(ignored);
                accept_retry_.cancel();
                internal::CloseTcpKvSessions(sessions_);
            });
            work_.reset();
            io_thread_.join();  // returns once the aborted handlers have run
        }
        sessions_.clear();
        if (staging_ != nullptr) staging_->Close();
    }

    Status Listen(const std::string& host, uint16_t port) {
        Status listening = internal::ListenOn(acceptor_, host, port);
        if (!listening.ok()) return Unavailable("KV transport: " + listening.message());
        boost::system::error_code ec;
        endpoint_ = host + ":" + std::to_string(acceptor_.local_endpoint(ec).port());
        staging_ = std::make_unique<KvStaging>(options_, endpoint_);
        sender_ = std::make_unique<internal::TcpKvSender>(options_, endpoint_);
        Accept();
        io_thread_ = std::thread([this] { io_.run(); });
        if (clock_.is_virtual()) clock_.AddListener(this);
        return Status::Ok();
    }

    // A virtual clock moved (its driver's thread): the connections whose deadline it passed are
    // closed, on the I/O thread, before this returns.
    void OnClockMoved(kvshard::Clock::time_point now) override {
        std::promise<void> done;
        std::future<void> expired = done.get_future();
        asio::post(io_, [this, now, &done] {
            internal::ExpireTcpKvSessions(sessions_, now);
            done.set_value();
        });
        expired.wait();
    }

    const std::string& endpoint() const override { return endpoint_; }

    Status Send(const std::string& dst_endpoint, const KvPiece& piece,
                Clock::time_point deadline) override {
        return sender_->Send(dst_endpoint, piece, deadline);
    }

    Status SendPipelined(const std::string& dst_endpoint, const KvPiece& piece,
                         Clock::time_point deadline) override {
        return sender_->SendPipelined(dst_endpoint, piece, deadline);
    }

    Status Flush(const std::string& dst_endpoint, uint64_t transfer_id,
                 Clock::time_point deadline) override {
        return sender_->Flush(dst_endpoint, transfer_id, deadline);
    }

    Result<std::vector<KvPiece>> Receive(uint64_t transfer_id, int64_t expected_cells,
                                         Clock::time_point deadline) override {
        return staging_->Receive(transfer_id, expected_cells, deadline);
    }

    void Discard(uint64_t transfer_id) override { staging_->Discard(transfer_id); }

    void Recycle(std::vector<KvPiece> pieces) override { staging_->Recycle(std::move(pieces)); }

    int64_t staged_bytes() const override { return staging_->staged_bytes(); }

    int64_t arriving_bytes() const override { return staging_->arriving_bytes(); }

    Status SetReceiveGeometry(const KvReceiveGeometry& geometry) override {
        return staging_->SetGeometry(geometry);
    }

  private:
    // I/O thread.
    void Accept() {
        acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
            if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
            if (ec) {
                // Out of descriptors, say: not again at once (that would spin and flood the log).
                spdlog::warn("KV transport {}: accept failed: {}; retrying in {} ms", endpoint_,
                             ec.message(), kAcceptRetryMs);
                accept_retry_.expires_after(std::chrono::milliseconds(kAcceptRetryMs));
                accept_retry_.async_wait([this](const boost::system::error_code& wait_ec) {
                    if (!wait_ec && acceptor_.is_open()) Accept();
                });
                return;
            }
            if (static_cast<int64_t>(sessions_.size()) >= options_.max_connections) {
                // Logged for the first refusal and then every 1,000th, so a flood cannot fill
                // the log.
                if (refused_connections_++ % 1'000 == 0) {
                    spdlog::warn(
                        "KV transport {}: {} connections open (max_connections); "
                        "closing new ones ({} so far)",
                        endpoint_, sessions_.size(), refused_connections_);
                }
                boost::system::error_code ignored;
                socket.close(ignored);
            } else {
                internal::StartTcpKvSession(std::move(socket), staging_.get(), &options_,
                                            &sessions_);
            }
            Accept();
        });
    }

    const KvTransportOptions options_;
    const kvshard::Clock& clock_;  // the sessions' deadlines (options_.clock)
    asio::io_context io_;
    tcp::acceptor acceptor_;
    asio::executor_work_guard<asio::io_context::executor_type> work_;
    std::thread io_thread_;
    std::string endpoint_;
    std::unique_ptr<KvStaging> staging_;
    asio::steady_timer accept_retry_;                // I/O thread only
    internal::TcpKvSessions sessions_;               // I/O thread only (and the destructor)
    uint64_t refused_connections_ = 0;               // I/O thread only: over max_connections
    std::unique_ptr<internal::TcpKvSender> sender_;  // made by Listen
};

}  // namespace

Result<std::unique_ptr<KvTransport>> MakeTcpKvTransport(const std::string& host, uint16_t port,
                                                        const KvTransportOptions& options) {
    KV_RETURN_IF_ERROR(internal::ValidateKvTransportOptions(options));
    auto transport = std::make_unique<TcpKvTransport>(options);
    KV_RETURN_IF_ERROR(transport->Listen(host, port));
    return std::unique_ptr<KvTransport>(std::move(transport));
}

}  // namespace kvshard
