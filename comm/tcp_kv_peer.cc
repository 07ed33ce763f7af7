// A sending connection's bookkeeping (comm/tcp_kv_peer.h): closing it and failing what it had in
// flight, the failures kept for Flush, and the reader of the receiver's credits and
// acknowledgements that frees the region's ring in order.
#include "comm/tcp_kv_peer.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

namespace kvshard::internal {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// Failed verdicts of pipelined pieces not yet collected by Flush, per destination, at most (the
// oldest are forgotten beyond it: a sender that never flushes cannot grow this).
constexpr size_t kMaxRememberedFailures = 1'024;

static void RecordFailure(TcpKvPeer& peer, uint64_t transfer_id, Status status);
static void OnReply(TcpKvPeer& peer, const boost::system::error_code& ec);
static void OnVerdict(TcpKvPeer& peer, const boost::system::error_code& ec);

void CloseSocket(TcpKvPeer& peer, const Status& why) {
    ++peer.generation;
    for (const TcpKvPendingPiece& p : peer.pending) {
        RecordFailure(peer, p.transfer_id,
                      why.ok() ? Unavailable(p.what + ": connection closed before the receiver's "
                                                      "verdict")
                               : why);
    }
    peer.pending.clear();
    peer.ring.clear();
    peer.reading = false;
    peer.named_transfer.reset();
    peer.region = KvShmSenderRegion();  // the receiver's descriptor outlives it
    boost::system::error_code ignored;
    peer.socket.shutdown(tcp::socket::shutdown_both, ignored);
    peer.socket.close(ignored);
}

// The first failure of a transfer is kept (later ones follow from it).
static void RecordFailure(TcpKvPeer& peer, uint64_t transfer_id, Status status) {
    if (!peer.failures.emplace(transfer_id, std::move(status)).second) return;
    peer.failure_order.push_back(transfer_id);
    while (peer.failure_order.size() > kMaxRememberedFailures) {
        peer.failures.erase(peer.failure_order.front());
        peer.failure_order.pop_front();
    }
}

void ForgetFailure(TcpKvPeer& peer, uint64_t transfer_id) {
    if (peer.failures.erase(transfer_id) == 0) return;
    peer.failure_order.erase(
        std::find(peer.failure_order.begin(), peer.failure_order.end(), transfer_id));
}

void CollectVerdicts(TcpKvPeer& peer) {
    if (peer.pending.empty()) return;
    ArmReader(peer);
    peer.io.restart();
    peer.io.poll();
}

void ArmReader(TcpKvPeer& peer) {
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
static void OnReply(TcpKvPeer& peer, const boost::system::error_code& ec) {
    const std::string& what = peer.pending.front().what;
    if (ec) {
        return CloseSocket(peer, Unavailable(what +
                                             ": connection closed before the receiver "
                                             "acknowledged (" +
                                             ec.message() + ")"));
    }
    if (IsKvCreditFrame(peer.reply.data())) {
        KvCreditFrame credit{};
        std::copy_n(peer.reply.begin(), credit.size(), credit.begin());
        Result<uint64_t> offset = DecodeKvCreditFrame(credit);
        if (!offset.ok()) return CloseSocket(peer, offset.status().WithContext(what));
        TcpKvPendingPiece& front = peer.pending.front();
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
    Result<DecodedKvAckHeader> decoded = DecodeKvAckFrameHeader(peer.reply);
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

static void OnVerdict(TcpKvPeer& peer, const boost::system::error_code& ec) {
    if (ec) {
        return CloseSocket(peer, Unavailable(peer.pending.front().what + ": " + ec.message()));
    }
    TcpKvPendingPiece piece = std::move(peer.pending.front());
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

bool LooksClosed(TcpKvPeer& peer) {
    uint8_t byte = 0;
    const ssize_t n = ::recv(peer.socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    const bool idle = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    return !idle;
}

std::optional<int64_t> RingRoom(const TcpKvPeer& peer, int64_t n) {
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

}  // namespace kvshard::internal
