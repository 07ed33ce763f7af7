// TcpKvTransport: worker processes. One listening port per transport, served by one I/O thread
// (Boost.Asio) that reads piece frames, stages them and answers each with an acknowledgement;
// senders keep one connection per destination and wait for the acknowledgement, so Send's
// status is the receiver's verdict (staged, refused as full, discarded) or a transport error.
// Frame layout: comm/tcp_kv_wire.h and docs/comm.md.
// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on
#include <array>
#include <charconv>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "comm/kv_staging.h"
#include "comm/kv_transport.h"
#include "comm/tcp_kv_wire.h"
#include "comm/tcp_listen.h"
#include "common/logging.h"

namespace kvshard {

namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using internal::KvStaging;

// Refused payloads are read off the socket in chunks of this size (never allocated whole).
constexpr size_t kDrainChunkBytes = 64 * 1024;

struct HostPort {
    std::string host;
    std::string port;
};

// "HOST:PORT" (also "[v6]:PORT" and "::1:PORT": the port follows the last colon).
Result<HostPort> ParseEndpoint(const std::string& endpoint) {
    const size_t colon = endpoint.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == endpoint.size()) {
        return InvalidArgument("KV endpoint '" + endpoint + "' is not HOST:PORT");
    }
    std::string host = endpoint.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
    }
    const std::string port_text = endpoint.substr(colon + 1);
    unsigned port = 0;
    const auto [end, ec] =
        std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (ec != std::errc() || end != port_text.data() + port_text.size() || port == 0 ||
        port > 65535) {
        return InvalidArgument("KV endpoint '" + endpoint + "': bad port '" + port_text + "'");
    }
    return HostPort{host, port_text};
}

// Runs `io` on the calling thread until `done` or `deadline`. On the deadline calls `cancel`
// (which must make the pending operations complete) and runs their handlers. Returns whether
// `done` came first.
template <typename Cancel>
bool RunUntil(asio::io_context& io, const bool& done, Clock::time_point deadline, Cancel cancel) {
    io.restart();
    while (!done && Clock::now() < deadline) {
        if (io.run_one_until(deadline) == 0 && io.stopped()) break;
    }
    if (done) return true;
    cancel();
    io.restart();
    while (!done && io.run_one() != 0) {
    }
    return false;
}

class TcpKvTransport;

// One accepted connection, on the I/O thread. Reads piece frames one after another; each is
// answered before the next is read, since the sender waits for the answer.
class Session : public std::enable_shared_from_this<Session> {
  public:
    Session(tcp::socket socket, KvStaging* staging, std::set<std::shared_ptr<Session>>* live)
        : socket_(std::move(socket)), staging_(staging), live_(live) {
        boost::system::error_code ec;
        const tcp::endpoint remote = socket_.remote_endpoint(ec);
        peer_ = ec ? "unknown peer"
                   : remote.address().to_string() + ":" + std::to_string(remote.port());
        socket_.set_option(tcp::no_delay(true), ec);
    }

    void Start() { ReadHeader(); }

    // I/O thread: ends the connection (pending reads complete with operation_aborted).
    void Close() {
        boost::system::error_code ignored;
        socket_.close(ignored);
    }

  private:
    void ReadHeader() {
        asio::async_read(socket_, asio::buffer(header_),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) {
                                 // Closed between frames: the sender is done with us.
                                 self->End(ec == asio::error::eof ? "" : ec.message());
                                 return;
                             }
                             self->OnHeader();
                         });
    }

    void OnHeader() {
        Result<internal::DecodedKvPieceFrame> frame = internal::DecodeKvPieceFrameHeader(header_);
        if (!frame.ok()) {
            End("malformed KV frame: " + frame.status().ToString());
            return;
        }
        frame_ = *frame;
        const int64_t bytes = static_cast<int64_t>(frame_.payload_bytes);
        Status admitted = staging_->Reserve(frame_.header.transfer_id, bytes);
        if (!admitted.ok()) {
            // The stream stays in step: read the payload off without keeping it, then refuse.
            refusal_ = std::move(admitted);
            drain_left_ = frame_.payload_bytes;
            scratch_.resize(std::min<uint64_t>(drain_left_, kDrainChunkBytes));
            Drain();
            return;
        }
        reserved_bytes_ = bytes;
        piece_.header = frame_.header;
        piece_.data.resize(static_cast<size_t>(bytes));
        asio::async_read(
            socket_, asio::buffer(piece_.data),
            [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
                if (ec) {
                    self->End("closed mid-frame after " + std::to_string(n) +
                              " payload bytes: " + ec.message());
                    return;
                }
                self->OnPayload();
            });
    }

    void OnPayload() {
        if (internal::KvPayloadCrc(piece_.data) != frame_.payload_crc) {
            End("malformed KV frame: payload CRC mismatch (transfer " +
                std::to_string(frame_.header.transfer_id) + ")");
            return;
        }
        reserved_bytes_ = 0;  // Commit takes the reservation over, whatever it answers
        Status staged = staging_->Commit(std::move(piece_));
        piece_ = KvPiece();
        Acknowledge(staged);
    }

    void Drain() {
        if (drain_left_ == 0) {
            std::vector<uint8_t>().swap(scratch_);
            Acknowledge(refusal_);
            return;
        }
        const size_t chunk = static_cast<size_t>(std::min<uint64_t>(drain_left_, scratch_.size()));
        socket_.async_read_some(
            asio::buffer(scratch_.data(), chunk),
            [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
                if (ec) {
                    self->End("closed while a refused payload was read: " + ec.message());
                    return;
                }
                self->drain_left_ -= n;
                self->Drain();
            });
    }

    void Acknowledge(const Status& status) {
        ack_ = internal::EncodeKvAckFrame(frame_.header.transfer_id, status);
        asio::async_write(socket_, asio::buffer(ack_),
                          [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                              if (ec) {
                                  self->End("acknowledgement not written: " + ec.message());
                                  return;
                              }
                              self->ReadHeader();
                          });
    }

    // The connection is over: gives back a reservation, closes, and leaves the live set.
    void End(const std::string& why) {
        if (reserved_bytes_ != 0) {
            staging_->Unreserve(reserved_bytes_);
            reserved_bytes_ = 0;
        }
        if (!why.empty() && socket_.is_open()) {
            spdlog::warn("KV transport: connection from {} closed: {}", peer_, why);
        }
        Close();
        live_->erase(shared_from_this());
    }

    tcp::socket socket_;
    KvStaging* const staging_;
    std::set<std::shared_ptr<Session>>* const live_;  // the transport's, I/O thread only
    std::string peer_;
    internal::KvPieceFrameHeader header_{};
    internal::DecodedKvPieceFrame frame_;
    KvPiece piece_;
    int64_t reserved_bytes_ = 0;
    Status refusal_;
    uint64_t drain_left_ = 0;
    std::vector<uint8_t> scratch_;
    std::string ack_;
};

// A destination's cached connection. Its io_context runs only on the thread holding `mu`, inside
// Send, so a deadline is just how long that thread runs it.
struct Peer {
    explicit Peer(HostPort address) : address(std::move(address)) {}
    std::mutex mu;
    const HostPort address;
    asio::io_context io;
    tcp::socket socket{io};
};

class TcpKvTransport final : public KvTransport {
  public:
    explicit TcpKvTransport(const KvTransportOptions& options)
        : options_(options), acceptor_(io_), work_(asio::make_work_guard(io_)) {}

    ~TcpKvTransport() override {
        if (io_thread_.joinable()) {
            asio::post(io_, [this] {
                boost::system::error_code ignored;
                acceptor_.close(ignored);
                for (const std::shared_ptr<Session>& session : sessions_) session->Close();
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
        Accept();
        io_thread_ = std::thread([this] { io_.run(); });
        return Status::Ok();
    }

    const std::string& endpoint() const override { return endpoint_; }

    Status Send(const std::string& dst_endpoint, const KvPiece& piece,
                Clock::time_point deadline) override {
        KV_RETURN_IF_ERROR(ValidateKvPiece(piece));
        KV_ASSIGN_OR_RETURN(HostPort address, ParseEndpoint(dst_endpoint));
        if (Clock::now() >= deadline) {
            return Status(StatusCode::kDeadlineExceeded,
                          "KV send to " + dst_endpoint + ": deadline passed before it began");
        }
        std::shared_ptr<Peer> peer = FindPeer(dst_endpoint, std::move(address));
        const internal::KvPieceFrameHeader header = internal::EncodeKvPieceFrameHeader(
            piece.header, piece.data.size(), internal::KvPayloadCrc(piece.data));
        std::lock_guard<std::mutex> lock(peer->mu);
        bool reused = peer->socket.is_open();
        if (reused && LooksClosed(*peer)) {
            CloseSocket(*peer);
            reused = false;
        }
        Attempt attempt = SendOnce(*peer, dst_endpoint, header, piece, deadline);
        if (attempt.connection_failed && reused) {
            // The cached connection died while idle (e.g. the receiver restarted): one fresh
            // try. A resend of a piece that was staged after all is dropped as a duplicate.
            attempt = SendOnce(*peer, dst_endpoint, header, piece, deadline);
        }
        return attempt.status;
    }

    Result<std::vector<KvPiece>> Receive(uint64_t transfer_id, int64_t expected_cells,
                                         Clock::time_point deadline) override {
        return staging_->Receive(transfer_id, expected_cells, deadline);
    }

    void Discard(uint64_t transfer_id) override { staging_->Discard(transfer_id); }

    int64_t staged_bytes() const override { return staging_->staged_bytes(); }

  private:
    struct Attempt {
        Status status;
        bool connection_failed = false;  // an I/O error, not a verdict or a deadline
    };

    // I/O thread.
    void Accept() {
        acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
            if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
            if (!ec) {
                auto session =
                    std::make_shared<Session>(std::move(socket), staging_.get(), &sessions_);
                sessions_.insert(session);
                session->Start();
            } else {
                spdlog::warn("KV transport {}: accept failed: {}", endpoint_, ec.message());
            }
            Accept();
        });
    }

    std::shared_ptr<Peer> FindPeer(const std::string& endpoint, HostPort address) {
        std::lock_guard<std::mutex> lock(peers_mu_);
        std::shared_ptr<Peer>& peer = peers_[endpoint];
        if (peer == nullptr) peer = std::make_shared<Peer>(std::move(address));
        return peer;
    }

    static void CloseSocket(Peer& peer) {
        boost::system::error_code ignored;
        peer.socket.shutdown(tcp::socket::shutdown_both, ignored);
        peer.socket.close(ignored);
    }

    // An idle cached connection has nothing to read; EOF or an error means the receiver closed
    // it, and bytes would be a protocol error. Either way it is not usable.
    static bool LooksClosed(Peer& peer) {
        boost::system::error_code ec;
        std::array<uint8_t, 1> byte{};
        peer.socket.non_blocking(true, ec);
        if (ec) return true;
        const size_t n = peer.socket.receive(asio::buffer(byte), tcp::socket::message_peek, ec);
        peer.socket.non_blocking(false, ec);
        return ec != asio::error::would_block || n != 0;
    }

    Status Connect(Peer& peer, const std::string& dst, Clock::time_point deadline) {
        tcp::resolver resolver(peer.io);
        bool done = false;
        boost::system::error_code result;
        resolver.async_resolve(
            peer.address.host, peer.address.port,
            [&](const boost::system::error_code& ec, const tcp::resolver::results_type& found) {
                if (ec) {
                    done = true;
                    result = ec;
                    return;
                }
                asio::async_connect(
                    peer.socket, found,
                    [&](const boost::system::error_code& connect_ec, const tcp::endpoint&) {
                        done = true;
                        result = connect_ec;
                    });
            });
        const bool in_time = RunUntil(peer.io, done, deadline, [&] {
            resolver.cancel();
            CloseSocket(peer);
        });
        if (!in_time) {
            CloseSocket(peer);
            return Status(StatusCode::kDeadlineExceeded,
                          "KV send: connect to " + dst + " not done by the deadline");
        }
        if (result) {
            CloseSocket(peer);
            return Unavailable("KV send: connect to " + dst + ": " + result.message());
        }
        boost::system::error_code ignored;
        peer.socket.set_option(tcp::no_delay(true), ignored);
        return Status::Ok();
    }

    // REQUIRES: peer.mu held. Writes the frame and waits for its acknowledgement.
    Attempt SendOnce(Peer& peer, const std::string& dst, const internal::KvPieceFrameHeader& header,
                     const KvPiece& piece, Clock::time_point deadline) {
        if (!peer.socket.is_open()) {
            Status connected = Connect(peer, dst, deadline);
            if (!connected.ok()) return {connected, false};
        }
        const std::string what =
            "KV send of transfer " + std::to_string(piece.header.transfer_id) + " to " + dst;
        bool done = false;
        Status io_error;  // OK while the exchange is healthy
        std::array<uint8_t, internal::kKvAckFrameHeaderBytes> ack_header{};
        internal::DecodedKvAckHeader ack;
        std::string ack_message;
        const auto fail = [&](Status status) {
            io_error = std::move(status);
            done = true;
        };
        const auto read_message = [&] {
            ack_message.resize(ack.message_bytes);
            asio::async_read(peer.socket, asio::buffer(ack_message),
                             [&](const boost::system::error_code& ec, size_t) {
                                 if (ec) return fail(Unavailable(what + ": " + ec.message()));
                                 done = true;
                             });
        };
        const auto read_ack = [&] {
            asio::async_read(
                peer.socket, asio::buffer(ack_header),
                [&](const boost::system::error_code& ec, size_t) {
                    if (ec) {
                        return fail(Unavailable(
                            what + ": connection closed before the receiver acknowledged (" +
                            ec.message() + ")"));
                    }
                    Result<internal::DecodedKvAckHeader> decoded =
                        internal::DecodeKvAckFrameHeader(ack_header);
                    if (!decoded.ok()) return fail(decoded.status().WithContext(what));
                    ack = *decoded;
                    if (ack.transfer_id != piece.header.transfer_id) {
                        return fail(DataLoss(what + ": acknowledgement names transfer " +
                                             std::to_string(ack.transfer_id)));
                    }
                    read_message();
                });
        };
        const std::array<asio::const_buffer, 2> frame = {
            asio::buffer(header), asio::buffer(piece.data.data(), piece.data.size())};
        asio::async_write(peer.socket, frame, [&](const boost::system::error_code& ec, size_t) {
            if (ec) return fail(Unavailable(what + ": write failed: " + ec.message()));
            read_ack();
        });
        const bool in_time = RunUntil(peer.io, done, deadline, [&] { CloseSocket(peer); });
        if (!in_time) {
            // The frame may be half written or its answer still due: the stream is unusable.
            CloseSocket(peer);
            return {
                Status(StatusCode::kDeadlineExceeded, what + ": not acknowledged by the deadline"),
                false};
        }
        if (!io_error.ok()) {
            CloseSocket(peer);
            return {io_error, io_error.code() == StatusCode::kUnavailable};
        }
        if (ack.code == StatusCode::kOk) return {Status::Ok(), false};
        return {Status(ack.code, ack_message).WithContext(what), false};
    }

    const KvTransportOptions options_;
    asio::io_context io_;
    tcp::acceptor acceptor_;
    asio::executor_work_guard<asio::io_context::executor_type> work_;
    std::thread io_thread_;
    std::string endpoint_;
    std::unique_ptr<KvStaging> staging_;
    std::set<std::shared_ptr<Session>> sessions_;  // I/O thread only (and the destructor)

    std::mutex peers_mu_;
    std::map<std::string, std::shared_ptr<Peer>> peers_;  // guarded by peers_mu_
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
