// TcpKvTransport: worker processes. One listening port per transport, served by one I/O thread
// (Boost.Asio) whose connections (comm/tcp_kv_session.h) read piece frames, stage them and answer
// each with an acknowledgement; senders keep one connection per destination and wait for the
// acknowledgement, so Send's status is the receiver's verdict (staged, refused as full,
// discarded) or a transport error. Frame layout: comm/tcp_kv_wire.h and docs/comm.md. Between
// processes of one host the payloads go through a shared-memory region per connection
// (comm/shm_region.h), a ring of slots the sender fills while the receiver copies the previous
// ones out; the socket then carries only headers, chunk frames and credits.
// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "comm/kv_staging.h"
#include "comm/kv_transport.h"
#include "comm/shm_region.h"
#include "comm/tcp_kv_session.h"
#include "comm/tcp_kv_wire.h"
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
// Per piece the region is cut into equal slots, one chunk each: the largest of region / 2^k
// (at most a quarter of the region and kMaxChunkBytes, at least kMinChunkBytes) that still cuts the
// piece into kChunksPerPiece chunks or more, so that even a small piece's copies into and out of
// the region overlap, and a piece that fits the region goes without waiting for a single credit.
constexpr int64_t kMinRegionSlots = 4;
// A chunk is copied and hashed in cache-sized pieces (comm/shm_region.h), so its size does not
// matter to the caches; what it costs is a frame, a credit and a wake-up of each side. On a
// machine whose cores are busy each wake-up can wait for the scheduler, so chunks are large.
constexpr int64_t kMaxChunkBytes = 4 << 20;
constexpr int64_t kMinChunkBytes = 256 << 10;
constexpr int64_t kChunksPerPiece = 4;

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
    // The shared-memory region the receiver accepted on this connection (guarded by mu; dropped
    // with the connection), and whether it refused one before (then none is offered again).
    internal::KvShmSenderRegion region;
    bool region_refused = false;
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
        std::lock_guard<std::mutex> lock(peer->mu);
        bool reused = peer->socket.is_open();
        if (reused && LooksClosed(*peer)) {
            CloseSocket(*peer);
            reused = false;
        }
        std::optional<uint64_t> hash;  // of the payload, once a socket-borne attempt needs it
        Attempt attempt = SendOnce(*peer, dst_endpoint, piece, &hash, deadline);
        if (attempt.connection_failed && reused) {
            // The cached connection died while idle (e.g. the receiver restarted): one fresh
            // try. A resend of a piece that was staged after all is dropped as a duplicate.
            attempt = SendOnce(*peer, dst_endpoint, piece, &hash, deadline);
        }
        return attempt.status;
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
                internal::StartTcpKvSession(std::move(socket), staging_.get(), &options_,
                                            &sessions_);
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
        peer.region = internal::KvShmSenderRegion();  // the receiver's descriptor outlives it
        boost::system::error_code ignored;
        peer.socket.shutdown(tcp::socket::shutdown_both, ignored);
        peer.socket.close(ignored);
    }

    // An idle cached connection has nothing to read; EOF or an error means the receiver closed
    // it, and bytes would be a protocol error. Either way it is not usable.
    // One non-blocking peek (MSG_DONTWAIT: the descriptor's mode is left alone, one system call
    // per Send).
    static bool LooksClosed(Peer& peer) {
        uint8_t byte = 0;
        const ssize_t n = ::recv(peer.socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
        const bool idle = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
        return !idle;
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
        std::string boot_id;
        Attempt greeted = Exchange(peer, {asio::buffer(hello)}, 0, "KV handshake with " + dst,
                                   deadline, &boot_id);
        if (!greeted.status.ok()) return greeted.status;
        if (options_.shared_memory && !peer.region_refused && !boot_id.empty() &&
            boot_id == internal::KvHostBootId()) {
            return OfferRegion(peer, dst, deadline);
        }
        return Status::Ok();
    }

    // Same host: creates a region and offers it. A refusal the connection survives (the
    // receiver cannot open it: another process namespace) leaves the socket to carry payloads,
    // and no region is offered to this peer again. REQUIRES: peer.mu held, connected.
    Status OfferRegion(Peer& peer, const std::string& dst, Clock::time_point deadline) {
        Result<internal::KvShmSenderRegion> region =
            internal::KvShmSenderRegion::Create(options_.shm_region_bytes);
        if (!region.ok()) {
            spdlog::warn("KV transport {}: no shared memory towards {} (over TCP): {}", endpoint_,
                         dst, region.status().ToString());
            peer.region_refused = true;
            return Status::Ok();
        }
        const std::string offer =
            internal::EncodeKvOfferFrame(region->name(), static_cast<uint64_t>(region->bytes()));
        Attempt offered = Exchange(peer, {asio::buffer(offer)}, 0,
                                   "KV shared-memory offer to " + dst, deadline, nullptr,
                                   /*keep_open_on_refusal=*/true);
        if (offered.status.ok()) {
            peer.region = std::move(*region);
            return Status::Ok();
        }
        if (!peer.socket.is_open()) {  // an I/O error, a deadline, or a refusal that closed it
            peer.region_refused = true;
            return offered.status;
        }
        spdlog::info("KV transport {}: {} declined shared memory (over TCP): {}", endpoint_, dst,
                     offered.status.ToString());
        peer.region_refused = true;
        return Status::Ok();
    }

    // REQUIRES: peer.mu held. Writes the frame (naming its transfer first when this connection
    // last named another) and waits for its acknowledgement. `hash` caches the payload's hash
    // across attempts.
    Attempt SendOnce(Peer& peer, const std::string& dst, const KvPiece& piece,
                     std::optional<uint64_t>* hash, Clock::time_point deadline) {
        if (!peer.socket.is_open()) {
            Status connected = Connect(peer, dst, deadline);
            if (!connected.ok()) return {connected, false};
        }
        const uint64_t id = piece.header.transfer_id;
        const std::string what = "KV send of transfer " + std::to_string(id) + " to " + dst;
        const internal::KvTransferFrame transfer = internal::EncodeKvTransferFrame(id);
        std::vector<asio::const_buffer> frame;
        if (peer.named_transfer != id) frame.push_back(asio::buffer(transfer));
        peer.named_transfer = id;  // reset with the connection if this exchange fails
        if (peer.region.valid()) return SendThroughRegion(peer, frame, piece, what, deadline);
        if (!hash->has_value()) *hash = internal::KvPayloadHash(piece.data);
        const internal::KvPieceFrameHeader header =
            internal::EncodeKvPieceFrameHeader(piece.header, piece.data.size(), **hash);
        frame.push_back(asio::buffer(header));
        frame.push_back(asio::buffer(piece.data.data(), piece.data.size()));
        return Exchange(peer, frame, id, what, deadline);
    }

    // The payload through peer.region: each chunk is hashed (bringing it into cache), copied
    // into a free slot and announced; the receiver's credit frees its slot for the next chunk,
    // and its acknowledgement ends the piece. So at most a region's worth of chunks is in flight
    // and none is overwritten before the receiver copied it out. The frames written here are small
    // and bounded by the slots in flight, so the synchronous writes cannot block on a receiver
    // that stopped reading; the waiting for credits runs under the deadline.
    // REQUIRES: peer.mu held, connected, peer.region valid; `prefix`: the transfer frame if due.
    Attempt SendThroughRegion(Peer& peer, std::vector<asio::const_buffer> prefix,
                              const KvPiece& piece, const std::string& what,
                              Clock::time_point deadline) {
        const uint64_t id = piece.header.transfer_id;
        const auto total = static_cast<int64_t>(piece.data.size());
        const int64_t region_bytes = peer.region.bytes();
        int64_t slots = std::max(kMinRegionSlots, region_bytes / kMaxChunkBytes);
        while (region_bytes / (slots * 2) >= kMinChunkBytes &&
               total / (region_bytes / slots) < kChunksPerPiece) {
            slots *= 2;
        }
        const int64_t chunk_bytes = region_bytes / slots;
        std::deque<int64_t> free_slots;
        for (int64_t i = 0; i < slots; ++i) free_slots.push_back(i * chunk_bytes);
        std::deque<int64_t> in_flight;  // region offsets, oldest first
        int64_t sent = 0;

        bool done = false;
        Status io_error;
        const auto fail = [&](Status status) {
            io_error = std::move(status);
            done = true;
        };
        const auto write = [&](const std::vector<asio::const_buffer>& buffers) {
            boost::system::error_code ec;
            asio::write(peer.socket, buffers, ec);
            // A receiver that refused and closed has its answer waiting to be read.
            if (ec && ec != asio::error::broken_pipe && ec != asio::error::connection_reset) {
                fail(Unavailable(what + ": write failed: " + ec.message()));
            }
            return !ec;
        };
        const auto pump = [&] {
            while (!done && sent < total && !free_slots.empty()) {
                const int64_t at = free_slots.front();
                free_slots.pop_front();
                const int64_t n = std::min(chunk_bytes, total - sent);
                const uint8_t* from = piece.data.data() + sent;
                internal::KvChunk chunk{
                    .region_offset = static_cast<uint64_t>(at),
                    .bytes = static_cast<uint64_t>(n),
                    .hash = peer.region.CopyIn(at, from, static_cast<size_t>(n))};
                in_flight.push_back(at);
                sent += n;
                const internal::KvChunkFrame frame = internal::EncodeKvChunkFrame(chunk);
                if (!write({asio::buffer(frame)})) return;
            }
        };

        std::array<uint8_t, internal::kKvAckFrameHeaderBytes> reply{};
        internal::DecodedKvAckHeader ack;
        std::string ack_message;
        std::function<void()> read_reply = [&] {
            asio::async_read(
                peer.socket, asio::buffer(reply), [&](const boost::system::error_code& ec, size_t) {
                    if (ec) {
                        return fail(Unavailable(what +
                                                ": connection closed before the receiver "
                                                "acknowledged (" +
                                                ec.message() + ")"));
                    }
                    if (internal::IsKvCreditFrame(reply.data())) {
                        internal::KvCreditFrame credit{};
                        std::copy_n(reply.begin(), credit.size(), credit.begin());
                        Result<uint64_t> offset = internal::DecodeKvCreditFrame(credit);
                        if (!offset.ok()) return fail(offset.status().WithContext(what));
                        if (in_flight.empty() ||
                            static_cast<uint64_t>(in_flight.front()) != *offset) {
                            return fail(DataLoss(what + ": credit for region offset " +
                                                 std::to_string(*offset) + " out of order"));
                        }
                        free_slots.push_back(in_flight.front());
                        in_flight.pop_front();
                        pump();
                        if (!done) read_reply();
                        return;
                    }
                    Result<internal::DecodedKvAckHeader> decoded =
                        internal::DecodeKvAckFrameHeader(reply);
                    if (!decoded.ok()) return fail(decoded.status().WithContext(what));
                    ack = *decoded;
                    if (ack.transfer_id != id) {
                        return fail(DataLoss(what + ": acknowledgement names transfer " +
                                             std::to_string(ack.transfer_id)));
                    }
                    ack_message.resize(ack.message_bytes);
                    asio::async_read(
                        peer.socket, asio::buffer(ack_message),
                        [&](const boost::system::error_code& read_ec, size_t) {
                            if (read_ec) {
                                return fail(Unavailable(what + ": " + read_ec.message()));
                            }
                            done = true;
                        });
                });
        };

        // A piece whose chunks all fit in distinct slots needs no credits: the receiver sends
        // none (one frame and a wake-up of this side fewer per chunk).
        const bool uncredited = (total + chunk_bytes - 1) / chunk_bytes <= slots;
        const internal::KvPieceFrameHeader header = internal::EncodeKvPieceFrameHeader(
            piece.header, piece.data.size(), 0,
            internal::kKvPieceInRegion | (uncredited ? internal::kKvPieceUncredited : 0));
        prefix.push_back(asio::buffer(header));
        if (write(prefix)) pump();
        if (!done) read_reply();
        const bool in_time = RunUntil(peer.io, done, deadline, [&] { CloseSocket(peer); });
        if (!in_time) {
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
        if (ack.code != StatusCode::kResourceExhausted && ack.code != StatusCode::kAborted) {
            CloseSocket(peer);
        }
        return {Status(ack.code, ack_message).WithContext(what), false};
    }

    // REQUIRES: peer.mu held, peer.socket connected. Writes `frame`, reads one acknowledgement
    // for `transfer_id` and returns its verdict (its message, when OK, into `ok_message`); any
    // failure closes the connection, and so does a refusal unless `keep_open_on_refusal`.
    Attempt Exchange(Peer& peer, const std::vector<asio::const_buffer>& frame, uint64_t transfer_id,
                     const std::string& what, Clock::time_point deadline,
                     std::string* ok_message = nullptr, bool keep_open_on_refusal = false) {
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
        if (ack.code == StatusCode::kOk) {
            if (ok_message != nullptr) *ok_message = std::move(ack_message);
            return {Status::Ok(), false};
        }
        // A refusal the receiver closes the connection after (a protocol violation) leaves it
        // unusable; a verdict on the transfer (full, discarded) does not. Either way a fresh
        // connection is right for the next send, and costs only a handshake.
        const bool survivable = ack.code == StatusCode::kNotFound ||
                                ack.code == StatusCode::kUnavailable ||
                                ack.code == StatusCode::kUnimplemented;
        if (keep_open_on_refusal && survivable) {
            return {Status(ack.code, ack_message).WithContext(what), false};
        }
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
    asio::steady_timer accept_retry_;   // I/O thread only
    internal::TcpKvSessions sessions_;  // I/O thread only (and the destructor)
    uint64_t refused_connections_ = 0;  // I/O thread only: over max_connections

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
