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
#include <future>
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
// A piece up to this size travels as one chunk: cut into four, each chunk's frame, wake-up and
// bookkeeping cost more than the overlap of its copies saves, and the next piece's copy in
// overlaps this one's copy out anyway (a layerwise transfer is many such pieces).
constexpr int64_t kWholePieceBytes = 1 << 20;

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

// Runs `io` on the calling thread until `done()` or `deadline`. On the deadline calls `cancel`
// (which must make the pending operations complete) and runs their handlers. Returns whether
// `done()` came first.
template <typename Done, typename Cancel>
bool RunUntilTrue(asio::io_context& io, Done done, Clock::time_point deadline, Cancel cancel) {
    io.restart();
    while (!done() && Clock::now() < deadline) {
        if (io.run_one_until(deadline) == 0 && io.stopped()) break;
    }
    if (done()) return true;
    cancel();
    io.restart();
    while (!done() && io.run_one() != 0) {
    }
    return false;
}

template <typename Cancel>
bool RunUntil(asio::io_context& io, const bool& done, Clock::time_point deadline, Cancel cancel) {
    return RunUntilTrue(
        io, [&] { return done; }, deadline, cancel);
}

// Pieces through a region awaiting their verdict, per destination, at most (the region bounds
// their bytes).
constexpr size_t kMaxPiecesInFlight = 64;
// Failed verdicts of pipelined pieces not yet collected by Flush, per destination, at most (the
// oldest are forgotten beyond it: a sender that never flushes cannot grow this).
constexpr size_t kMaxRememberedFailures = 1'024;

// A piece sent through the region whose verdict has not arrived (SendPipelined).
struct PendingPiece {
    uint64_t transfer_id = 0;
    int64_t chunks_left = 0;  // of its chunks, not yet placed in the region
    int64_t held = 0;         // placed, not yet freed (by a credit or the acknowledgement)
    int64_t credits_due = 0;  // credits the receiver still sends for it
    std::string what;         // "KV send of transfer T to DST", for errors
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
    // The shared-memory region the receiver accepted on this connection (guarded by mu; dropped
    // with the connection), and whether it refused one before (then none is offered again).
    internal::KvShmSenderRegion region;
    bool region_refused = false;
    // Counts connections: a handler of an earlier one finds it changed and does nothing.
    uint64_t generation = 0;
    // The region's chunks in flight, {offset, bytes}, oldest first: a ring, freed in order (a
    // piece's credits and acknowledgement arrive in the order its chunks went, pieces in the
    // order they went), and the pieces they belong to, awaiting their verdicts (all guarded by
    // mu; dropped with the connection, their transfers then failed).
    std::deque<std::pair<int64_t, int64_t>> ring;
    std::deque<PendingPiece> pending;
    // The reader of credits and acknowledgements of pending pieces (guarded by mu): armed while
    // pieces are pending; its handlers run inside a sender's call, on that thread.
    bool reading = false;
    std::array<uint8_t, internal::kKvAckFrameHeaderBytes> reply{};
    internal::DecodedKvAckHeader reply_ack;
    std::string reply_message;
    // The first failed verdict per transfer, until Flush collects it, and their order (guarded by
    // mu; kept across connections: a transfer whose pieces were lost with one has failed).
    std::map<uint64_t, Status> failures;
    std::deque<uint64_t> failure_order;
};

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

    // The piece pipelined, then its transfer's verdicts collected: so Send's status is the
    // verdict on this piece (and on any earlier pipelined piece of its transfer), and nothing of
    // the transfer is left in flight whatever it returns.
    Status Send(const std::string& dst_endpoint, const KvPiece& piece,
                Clock::time_point deadline) override {
        const Status sent = SendPipelined(dst_endpoint, piece, deadline);
        const Status verdicts = Flush(dst_endpoint, piece.header.transfer_id, deadline);
        return sent.ok() ? verdicts : sent;
    }

    Status SendPipelined(const std::string& dst_endpoint, const KvPiece& piece,
                         Clock::time_point deadline) override {
        KV_RETURN_IF_ERROR(ValidateKvPiece(piece));
        KV_ASSIGN_OR_RETURN(HostPort address, ParseEndpoint(dst_endpoint));
        if (Clock::now() >= deadline) {
            return Status(StatusCode::kDeadlineExceeded,
                          "KV send to " + dst_endpoint + ": deadline passed before it began");
        }
        const uint64_t id = piece.header.transfer_id;
        std::shared_ptr<Peer> peer = FindPeer(dst_endpoint, std::move(address));
        std::lock_guard<std::mutex> lock(peer->mu);
        CollectVerdicts(*peer);
        if (auto failed = peer->failures.find(id); failed != peer->failures.end()) {
            return failed->second;
        }
        // Only an idle connection can have died unnoticed; one with pieces in flight is read.
        bool reused = peer->socket.is_open() && peer->pending.empty();
        if (reused && LooksClosed(*peer)) {
            CloseSocket(*peer);
            reused = false;
        }
        std::optional<uint64_t> hash;  // of the payload, once a socket-borne attempt needs it
        Attempt attempt = SendOnce(*peer, dst_endpoint, piece, &hash, deadline);
        if (attempt.connection_failed && reused) {
            // The cached connection died while idle (e.g. the receiver restarted): one fresh
            // try. A resend of a piece that was staged after all is dropped as a duplicate. No
            // other piece was in flight, so the failure recorded for this transfer was this
            // attempt's own.
            ForgetFailure(*peer, id);
            attempt = SendOnce(*peer, dst_endpoint, piece, &hash, deadline);
        }
        return attempt.status;
    }

    Status Flush(const std::string& dst_endpoint, uint64_t transfer_id,
                 Clock::time_point deadline) override {
        std::shared_ptr<Peer> peer;
        {
            std::lock_guard<std::mutex> lock(peers_mu_);
            auto it = peers_.find(dst_endpoint);
            if (it == peers_.end()) return Status::Ok();  // nothing was ever sent there
            peer = it->second;
        }
        std::lock_guard<std::mutex> lock(peer->mu);
        const auto in_flight = [&] {
            return std::any_of(peer->pending.begin(), peer->pending.end(),
                               [&](const PendingPiece& p) { return p.transfer_id == transfer_id; });
        };
        if (in_flight()) {
            ArmReader(*peer);
            const bool in_time = RunUntilTrue(
                peer->io, [&] { return !in_flight(); }, deadline,
                [&] {
                    CloseSocket(*peer, Status(StatusCode::kDeadlineExceeded,
                                              "KV send of transfer " + std::to_string(transfer_id) +
                                                  " to " + dst_endpoint +
                                                  ": not acknowledged by the deadline"));
                });
            (void)in_time;  // a deadline recorded its failure, like any other
        }
        auto failed = peer->failures.find(transfer_id);
        if (failed == peer->failures.end()) return Status::Ok();
        Status status = std::move(failed->second);
        ForgetFailure(*peer, transfer_id);
        return status;
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

    // Ends the connection. Pieces still awaiting their verdict fail their transfers with `why`
    // (default: Unavailable, the connection closed before the verdict), and their region
    // chunks are freed with the region.
    static void CloseSocket(Peer& peer, const Status& why = Status::Ok()) {
        ++peer.generation;
        for (const PendingPiece& p : peer.pending) {
            RecordFailure(peer, p.transfer_id,
                          why.ok()
                              ? Unavailable(p.what + ": connection closed before the receiver's "
                                                     "verdict")
                              : why);
        }
        peer.pending.clear();
        peer.ring.clear();
        peer.reading = false;
        peer.named_transfer.reset();
        peer.region = internal::KvShmSenderRegion();  // the receiver's descriptor outlives it
        boost::system::error_code ignored;
        peer.socket.shutdown(tcp::socket::shutdown_both, ignored);
        peer.socket.close(ignored);
    }

    // The first failure of a transfer is kept (later ones follow from it).
    static void RecordFailure(Peer& peer, uint64_t transfer_id, Status status) {
        if (!peer.failures.emplace(transfer_id, std::move(status)).second) return;
        peer.failure_order.push_back(transfer_id);
        while (peer.failure_order.size() > kMaxRememberedFailures) {
            peer.failures.erase(peer.failure_order.front());
            peer.failure_order.pop_front();
        }
    }

    static void ForgetFailure(Peer& peer, uint64_t transfer_id) {
        if (peer.failures.erase(transfer_id) == 0) return;
        peer.failure_order.erase(
            std::find(peer.failure_order.begin(), peer.failure_order.end(), transfer_id));
    }

    // Runs the handlers of credits and acknowledgements that arrived already, without waiting.
    static void CollectVerdicts(Peer& peer) {
        if (peer.pending.empty()) return;
        ArmReader(peer);
        peer.io.restart();
        peer.io.poll();
    }

    // Reads the next credit or acknowledgement while pieces are pending (one read at a time).
    static void ArmReader(Peer& peer) {
        if (peer.reading || peer.pending.empty() || !peer.socket.is_open()) return;
        peer.reading = true;
        const uint64_t generation = peer.generation;
        asio::async_read(peer.socket, asio::buffer(peer.reply),
                         [&peer, generation](const boost::system::error_code& ec, size_t) {
                             if (generation != peer.generation) return;  // an older connection
                             peer.reading = false;
                             OnReply(peer, ec);
                         });
    }

    // A credit frees the oldest chunk in flight; an acknowledgement is the verdict on the oldest
    // pending piece and frees the chunks it still holds. Anything out of order breaks the
    // connection (and fails what is pending).
    static void OnReply(Peer& peer, const boost::system::error_code& ec) {
        const std::string& what = peer.pending.front().what;
        if (ec) {
            return CloseSocket(peer, Unavailable(what +
                                                 ": connection closed before the receiver "
                                                 "acknowledged (" +
                                                 ec.message() + ")"));
        }
        if (internal::IsKvCreditFrame(peer.reply.data())) {
            internal::KvCreditFrame credit{};
            std::copy_n(peer.reply.begin(), credit.size(), credit.begin());
            Result<uint64_t> offset = internal::DecodeKvCreditFrame(credit);
            if (!offset.ok()) return CloseSocket(peer, offset.status().WithContext(what));
            PendingPiece& front = peer.pending.front();
            if (front.credits_due == 0 || front.held == 0 || peer.ring.empty() ||
                static_cast<uint64_t>(peer.ring.front().first) != *offset) {
                return CloseSocket(peer, DataLoss(what + ": credit for region offset " +
                                                  std::to_string(*offset) + " out of order"));
            }
            peer.ring.pop_front();
            --front.held;
            --front.credits_due;
            return ArmReader(peer);
        }
        Result<internal::DecodedKvAckHeader> decoded = internal::DecodeKvAckFrameHeader(peer.reply);
        if (!decoded.ok()) return CloseSocket(peer, decoded.status().WithContext(what));
        if (decoded->transfer_id != peer.pending.front().transfer_id) {
            return CloseSocket(peer, DataLoss(what + ": acknowledgement names transfer " +
                                              std::to_string(decoded->transfer_id)));
        }
        peer.reply_ack = *decoded;
        peer.reply_message.resize(decoded->message_bytes);
        peer.reading = true;
        const uint64_t generation = peer.generation;
        asio::async_read(peer.socket, asio::buffer(peer.reply_message),
                         [&peer, generation](const boost::system::error_code& read_ec, size_t) {
                             if (generation != peer.generation) return;
                             peer.reading = false;
                             OnVerdict(peer, read_ec);
                         });
    }

    static void OnVerdict(Peer& peer, const boost::system::error_code& ec) {
        if (ec) {
            return CloseSocket(peer, Unavailable(peer.pending.front().what + ": " + ec.message()));
        }
        PendingPiece piece = std::move(peer.pending.front());
        peer.pending.pop_front();
        if (static_cast<int64_t>(peer.ring.size()) < piece.held) {
            peer.pending.push_front(std::move(piece));
            return CloseSocket(peer, Internal("KV send: region bookkeeping out of step"));
        }
        peer.ring.erase(peer.ring.begin(), peer.ring.begin() + piece.held);
        const StatusCode code = peer.reply_ack.code;
        if (piece.chunks_left > 0) {
            // Answered before its payload was all there: a refusal the receiver closes after
            // (nothing after it on the stream can be in step).
            RecordFailure(peer, piece.transfer_id,
                          code == StatusCode::kOk
                              ? DataLoss(piece.what + ": acknowledged before its payload")
                              : Status(code, peer.reply_message).WithContext(piece.what));
            return CloseSocket(peer);
        }
        if (code != StatusCode::kOk) {
            RecordFailure(peer, piece.transfer_id,
                          Status(code, peer.reply_message).WithContext(piece.what));
            // A verdict on the transfer (full, discarded) leaves the stream in step; any other
            // refusal is one the receiver closes the connection after.
            if (code != StatusCode::kResourceExhausted && code != StatusCode::kAborted) {
                return CloseSocket(peer);
            }
        }
        ArmReader(peer);
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

    // The payload through peer.region, pipelined: each chunk is copied into the region (and
    // hashed while in cache) where the ring of chunks in flight has room, and announced; the
    // receiver's credits and acknowledgements free the ring in order. Returns once every chunk
    // is in the region (the caller's buffer is free), without waiting for the verdict: the piece
    // stays pending (peer.pending) until its acknowledgement arrives, which a later call reads.
    // So the next piece is copied in while the receiver copies this one out, and at most a
    // region's worth of chunks (and kMaxPiecesInFlight pieces) is in flight, none overwritten
    // before the receiver copied it out. The frames written here are small and bounded by the
    // chunks and pieces in flight, so the synchronous writes cannot block on a receiver that
    // stopped reading; every wait runs under the deadline.
    // REQUIRES: peer.mu held, connected, peer.region valid; `prefix`: the transfer frame if due.
    Attempt SendThroughRegion(Peer& peer, std::vector<asio::const_buffer> prefix,
                              const KvPiece& piece, const std::string& what,
                              Clock::time_point deadline) {
        const uint64_t id = piece.header.transfer_id;
        const uint64_t generation = peer.generation;
        const auto broken = [&] { return peer.generation != generation; };
        const auto failure = [&]() -> Attempt {
            auto failed = peer.failures.find(id);
            Status status = failed != peer.failures.end()
                                ? failed->second
                                : Unavailable(what + ": connection closed");
            return {status, status.code() == StatusCode::kUnavailable};
        };
        // Room for another pending piece (earlier pieces' verdicts arrive meanwhile).
        if (peer.pending.size() >= kMaxPiecesInFlight) {
            ArmReader(peer);
            if (!WaitFor(
                    peer, [&] { return peer.pending.size() < kMaxPiecesInFlight; }, what,
                    deadline) ||
                broken()) {
                return failure();
            }
        }
        if (auto failed = peer.failures.find(id); failed != peer.failures.end()) return failure();

        const auto total = static_cast<int64_t>(piece.data.size());
        const int64_t region_bytes = peer.region.bytes();
        int64_t slots = std::max(kMinRegionSlots, region_bytes / kMaxChunkBytes);
        if (total <= kWholePieceBytes) {
            // A small piece goes as one chunk in the smallest slot that holds it.
            while (region_bytes / (slots * 2) >= total) slots *= 2;
        } else {
            while (region_bytes / (slots * 2) >= kMinChunkBytes &&
                   total / (region_bytes / slots) < kChunksPerPiece) {
                slots *= 2;
            }
        }
        const int64_t chunk_bytes = region_bytes / slots;
        const int64_t chunks = (total + chunk_bytes - 1) / chunk_bytes;
        // A piece that fits the region whatever the ring's wrap wastes (less than a chunk) needs
        // no credits: its chunks are freed by its acknowledgement, and never wait for one
        // another (one frame and a wake-up of each side fewer per chunk).
        const bool uncredited = total + chunk_bytes <= region_bytes;
        peer.pending.push_back({.transfer_id = id,
                                .chunks_left = chunks,
                                .held = 0,
                                .credits_due = uncredited ? 0 : chunks - 1,
                                .what = what});

        const auto write = [&](const std::vector<asio::const_buffer>& buffers) {
            boost::system::error_code ec;
            asio::write(peer.socket, buffers, ec);
            if (!ec) return true;
            if (ec == asio::error::broken_pipe || ec == asio::error::connection_reset) {
                // A receiver that refused and closed has its answer waiting to be read.
                ArmReader(peer);
                if (WaitFor(peer, broken, what, deadline)) return false;
            }
            CloseSocket(peer, Unavailable(what + ": write failed: " + ec.message()));
            return false;
        };
        const internal::KvPieceFrameHeader header = internal::EncodeKvPieceFrameHeader(
            piece.header, piece.data.size(), 0,
            internal::kKvPieceInRegion | (uncredited ? internal::kKvPieceUncredited : 0));
        prefix.push_back(asio::buffer(header));
        if (!write(prefix)) return failure();

        int64_t sent = 0;
        while (sent < total) {
            const int64_t n = std::min(chunk_bytes, total - sent);
            std::optional<int64_t> at = RingRoom(peer, n);
            if (!at.has_value()) {
                ArmReader(peer);
                if (!WaitFor(
                        peer, [&] { return broken() || RingRoom(peer, n).has_value(); }, what,
                        deadline) ||
                    broken()) {
                    return failure();
                }
                continue;
            }
            internal::KvChunk chunk{
                .region_offset = static_cast<uint64_t>(*at),
                .bytes = static_cast<uint64_t>(n),
                .hash = peer.region.CopyIn(*at, piece.data.data() + sent, static_cast<size_t>(n))};
            peer.ring.emplace_back(*at, n);
            PendingPiece& mine = peer.pending.back();
            ++mine.held;
            --mine.chunks_left;
            sent += n;
            const internal::KvChunkFrame frame = internal::EncodeKvChunkFrame(chunk);
            if (!write({asio::buffer(frame)})) return failure();
        }
        ArmReader(peer);
        return {Status::Ok(), false};
    }

    // Where the ring has `n` contiguous free bytes: after its newest chunk, or (wrapping) at the
    // start of the region before its oldest; nullopt when it has not.
    static std::optional<int64_t> RingRoom(const Peer& peer, int64_t n) {
        if (peer.ring.empty()) return 0;
        const int64_t oldest = peer.ring.front().first;
        const int64_t end = peer.ring.back().first + peer.ring.back().second;
        if (peer.ring.back().first >= oldest) {  // one run [oldest, end)
            if (peer.region.bytes() - end >= n) return end;
            if (oldest >= n) return 0;
            return std::nullopt;
        }
        if (oldest - end >= n) return end;  // wrapped: the room is [end, oldest)
        return std::nullopt;
    }

    // Runs the connection's handlers until `done()`; on the deadline closes the connection
    // (failing what is pending with DeadlineExceeded). Returns whether `done()` came first.
    template <typename Done>
    static bool WaitFor(Peer& peer, Done done, const std::string& what,
                        Clock::time_point deadline) {
        return RunUntilTrue(peer.io, done, deadline, [&] {
            CloseSocket(peer, Status(StatusCode::kDeadlineExceeded,
                                     what + ": not acknowledged by the deadline"));
        });
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
    const kvshard::Clock& clock_;  // the sessions' deadlines (options_.clock)
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
