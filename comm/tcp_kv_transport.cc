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
#include <optional>
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
// Accepted payloads are read in chunks of this size, so that the memory a piece takes grows with
// the bytes that arrived, not with what its header claims.
constexpr size_t kPayloadChunkBytes = 1 << 20;
// After a failed accept (e.g. out of file descriptors), wait this long before the next, rather
// than spinning on the error.
constexpr int64_t kAcceptRetryMs = 100;

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

// One accepted connection, on the I/O thread: the hello, then frames one after another; each
// piece is answered before the next frame is read, since the sender waits for the answer.
//
// Nothing the peer claims is trusted before it is checked: the hello's token length is bounded,
// a piece's header is validated (ValidateKvPieceHeader, its length against its fields, the
// receive geometry and the staging limits in KvStaging::Reserve) before its payload is read, and
// the payload is then read in chunks, so memory grows only with bytes that actually arrived.
// Deadlines: the hello, and every frame once its magic arrived, must be complete within
// read_timeout_ms; between frames a connection may be idle for idle_timeout_ms (it holds no
// reservation then). Either way a stalled connection is closed and its reservation given back.
class Session : public std::enable_shared_from_this<Session> {
  public:
    Session(tcp::socket socket, KvStaging* staging, const KvTransportOptions* options,
            std::set<std::shared_ptr<Session>>* live)
        : socket_(std::move(socket)),
          timer_(socket_.get_executor()),
          staging_(staging),
          options_(options),
          live_(live) {
        boost::system::error_code ec;
        const tcp::endpoint remote = socket_.remote_endpoint(ec);
        peer_ = ec ? "unknown peer"
                   : remote.address().to_string() + ":" + std::to_string(remote.port());
        socket_.set_option(tcp::no_delay(true), ec);
    }

    void Start() {
        Arm(options_->read_timeout_ms, "no complete hello within read_timeout_ms");
        ReadHello();
    }

    // I/O thread: ends the connection (pending operations complete with operation_aborted).
    void Close() {
        boost::system::error_code ignored;
        timer_.cancel();
        socket_.close(ignored);
    }

  private:
    // Closes the connection with `why` unless the next Arm (or End) comes first.
    void Arm(int64_t ms, const char* why) {
        const uint64_t generation = ++timer_generation_;
        timer_.expires_after(std::chrono::milliseconds(ms));
        timer_.async_wait(
            [self = shared_from_this(), generation, why](const boost::system::error_code& ec) {
                if (ec || generation != self->timer_generation_) return;
                self->End(std::string(why) + " (" +
                          std::to_string(self->reserved_ ? self->piece_.data.size() : 0) +
                          " payload bytes in)");
            });
    }

    void ReadHello() {
        asio::async_read(socket_, asio::buffer(hello_),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) return self->End("closed during the hello: " + ec.message());
                             self->OnHelloHeader();
                         });
    }

    void OnHelloHeader() {
        Result<uint16_t> token_bytes = internal::DecodeKvHelloHeader(hello_);
        if (!token_bytes.ok()) return End("malformed hello: " + token_bytes.status().ToString());
        token_.assign(*token_bytes, '\0');
        asio::async_read(socket_, asio::buffer(token_),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) return self->End("closed during the hello: " + ec.message());
                             self->OnHello();
                         });
    }

    void OnHello() {
        const bool accepted =
            options_->token.empty() || internal::KvTokensEqual(options_->token, token_);
        std::string().swap(token_);
        if (!accepted) {
            // Refused as an ordinary answer, so the sender can say why; then closed.
            return Refuse(0, InvalidArgument("KV transport: the hello's token is not this "
                                             "deployment's"));
        }
        WriteAck(0, Status::Ok(), /*then_close=*/false);
    }

    // Between frames: the connection holds nothing, so it may idle for idle_timeout_ms.
    void ReadFrame() {
        Arm(options_->idle_timeout_ms, "idle for idle_timeout_ms");
        asio::async_read(socket_, asio::buffer(frame_.data(), internal::kKvFrameMagicBytes),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) {
                                 // Closed between frames: the sender is done with us.
                                 return self->End(ec == asio::error::eof ? "" : ec.message());
                             }
                             self->OnMagic();
                         });
    }

    void OnMagic() {
        Result<internal::KvFrameKind> kind = internal::DecodeKvFrameKind(frame_.data());
        if (!kind.ok()) return End("malformed KV frame: " + kind.status().ToString());
        Arm(options_->read_timeout_ms, "stalled mid-frame for read_timeout_ms");
        const size_t rest = internal::KvFrameHeaderBytes(*kind) - internal::kKvFrameMagicBytes;
        asio::async_read(socket_, asio::buffer(frame_.data() + internal::kKvFrameMagicBytes, rest),
                         [self = shared_from_this(), kind = *kind](
                             const boost::system::error_code& ec, size_t n) {
                             if (ec) {
                                 return self->End("closed mid-header after " + std::to_string(n) +
                                                  " bytes: " + ec.message());
                             }
                             if (kind == internal::KvFrameKind::kTransfer) {
                                 self->OnTransferFrame();
                             } else {
                                 self->OnPieceHeader();
                             }
                         });
    }

    void OnTransferFrame() {
        internal::KvTransferFrame bytes{};
        std::copy_n(frame_.begin(), bytes.size(), bytes.begin());
        Result<uint64_t> id = internal::DecodeKvTransferFrame(bytes);
        if (!id.ok()) return End("malformed KV frame: " + id.status().ToString());
        transfer_id_ = *id;
        ReadFrame();
    }

    void OnPieceHeader() {
        Result<internal::DecodedKvPieceFrame> frame = internal::DecodeKvPieceFrameHeader(frame_);
        if (!frame.ok()) {
            // A header that contradicts itself: nothing after it can be trusted.
            return Refuse(internal::KvPieceFrameTransferId(frame_), frame.status());
        }
        decoded_ = *frame;
        const uint64_t id = decoded_.header.transfer_id;
        if (!transfer_id_.has_value() || *transfer_id_ != id) {
            return Refuse(
                id, Status(StatusCode::kNotFound, "KV piece of transfer " + std::to_string(id) +
                                                      ", which this connection did not name"));
        }
        Status admitted = staging_->Reserve(decoded_.header);
        if (admitted.code() == StatusCode::kInvalidArgument) {
            // Does not fit this pool: a sender that means well never sends it.
            return Refuse(id, admitted);
        }
        if (!admitted.ok()) {
            // A verdict on the transfer (full, discarded): the stream stays in step, so read the
            // payload off without keeping it, then answer.
            refusal_ = std::move(admitted);
            drain_left_ = decoded_.payload_bytes;
            scratch_.resize(std::min<uint64_t>(drain_left_, kDrainChunkBytes));
            return Drain();
        }
        reserved_ = true;
        piece_ = KvPiece();
        piece_.header = decoded_.header;
        // Capacity only (address space; pages are touched as bytes arrive), bounded by Reserve.
        piece_.data.reserve(static_cast<size_t>(decoded_.payload_bytes));
        ReadPayload();
    }

    void ReadPayload() {
        const size_t have = piece_.data.size();
        const size_t total = static_cast<size_t>(decoded_.payload_bytes);
        if (have == total) return OnPayload();
        const size_t chunk = std::min(total - have, kPayloadChunkBytes);
        piece_.data.resize(have + chunk);
        asio::async_read(
            socket_, asio::buffer(piece_.data.data() + have, chunk),
            [self = shared_from_this(), have](const boost::system::error_code& ec, size_t n) {
                if (ec) {
                    return self->End("closed mid-payload after " + std::to_string(have + n) +
                                     " of " + std::to_string(self->decoded_.payload_bytes) +
                                     " bytes: " + ec.message());
                }
                self->ReadPayload();
            });
    }

    void OnPayload() {
        if (internal::KvPayloadCrc(piece_.data) != decoded_.payload_crc) {
            return End("malformed KV frame: payload CRC mismatch (transfer " +
                       std::to_string(decoded_.header.transfer_id) + ")");
        }
        reserved_ = false;  // Commit takes the reservation over, whatever it answers
        Status staged = staging_->Commit(std::move(piece_));
        piece_ = KvPiece();
        WriteAck(decoded_.header.transfer_id, staged, /*then_close=*/false);
    }

    void Drain() {
        if (drain_left_ == 0) {
            std::vector<uint8_t>().swap(scratch_);
            return WriteAck(decoded_.header.transfer_id, refusal_, /*then_close=*/false);
        }
        const size_t chunk = static_cast<size_t>(std::min<uint64_t>(drain_left_, scratch_.size()));
        socket_.async_read_some(
            asio::buffer(scratch_.data(), chunk),
            [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
                if (ec)
                    return self->End("closed while a refused payload was read: " + ec.message());
                self->drain_left_ -= n;
                self->Drain();
            });
    }

    // A protocol violation: answers with the reason, then closes (the stream cannot be trusted
    // to be in step). Logged, since a working sender never causes it.
    void Refuse(uint64_t transfer_id, const Status& why) {
        spdlog::warn("KV transport: refusing the connection from {}: {}", peer_, why.ToString());
        WriteAck(transfer_id, why, /*then_close=*/true);
    }

    void WriteAck(uint64_t transfer_id, const Status& status, bool then_close) {
        ack_ = internal::EncodeKvAckFrame(transfer_id, status);
        asio::async_write(
            socket_, asio::buffer(ack_),
            [self = shared_from_this(), then_close](const boost::system::error_code& ec, size_t) {
                if (ec) {
                    return self->End("acknowledgement not written: " + ec.message());
                }
                if (then_close) return self->End("");
                self->ReadFrame();
            });
    }

    // The connection is over: gives back a reservation, closes, and leaves the live set.
    void End(const std::string& why) {
        if (ended_) return;
        ended_ = true;
        ++timer_generation_;
        if (reserved_) {
            staging_->Unreserve(decoded_.header);
            reserved_ = false;
        }
        piece_ = KvPiece();
        std::vector<uint8_t>().swap(scratch_);
        if (!why.empty()) spdlog::warn("KV transport: connection from {} closed: {}", peer_, why);
        Close();
        live_->erase(shared_from_this());
    }

    tcp::socket socket_;
    asio::steady_timer timer_;
    uint64_t timer_generation_ = 0;  // a wait armed under another generation is stale
    KvStaging* const staging_;
    const KvTransportOptions* const options_;         // the transport's
    std::set<std::shared_ptr<Session>>* const live_;  // the transport's, I/O thread only
    std::string peer_;
    bool ended_ = false;
    std::array<uint8_t, internal::kKvHelloHeaderBytes> hello_{};
    std::string token_;
    // The transfer this connection named last (its pieces are the only ones accepted).
    std::optional<uint64_t> transfer_id_;
    internal::KvPieceFrameHeader frame_{};  // also holds a transfer frame
    internal::DecodedKvPieceFrame decoded_;
    KvPiece piece_;
    bool reserved_ = false;  // staging holds a reservation for decoded_.header
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
    // The transfer this connection named last (guarded by mu; reset with the connection).
    std::optional<uint64_t> named_transfer;
};

class TcpKvTransport final : public KvTransport {
  public:
    explicit TcpKvTransport(const KvTransportOptions& options)
        : options_(options),
          acceptor_(io_),
          work_(asio::make_work_guard(io_)),
          accept_retry_(io_) {}

    ~TcpKvTransport() override {
        if (io_thread_.joinable()) {
            asio::post(io_, [this] {
                boost::system::error_code ignored;
                acceptor_.close(ignored);
                accept_retry_.cancel();
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

    int64_t arriving_bytes() const override { return staging_->arriving_bytes(); }

    Status SetReceiveGeometry(const KvReceiveGeometry& geometry) override {
        return staging_->SetGeometry(geometry);
    }

  private:
    struct Attempt {
        Status status;
        bool connection_failed = false;  // an I/O error, not a verdict or a deadline
    };

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
                auto session = std::make_shared<Session>(std::move(socket), staging_.get(),
                                                         &options_, &sessions_);
                sessions_.insert(session);
                session->Start();
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
        peer.named_transfer.reset();
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
        const std::string hello = internal::EncodeKvHello(options_.token);
        Attempt greeted =
            Exchange(peer, {asio::buffer(hello)}, 0, "KV handshake with " + dst, deadline);
        return greeted.status;
    }

    // REQUIRES: peer.mu held. Writes the frame (naming its transfer first when this connection
    // last named another) and waits for its acknowledgement.
    Attempt SendOnce(Peer& peer, const std::string& dst, const internal::KvPieceFrameHeader& header,
                     const KvPiece& piece, Clock::time_point deadline) {
        if (!peer.socket.is_open()) {
            Status connected = Connect(peer, dst, deadline);
            if (!connected.ok()) return {connected, false};
        }
        const uint64_t id = piece.header.transfer_id;
        const internal::KvTransferFrame transfer = internal::EncodeKvTransferFrame(id);
        std::vector<asio::const_buffer> frame;
        if (peer.named_transfer != id) frame.push_back(asio::buffer(transfer));
        frame.push_back(asio::buffer(header));
        frame.push_back(asio::buffer(piece.data.data(), piece.data.size()));
        peer.named_transfer = id;  // reset with the connection if this exchange fails
        return Exchange(peer, frame, id, "KV send of transfer " + std::to_string(id) + " to " + dst,
                        deadline);
    }

    // REQUIRES: peer.mu held, peer.socket connected. Writes `frame`, reads one acknowledgement
    // for `transfer_id` and returns its verdict; any failure closes the connection.
    Attempt Exchange(Peer& peer, const std::vector<asio::const_buffer>& frame, uint64_t transfer_id,
                     const std::string& what, Clock::time_point deadline) {
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
                    if (ack.transfer_id != transfer_id) {
                        return fail(DataLoss(what + ": acknowledgement names transfer " +
                                             std::to_string(ack.transfer_id)));
                    }
                    read_message();
                });
        };
        asio::async_write(peer.socket, frame, [&](const boost::system::error_code& ec, size_t) {
            // The receiver may answer and close before it read everything (a refusal): its
            // answer is then still there to read.
            if (ec && ec != asio::error::broken_pipe && ec != asio::error::connection_reset) {
                return fail(Unavailable(what + ": write failed: " + ec.message()));
            }
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
        // A refusal the receiver closes the connection after (a protocol violation) leaves it
        // unusable; a verdict on the transfer (full, discarded) does not. Either way a fresh
        // connection is right for the next send, and costs only a handshake.
        if (ack.code != StatusCode::kResourceExhausted && ack.code != StatusCode::kAborted) {
            CloseSocket(peer);
        }
        return {Status(ack.code, ack_message).WithContext(what), false};
    }

    const KvTransportOptions options_;
    asio::io_context io_;
    tcp::acceptor acceptor_;
    asio::executor_work_guard<asio::io_context::executor_type> work_;
    std::thread io_thread_;
    std::string endpoint_;
    std::unique_ptr<KvStaging> staging_;
    asio::steady_timer accept_retry_;              // I/O thread only
    std::set<std::shared_ptr<Session>> sessions_;  // I/O thread only (and the destructor)
    uint64_t refused_connections_ = 0;             // I/O thread only: over max_connections

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
