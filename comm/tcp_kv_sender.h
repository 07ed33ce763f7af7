// The sending side of the TCP KV transport (tcp_kv_transport.cc; the frames: comm/tcp_kv_wire.h,
// docs/comm.md): one cached connection per destination (comm/tcp_kv_peer.h), opened on the first
// send with the handshake and, between processes of one host, a shared-memory region offered to
// the receiver. Internal to comm/.
//
// Thread-safety: every method may be called from any thread; sends to one destination are
// serialized on its connection's mutex, sends to different destinations run concurrently.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/kv_transport.h"
#include "comm/tcp_kv_peer.h"
#include "common/status.h"

namespace kvshard::internal {

class TcpKvSender {
  public:
    // `local_endpoint`: the transport's own endpoint, for logs. REQUIRES: `options` outlives this.
    TcpKvSender(const KvTransportOptions& options, std::string local_endpoint);
    TcpKvSender(const TcpKvSender&) = delete;
    TcpKvSender& operator=(const TcpKvSender&) = delete;

    // KvTransport::Send, SendPipelined and Flush (comm/kv_transport.h). Send: the piece
    // pipelined, then its transfer's verdicts collected: so Send's status is the
    // verdict on this piece (and on any earlier pipelined piece of its transfer), and nothing of
    // the transfer is left in flight whatever it returns.
    Status Send(const std::string& dst_endpoint, const KvPiece& piece,
                std::chrono::steady_clock::time_point deadline);
    Status SendPipelined(const std::string& dst_endpoint, const KvPiece& piece,
                         std::chrono::steady_clock::time_point deadline);
    Status Flush(const std::string& dst_endpoint, uint64_t transfer_id,
                 std::chrono::steady_clock::time_point deadline);

  private:
    struct Attempt {
        Status status;
        bool connection_failed = false;  // an I/O error, not a verdict or a deadline
    };

    std::shared_ptr<TcpKvPeer> FindPeer(const std::string& endpoint, HostPort address);
    // REQUIRES: peer.mu held. Connects, says hello and, on the same host, offers a region.
    Status Connect(TcpKvPeer& peer, const std::string& dst,
                   std::chrono::steady_clock::time_point deadline);
    // Same host: creates a region and offers it. A refusal the connection survives (the
    // receiver cannot open it: another process namespace) leaves the socket to carry payloads,
    // and no region is offered to this peer again. REQUIRES: peer.mu held, connected.
    Status OfferRegion(TcpKvPeer& peer, const std::string& dst,
                       std::chrono::steady_clock::time_point deadline);
    // REQUIRES: peer.mu held. Writes the frame (naming its transfer first when this connection
    // last named another) and waits for its acknowledgement. `hash` caches the payload's hash
    // across attempts.
    Attempt SendOnce(TcpKvPeer& peer, const std::string& dst, const KvPiece& piece,
                     std::optional<uint64_t>* hash, std::chrono::steady_clock::time_point deadline);
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
    Attempt SendThroughRegion(TcpKvPeer& peer, std::vector<boost::asio::const_buffer> prefix,
                              const KvPiece& piece, const std::string& what,
                              std::chrono::steady_clock::time_point deadline);
    // REQUIRES: peer.mu held, peer.socket connected. Writes `frame`, reads one acknowledgement
    // for `transfer_id` and returns its verdict (its message, when OK, into `ok_message`); any
    // failure closes the connection, and so does a refusal unless `keep_open_on_refusal`.
    Attempt Exchange(TcpKvPeer& peer, const std::vector<boost::asio::const_buffer>& frame,
                     uint64_t transfer_id, const std::string& what,
                     std::chrono::steady_clock::time_point deadline,
                     std::string* ok_message = nullptr, bool keep_open_on_refusal = false);

    const KvTransportOptions& options_;
    const std::string endpoint_;  // this transport's, for logs
    std::mutex peers_mu_;
    std::map<std::string, std::shared_ptr<TcpKvPeer>> peers_;  // guarded by peers_mu_
};

}  // namespace kvshard::internal
