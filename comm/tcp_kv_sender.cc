// The sending side of the TCP KV transport (comm/tcp_kv_sender.h): a connection per destination
// (comm/tcp_kv_peer.h), opened with the handshake and, on the same host, a shared-memory region;
// a piece goes over the socket and waits for its acknowledgement, or through the region in
// chunks, pipelined, its verdict collected by a later call or by Flush.
#include "comm/tcp_kv_sender.h"

#include <algorithm>

#include "comm/shm_region.h"
#include "comm/tcp_kv_wire.h"
#include "common/logging.h"

namespace kvshard::internal {

namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

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

}  // namespace

TcpKvSender::TcpKvSender(const KvTransportOptions& options, std::string local_endpoint)
    : options_(options), endpoint_(std::move(local_endpoint)) {}

Status TcpKvSender::Send(const std::string& dst_endpoint, const KvPiece& piece,
                         Clock::time_point deadline) {
    const Status sent = SendPipelined(dst_endpoint, piece, deadline);
    const Status verdicts = Flush(dst_endpoint, piece.header.transfer_id, deadline);
    return sent.ok() ? verdicts : sent;
}

Status TcpKvSender::SendPipelined(const std::string& dst_endpoint, const KvPiece& piece,
                                  Clock::time_point deadline) {
    KV_RETURN_IF_ERROR(ValidateKvPiece(piece));
    Result<HostPort> address = ParseHostPort(dst_endpoint);
    if (!address.ok()) return address.status().WithContext("KV endpoint");
    if (Clock::now() >= deadline) {
        return Status(StatusCode::kDeadlineExceeded,
                      "KV send to " + dst_endpoint + ": deadline passed before it began");
    }
    const uint64_t id = piece.header.transfer_id;
    std::shared_ptr<TcpKvPeer> peer = FindPeer(dst_endpoint, std::move(*address));
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

Status TcpKvSender::Flush(const std::string& dst_endpoint, uint64_t transfer_id,
                          Clock::time_point deadline) {
    std::shared_ptr<TcpKvPeer> peer;
    {
        std::lock_guard<std::mutex> lock(peers_mu_);
        auto it = peers_.find(dst_endpoint);
        if (it == peers_.end()) return Status::Ok();  // nothing was ever sent there
        peer = it->second;
    }
    std::lock_guard<std::mutex> lock(peer->mu);
    const auto in_flight = [&] {
        return std::any_of(
            peer->pending.begin(), peer->pending.end(),
            [&](const TcpKvPendingPiece& p) { return p.transfer_id == transfer_id; });
    };
    if (in_flight()) {
        ArmReader(*peer);
        const bool in_time = RunUntilTrue(
            peer->io, [&] { return !in_flight(); }, deadline,
            [&] {
                CloseSocket(*peer,
                            Status(StatusCode::kDeadlineExceeded,
                                   "KV send of transfer " + std::to_string(transfer_id) + " to " +
                                       dst_endpoint + ": not acknowledged by the deadline"));
            });
        (void)in_time;  // a deadline recorded its failure, like any other
    }
    auto failed = peer->failures.find(transfer_id);
    if (failed == peer->failures.end()) return Status::Ok();
    Status status = std::move(failed->second);
    ForgetFailure(*peer, transfer_id);
    return status;
}

std::shared_ptr<TcpKvPeer> TcpKvSender::FindPeer(const std::string& endpoint, HostPort address) {
    std::lock_guard<std::mutex> lock(peers_mu_);
    std::shared_ptr<TcpKvPeer>& peer = peers_[endpoint];
    if (peer == nullptr) peer = std::make_shared<TcpKvPeer>(std::move(address));
    return peer;
}

Status TcpKvSender::Connect(TcpKvPeer& peer, const std::string& dst, Clock::time_point deadline) {
    tcp::resolver resolver(peer.io);
    bool done = false;
    boost::system::error_code result;
    resolver.async_resolve(
        peer.address.host, std::to_string(peer.address.port),
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
    const std::string hello = EncodeKvHello(options_.token);
    std::string boot_id;
    Attempt greeted =
        Exchange(peer, {asio::buffer(hello)}, 0, "KV handshake with " + dst, deadline, &boot_id);
    if (!greeted.status.ok()) return greeted.status;
    if (options_.shared_memory && !peer.region_refused && !boot_id.empty() &&
        boot_id == KvHostBootId()) {
        return OfferRegion(peer, dst, deadline);
    }
    return Status::Ok();
}

Status TcpKvSender::OfferRegion(TcpKvPeer& peer, const std::string& dst,
                                Clock::time_point deadline) {
    Result<KvShmSenderRegion> region = KvShmSenderRegion::Create(options_.shm_region_bytes);
    if (!region.ok()) {
        spdlog::warn("KV transport {}: no shared memory towards {} (over TCP): {}", endpoint_, dst,
                     region.status().ToString());
        peer.region_refused = true;
        return Status::Ok();
    }
    const std::string offer =
        EncodeKvOfferFrame(region->name(), static_cast<uint64_t>(region->bytes()));
    Attempt offered = Exchange(peer, {asio::buffer(offer)}, 0, "KV shared-memory offer to " + dst,
                               deadline, nullptr,
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

TcpKvSender::Attempt TcpKvSender::SendOnce(TcpKvPeer& peer, const std::string& dst,
                                           const KvPiece& piece, std::optional<uint64_t>* hash,
                                           Clock::time_point deadline) {
    if (!peer.socket.is_open()) {
        Status connected = Connect(peer, dst, deadline);
        if (!connected.ok()) return {connected, false};
    }
    const uint64_t id = piece.header.transfer_id;
    const std::string what = "KV send of transfer " + std::to_string(id) + " to " + dst;
    const KvTransferFrame transfer = EncodeKvTransferFrame(id);
    std::vector<asio::const_buffer> frame;
    if (peer.named_transfer != id) frame.push_back(asio::buffer(transfer));
    peer.named_transfer = id;  // reset with the connection if this exchange fails
    if (peer.region.valid()) return SendThroughRegion(peer, frame, piece, what, deadline);
    if (!hash->has_value()) *hash = KvPayloadHash(piece.data);
    const KvPieceFrameHeader header =
        EncodeKvPieceFrameHeader(piece.header, piece.data.size(), **hash);
    frame.push_back(asio::buffer(header));
    frame.push_back(asio::buffer(piece.data.data(), piece.data.size()));
    return Exchange(peer, frame, id, what, deadline);
}

TcpKvSender::Attempt TcpKvSender::SendThroughRegion(TcpKvPeer& peer,
                                                    std::vector<asio::const_buffer> prefix,
                                                    const KvPiece& piece, const std::string& what,
                                                    Clock::time_point deadline) {
    const uint64_t id = piece.header.transfer_id;
    const uint64_t generation = peer.generation;
    const auto broken = [&] { return peer.generation != generation; };
    const auto failure = [&]() -> Attempt {
        auto failed = peer.failures.find(id);
        Status status = failed != peer.failures.end() ? failed->second
                                                      : Unavailable(what + ": connection closed");
        return {status, status.code() == StatusCode::kUnavailable};
    };
    // Room for another pending piece (earlier pieces' verdicts arrive meanwhile).
    if (peer.pending.size() >= kMaxPiecesInFlight) {
        ArmReader(peer);
        if (!WaitFor(
                peer, [&] { return peer.pending.size() < kMaxPiecesInFlight; }, what, deadline) ||
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
    const KvPieceFrameHeader header =
        EncodeKvPieceFrameHeader(piece.header, piece.data.size(), 0,
                                 kKvPieceInRegion | (uncredited ? kKvPieceUncredited : 0));
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
        KvChunk chunk{
            .region_offset = static_cast<uint64_t>(*at),
            .bytes = static_cast<uint64_t>(n),
            .hash = peer.region.CopyIn(*at, piece.data.data() + sent, static_cast<size_t>(n))};
        peer.ring.emplace_back(*at, n);
        TcpKvPendingPiece& mine = peer.pending.back();
        ++mine.held;
        --mine.chunks_left;
        sent += n;
        const KvChunkFrame frame = EncodeKvChunkFrame(chunk);
        if (!write({asio::buffer(frame)})) return failure();
    }
    ArmReader(peer);
    return {Status::Ok(), false};
}

TcpKvSender::Attempt TcpKvSender::Exchange(TcpKvPeer& peer,
                                           const std::vector<asio::const_buffer>& frame,
                                           uint64_t transfer_id, const std::string& what,
                                           Clock::time_point deadline, std::string* ok_message,
                                           bool keep_open_on_refusal) {
    bool done = false;
    Status io_error;  // OK while the exchange is healthy
    std::array<uint8_t, kKvAckFrameHeaderBytes> ack_header{};
    DecodedKvAckHeader ack;
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
                Result<DecodedKvAckHeader> decoded = DecodeKvAckFrameHeader(ack_header);
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
        return {Status(StatusCode::kDeadlineExceeded, what + ": not acknowledged by the deadline"),
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

}  // namespace kvshard::internal
