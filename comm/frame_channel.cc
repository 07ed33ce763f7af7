#include "comm/frame_channel.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <boost/asio.hpp>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "comm/tcp_listen.h"
#include "common/logging.h"

namespace kvshard {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using SteadyClock = std::chrono::steady_clock;

namespace {

std::string EndpointText(const tcp::endpoint& endpoint) {
    return endpoint.address().to_string() + ":" + std::to_string(endpoint.port());
}

}  // namespace

Status ValidateFrameChannelOptions(const FrameChannelOptions& o) {
    if (o.heartbeat_interval_ms <= 0) {
        return InvalidArgument("heartbeat_interval_ms=" + std::to_string(o.heartbeat_interval_ms) +
                               " must be > 0");
    }
    if (o.dead_after_ms < o.heartbeat_interval_ms) {
        return InvalidArgument(
            "dead_after_ms=" + std::to_string(o.dead_after_ms) +
            " must be >= heartbeat_interval_ms=" + std::to_string(o.heartbeat_interval_ms));
    }
    if (o.send_timeout_ms <= 0) {
        return InvalidArgument("send_timeout_ms=" + std::to_string(o.send_timeout_ms) +
                               " must be > 0");
    }
    if (o.max_queued_messages == 0) return InvalidArgument("max_queued_messages=0 must be > 0");
    return Status::Ok();
}

// All socket work happens on io_thread_; other threads talk to it through asio::post and the
// inbox. Members marked "io thread" are touched only there.
class FrameChannel::Impl final : public ClockListener {
  public:
    explicit Impl(const FrameChannelOptions& options)
        : options_(options),
          clock_(options.clock != nullptr ? *options.clock : Clock::Real()),
          socket_(io_),
          timer_(io_),
          work_(asio::make_work_guard(io_)) {}

    ~Impl() {
        clock_.RemoveListener(this);  // before the I/O thread stops: a move waits for it
        Close();
        work_.reset();
        io_.stop();
        if (io_thread_.joinable()) io_thread_.join();
    }

    asio::io_context& io() { return io_; }
    tcp::socket& socket() { return socket_; }

    // Takes over the connected socket_ and starts the I/O thread.
    void Start() {
        boost::system::error_code ec;
        socket_.set_option(tcp::no_delay(true), ec);  // small frames: latency over batching
        const tcp::endpoint remote = socket_.remote_endpoint(ec);
        peer_ = ec ? "unknown peer" : EndpointText(remote);
        last_rx_ = clock_.Now();
        next_beat_ = last_rx_ + Interval();
        io_.restart();
        StartRead();
        if (!clock_.is_virtual()) ArmTimer();
        io_thread_ = std::thread([this] { io_.run(); });
        if (clock_.is_virtual()) clock_.AddListener(this);
    }

    // A virtual clock moved (its driver's thread): the heartbeat due by `now`, if any, runs on
    // the I/O thread before this returns.
    void OnClockMoved(Clock::time_point now) override {
        auto done = std::make_shared<std::promise<void>>();
        std::future<void> beaten = done->get_future();
        asio::post(io_, [this, now, done] {
            if (closed_ok_io_ && now >= next_beat_) {
                next_beat_ = now + Interval();
                Beat();
            }
            done->set_value();
        });
        beaten.wait();
    }

    Status Send(const Message& message) {
        auto frame = std::make_shared<std::string>(EncodeFrame(message));
        const size_t payload_bytes = frame->size() - kFrameHeaderBytes;
        if (payload_bytes > options_.max_payload_bytes) {
            return Status(StatusCode::kResourceExhausted,
                          std::string(MessageTypeName(TypeOf(message))) + " of " +
                              std::to_string(payload_bytes) + " payload bytes exceeds the " +
                              "limit of " + std::to_string(options_.max_payload_bytes));
        }
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!closed_.ok()) return closed_;
        }
        auto done = std::make_shared<std::promise<Status>>();
        std::future<Status> result = done->get_future();
        asio::post(io_, [this, frame, done] {
            if (!closed_ok_io_) {
                done->set_value(status());
                return;
            }
            writes_.push_back({frame, done});
            if (!writing_) WriteNext();
        });
        const auto deadline =
            SteadyClock::now() + std::chrono::milliseconds(options_.send_timeout_ms);
        if (result.wait_until(deadline) == std::future_status::timeout) {
            const Status late(StatusCode::kDeadlineExceeded,
                              "send to " + peer_ + ": " + std::to_string(frame->size()) +
                                  " bytes not written within " +
                                  std::to_string(options_.send_timeout_ms) + " ms");
            CloseWith(late);
            return late;
        }
        return result.get();
    }

    Result<Message> Receive(SteadyClock::time_point deadline) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_until(lock, deadline, [&] { return !inbox_.empty() || !closed_.ok(); });
        if (!inbox_.empty()) {
            Message message = std::move(inbox_.front());
            inbox_.pop_front();
            return message;
        }
        if (!closed_.ok()) return closed_;
        return Status(StatusCode::kDeadlineExceeded, "no message from " + peer_ + " in time");
    }

    void Close() { CloseWith(Unavailable("channel to " + peer_ + " closed locally")); }

    // Runs Shutdown on the I/O thread and waits for it, so the channel is closed on return.
    void CloseWith(Status why) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!closed_.ok()) return;
        }
        if (!io_thread_.joinable()) {  // never started: nothing runs on io_
            SetClosed(why);
            return;
        }
        auto done = std::make_shared<std::promise<void>>();
        std::future<void> closed = done->get_future();
        asio::post(io_, [this, why, done] {
            Shutdown(why);
            done->set_value();
        });
        closed.wait();
    }

    Status status() const {
        std::lock_guard<std::mutex> lock(mu_);
        return closed_;
    }
    const std::string& peer() const { return peer_; }
    int64_t heartbeats_received() const { return heartbeats_received_.load(); }
    int64_t heartbeats_sent() const { return heartbeats_sent_.load(); }

  private:
    struct PendingWrite {
        std::shared_ptr<std::string> frame;
        std::shared_ptr<std::promise<Status>> done;  // nullptr for heartbeats
    };

    void SetClosed(const Status& why) {
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_.ok()) closed_ = why;
        cv_.notify_all();
    }

    // io thread. The first error wins; the socket closes, which ends the read and any write.
    void Shutdown(const Status& why) {
        if (!closed_ok_io_) return;
        closed_ok_io_ = false;
        SetClosed(why);
        const Status final_status = status();
        if (final_status.code() != StatusCode::kUnavailable ||
            final_status.message().find("closed locally") == std::string::npos) {
            spdlog::debug("frame channel to {} closed: {}", peer_, final_status.ToString());
        }
        boost::system::error_code ignored;
        socket_.shutdown(tcp::socket::shutdown_both, ignored);
        socket_.close(ignored);
        timer_.cancel();
        // Fail the waiting Sends now; the entries stay until the aborted write's handler ran,
        // since that write may still refer to the front frame.
        for (PendingWrite& write : writes_) {
            if (write.done != nullptr) {
                write.done->set_value(final_status);
                write.done = nullptr;
            }
        }
        if (!writing_) writes_.clear();
    }

    // ---- writing (io thread) ----

    void WriteNext() {
        if (writes_.empty() || !closed_ok_io_) {
            writing_ = false;
            if (!closed_ok_io_) writes_.clear();
            return;
        }
        writing_ = true;
        asio::async_write(
            socket_, asio::buffer(*writes_.front().frame),
            [this](const boost::system::error_code& ec, size_t) {
                writing_ = false;
                if (ec) {
                    Shutdown(Unavailable("send to " + peer_ + " failed: " + ec.message()));
                    writes_.clear();
                    return;
                }
                PendingWrite written = std::move(writes_.front());
                writes_.pop_front();
                if (written.done != nullptr) written.done->set_value(Status::Ok());
                WriteNext();
            });
    }

    // ---- reading (io thread) ----

    void StartRead() {
        asio::async_read(
            socket_, asio::buffer(header_),
            [this](const boost::system::error_code& ec, size_t n) { OnHeader(ec, n); });
    }

    Status ReadError(const boost::system::error_code& ec, size_t got, size_t wanted,
                     const char* part) {
        if (ec == asio::error::eof && got == 0 && part[0] == 'h') {
            return Unavailable("peer " + peer_ + " closed the connection");
        }
        if (ec == asio::error::eof) {
            return Unavailable("peer " + peer_ + " closed the connection mid-frame (" +
                               std::to_string(got) + " of " + std::to_string(wanted) + " " + part +
                               " bytes received)");
        }
        return Unavailable("receive from " + peer_ + " failed: " + ec.message());
    }

    void OnHeader(const boost::system::error_code& ec, size_t n) {
        if (ec) {
            Shutdown(ReadError(ec, n, kFrameHeaderBytes, "header"));
            return;
        }
        last_rx_ = clock_.Now();
        Result<FrameHeader> header = DecodeFrameHeader(
            std::string_view(header_.data(), header_.size()), options_.max_payload_bytes);
        if (!header.ok()) {
            Shutdown(header.status().WithContext("bad frame from " + peer_));
            return;
        }
        frame_header_ = *header;
        payload_.resize(frame_header_.payload_bytes);
        payload_read_ = 0;
        ReadPayload();
    }

    // Reads the payload piece by piece so that a large frame arriving slowly still counts as
    // signs of life.
    void ReadPayload() {
        if (payload_read_ == payload_.size()) {
            OnPayload();
            return;
        }
        socket_.async_read_some(
            asio::buffer(payload_.data() + payload_read_, payload_.size() - payload_read_),
            [this](const boost::system::error_code& ec, size_t n) {
                payload_read_ += n;
                if (ec) {
                    Shutdown(ReadError(ec, payload_read_, payload_.size(), "payload"));
                    return;
                }
                last_rx_ = clock_.Now();
                ReadPayload();
            });
    }

    void OnPayload() {
        Result<Message> message = DecodePayload(frame_header_, payload_);
        if (!message.ok()) {
            Shutdown(message.status().WithContext("bad frame from " + peer_));
            return;
        }
        if (std::holds_alternative<HeartbeatMessage>(*message)) {
            heartbeats_received_.fetch_add(1);
        } else {
            std::unique_lock<std::mutex> lock(mu_);
            if (inbox_.size() >= options_.max_queued_messages) {
                lock.unlock();
                Shutdown(Status(StatusCode::kResourceExhausted,
                                "peer " + peer_ + " sent more than " +
                                    std::to_string(options_.max_queued_messages) +
                                    " messages nobody received"));
                return;
            }
            inbox_.push_back(std::move(*message));
            cv_.notify_all();
        }
        std::string().swap(payload_);  // do not keep the largest frame's buffer forever
        StartRead();
    }

    // ---- heartbeats (io thread) ----

    Clock::duration Interval() const {
        return std::chrono::milliseconds(options_.heartbeat_interval_ms);
    }

    // On the real clock: a timer every heartbeat interval.
    void ArmTimer() {
        timer_.expires_after(Interval());
        timer_.async_wait([this](const boost::system::error_code& ec) {
            if (ec || !closed_ok_io_) return;
            if (Beat()) ArmTimer();
        });
    }

    // A heartbeat is due: a peer silent for more than dead_after_ms (on the clock) is dead;
    // otherwise one heartbeat goes out. False when the channel closed.
    bool Beat() {
        const auto silent_ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(clock_.Now() - last_rx_).count();
        if (silent_ms > options_.dead_after_ms) {
            Shutdown(Unavailable("peer " + peer_ + " sent nothing for " +
                                 std::to_string(silent_ms) + " ms (dead after " +
                                 std::to_string(options_.dead_after_ms) + " ms)"));
            return false;
        }
        // Heartbeats are not piled up behind a slow write; the write itself is news enough.
        if (writes_.size() < 2) {
            writes_.push_back({std::make_shared<std::string>(
                                   EncodeFrame(HeartbeatMessage{++heartbeat_sequence_})),
                               nullptr});
            heartbeats_sent_.fetch_add(1);
            if (!writing_) WriteNext();
        }
        return true;
    }

    const FrameChannelOptions options_;
    const Clock& clock_;  // heartbeats and the dead-peer check
    asio::io_context io_;
    tcp::socket socket_;
    asio::steady_timer timer_;
    asio::executor_work_guard<asio::io_context::executor_type> work_;
    std::thread io_thread_;
    std::string peer_ = "unconnected peer";

    // io thread only.
    bool closed_ok_io_ = true;
    std::array<char, kFrameHeaderBytes> header_{};
    FrameHeader frame_header_;
    std::string payload_;
    size_t payload_read_ = 0;
    std::deque<PendingWrite> writes_;
    bool writing_ = false;
    Clock::time_point last_rx_;    // on clock_
    Clock::time_point next_beat_;  // on clock_ (a virtual one; the timer's on the real one)
    uint64_t heartbeat_sequence_ = 0;

    mutable std::mutex mu_;
    std::condition_variable cv_;
    Status closed_;              // guarded by mu_
    std::deque<Message> inbox_;  // guarded by mu_
    std::atomic<int64_t> heartbeats_received_{0};
    std::atomic<int64_t> heartbeats_sent_{0};
};

FrameChannel::FrameChannel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FrameChannel::~FrameChannel() = default;
Status FrameChannel::Send(const Message& message) { return impl_->Send(message); }
Result<Message> FrameChannel::Receive(Clock::time_point deadline) {
    return impl_->Receive(deadline);
}
void FrameChannel::Close() { impl_->Close(); }
Status FrameChannel::status() const { return impl_->status(); }
const std::string& FrameChannel::peer() const { return impl_->peer(); }
int64_t FrameChannel::heartbeats_received() const { return impl_->heartbeats_received(); }
int64_t FrameChannel::heartbeats_sent() const { return impl_->heartbeats_sent(); }

// ---- listener ----

class FrameListener::Impl {
  public:
    Impl() : acceptor_(io_) {}

    Status Listen(const std::string& host, uint16_t port) {
        KV_RETURN_IF_ERROR(internal::ListenOn(acceptor_, host, port));
        boost::system::error_code ec;
        acceptor_.non_blocking(true, ec);
        if (ec) return Unavailable("listen on " + host + ": " + ec.message());
        port_ = acceptor_.local_endpoint(ec).port();
        return Status::Ok();
    }

    uint16_t port() const { return port_; }

    Result<std::unique_ptr<FrameChannel>> Accept(std::chrono::milliseconds timeout,
                                                 const FrameChannelOptions& options) {
        KV_RETURN_IF_ERROR(ValidateFrameChannelOptions(options));
        if (closed_.load())
            return Unavailable("listener on port " + std::to_string(port_) + " is closed");
        PendingAccept pending;
        WaitAndAccept(pending);
        io_.restart();
        io_.run_for(timeout);
        if (!pending.done) {
            pending.cancelled = true;
            boost::system::error_code ignored;
            acceptor_.cancel(ignored);
            io_.restart();
            io_.run();  // the cancelled wait's handler
        }
        if (closed_.load()) {
            if (pending.fd >= 0) ::close(pending.fd);
            return Unavailable("listener on port " + std::to_string(port_) + " is closed");
        }
        if (pending.fd < 0) {
            if (!pending.done || pending.result == asio::error::operation_aborted) {
                return Status(StatusCode::kDeadlineExceeded,
                              "no connection on port " + std::to_string(port_) + " within " +
                                  std::to_string(timeout.count()) + " ms");
            }
            // EMFILE and the like: the listener stays usable once descriptors are free again.
            return Status(
                StatusCode::kResourceExhausted,
                "accept on port " + std::to_string(port_) + ": " + pending.result.message());
        }
        auto channel = std::make_unique<FrameChannel::Impl>(options);
        boost::system::error_code ec;
        channel->socket().assign(acceptor_.local_endpoint(ec).protocol(), pending.fd, ec);
        if (ec) {
            ::close(pending.fd);
            return Internal("accept on port " + std::to_string(port_) + ": " + ec.message());
        }
        channel->Start();
        return std::make_unique<FrameChannel>(std::move(channel));
    }

    // From any thread: the close runs on io_ (inside a running Accept, or at the next one).
    void Close() {
        closed_.store(true);
        asio::post(io_, [this] {
            boost::system::error_code ignored;
            acceptor_.close(ignored);
        });
    }

  private:
    struct PendingAccept {
        bool done = false;
        bool cancelled = false;  // the caller gave up: do not wait again
        int fd = -1;
        boost::system::error_code result;
    };

    // accept4 with SOCK_CLOEXEC rather than asio's accept, which leaves the new socket
    // inheritable: a worker spawned while this connection is open must not hold it (the peer
    // would not see it close when this process closes it). The acceptor is non-blocking, so a
    // connection reset between the wake-up and accept4 only means waiting again.
    void WaitAndAccept(PendingAccept& pending) {
        acceptor_.async_wait(
            tcp::acceptor::wait_read, [this, &pending](const boost::system::error_code& ec) {
                if (ec) {
                    pending.done = true;
                    pending.result = ec;
                    return;
                }
                const int fd = ::accept4(acceptor_.native_handle(), nullptr, nullptr, SOCK_CLOEXEC);
                if (fd >= 0) {
                    pending.done = true;
                    pending.fd = fd;
                    return;
                }
                const int err = errno;
                if ((err == EAGAIN || err == EWOULDBLOCK || err == ECONNABORTED || err == EINTR) &&
                    !pending.cancelled) {
                    WaitAndAccept(pending);
                    return;
                }
                pending.done = true;
                pending.result =
                    err == EAGAIN || err == EWOULDBLOCK
                        ? asio::error::operation_aborted
                        : boost::system::error_code(err, boost::system::system_category());
            });
    }

    asio::io_context io_;
    tcp::acceptor acceptor_;
    uint16_t port_ = 0;
    std::atomic<bool> closed_{false};
};

FrameListener::FrameListener(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FrameListener::~FrameListener() = default;

Result<std::unique_ptr<FrameListener>> FrameListener::Listen(const std::string& host,
                                                             uint16_t port) {
    auto impl = std::make_unique<Impl>();
    KV_RETURN_IF_ERROR(impl->Listen(host, port));
    return std::unique_ptr<FrameListener>(new FrameListener(std::move(impl)));
}

uint16_t FrameListener::port() const { return impl_->port(); }

Result<std::unique_ptr<FrameChannel>> FrameListener::Accept(std::chrono::milliseconds timeout,
                                                            const FrameChannelOptions& options) {
    return impl_->Accept(timeout, options);
}

void FrameListener::Close() { impl_->Close(); }

// ---- connecting ----

Result<std::unique_ptr<FrameChannel>> ConnectFrameChannel(const std::string& host, uint16_t port,
                                                          std::chrono::milliseconds timeout,
                                                          const FrameChannelOptions& options) {
    KV_RETURN_IF_ERROR(ValidateFrameChannelOptions(options));
    auto channel = std::make_unique<FrameChannel::Impl>(options);
    const std::string target = host + ":" + std::to_string(port);
    // The channel's I/O thread has not started; its io_context runs here until connected.
    tcp::resolver resolver(channel->io());
    bool done = false;
    bool timed_out = false;
    boost::system::error_code result;
    resolver.async_resolve(
        host, std::to_string(port),
        [&](const boost::system::error_code& ec, const tcp::resolver::results_type& endpoints) {
            if (ec || timed_out) {
                done = true;
                result = ec ? ec : asio::error::operation_aborted;
                return;
            }
            asio::async_connect(
                channel->socket(), endpoints,
                [&](const boost::system::error_code& connect_ec, const tcp::endpoint&) {
                    done = true;
                    result = connect_ec;
                });
        });
    // The channel's work guard keeps its io_context from running out of work, so run handlers
    // one at a time until the connect completed or the deadline passed.
    const auto deadline = SteadyClock::now() + timeout;
    while (!done && SteadyClock::now() < deadline) {
        channel->io().run_one_until(deadline);
    }
    if (!done) {
        timed_out = true;
        resolver.cancel();
        boost::system::error_code ignored;
        channel->socket().close(ignored);
        while (!done) channel->io().run_one();
        return Status(StatusCode::kDeadlineExceeded, "connect to " + target +
                                                         ": no answer within " +
                                                         std::to_string(timeout.count()) + " ms");
    }
    if (result) return Unavailable("connect to " + target + ": " + result.message());
    // Not inherited by processes this one spawns (see FrameListener's accept).
    ::fcntl(channel->socket().native_handle(), F_SETFD, FD_CLOEXEC);
    channel->Start();
    return std::make_unique<FrameChannel>(std::move(channel));
}

}  // namespace kvshard
