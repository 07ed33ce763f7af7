// The sending side's connection to one destination of the TCP KV transport
// (tcp_kv_transport.cc): its socket and shared-memory region, the region's ring of chunks in
// flight, the pieces awaiting their verdict, and the reader of the receiver's credits and
// acknowledgements. Internal to comm/: TcpKvSender (tcp_kv_sender.h) holds one per destination.
//
// Thread-safety: a TcpKvPeer's state is guarded by its `mu`; every function here REQUIRES it held,
// and runs the peer's io_context on the calling thread only.
#pragma once

// clang-format off
#include <utility>  // Boost 1.74's asio needs it first
#include <boost/asio.hpp>
// clang-format on

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "comm/shm_region.h"
#include "comm/tcp_kv_wire.h"
#include "common/host_port.h"
#include "common/status.h"

namespace kvshard::internal {

// Runs `io` on the calling thread until `done()` or `deadline`. On the deadline calls `cancel`
// (which must make the pending operations complete) and runs their handlers. Returns whether
// `done()` came first.
template <typename Done, typename Cancel>
bool RunUntilTrue(boost::asio::io_context& io, Done done,
                  std::chrono::steady_clock::time_point deadline, Cancel cancel) {
    io.restart();
    while (!done() && std::chrono::steady_clock::now() < deadline) {
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
bool RunUntil(boost::asio::io_context& io, const bool& done,
              std::chrono::steady_clock::time_point deadline, Cancel cancel) {
    return RunUntilTrue(
        io, [&] { return done; }, deadline, cancel);
}

// Pieces through a region awaiting their verdict, per destination, at most (the region bounds
// their bytes).
constexpr size_t kMaxPiecesInFlight = 64;

// A piece sent through the region whose verdict has not arrived (SendPipelined).
struct TcpKvPendingPiece {
    uint64_t transfer_id = 0;
    int64_t chunks_left = 0;  // of its chunks, not yet placed in the region
    int64_t held = 0;         // placed, not yet freed (by a credit or the acknowledgement)
    int64_t credits_due = 0;  // credits the receiver still sends for it
    std::string what;         // "KV send of transfer T to DST", for errors
};

// A destination's cached connection. Its io_context runs only on the thread holding `mu`, inside
// Send, so a deadline is just how long that thread runs it.
struct TcpKvPeer {
    explicit TcpKvPeer(HostPort address) : address(std::move(address)) {}
    std::mutex mu;
    const HostPort address;
    boost::asio::io_context io;
    boost::asio::ip::tcp::socket socket{io};
    // The transfer this connection named last (guarded by mu; reset with the connection).
    std::optional<uint64_t> named_transfer;
    // The shared-memory region the receiver accepted on this connection (guarded by mu; dropped
    // with the connection), and whether it refused one before (then none is offered again).
    KvShmSenderRegion region;
    bool region_refused = false;
    // Counts connections: a handler of an earlier one finds it changed and does nothing.
    uint64_t generation = 0;
    // The region's chunks in flight, {offset, bytes}, oldest first: a ring, freed in order (a
    // piece's credits and acknowledgement arrive in the order its chunks went, pieces in the
    // order they went), and the pieces they belong to, awaiting their verdicts (all guarded by
    // mu; dropped with the connection, their transfers then failed).
    std::deque<std::pair<int64_t, int64_t>> ring;
    std::deque<TcpKvPendingPiece> pending;
    // The reader of credits and acknowledgements of pending pieces (guarded by mu): armed while
    // pieces are pending; its handlers run inside a sender's call, on that thread.
    bool reading = false;
    std::array<uint8_t, kKvAckFrameHeaderBytes> reply{};
    DecodedKvAckHeader reply_ack;
    std::string reply_message;
    // The first failed verdict per transfer, until Flush collects it, and their order (guarded by
    // mu; kept across connections: a transfer whose pieces were lost with one has failed).
    std::map<uint64_t, Status> failures;
    std::deque<uint64_t> failure_order;
};

// Ends the connection. Pieces still awaiting their verdict fail their transfers with `why`
// (default: Unavailable, the connection closed before the verdict), and their region
// chunks are freed with the region.
void CloseSocket(TcpKvPeer& peer, const Status& why = Status::Ok());

// Drops the failure kept for `transfer_id` (Flush collected it, or a retry replaces it).
void ForgetFailure(TcpKvPeer& peer, uint64_t transfer_id);

// Runs the handlers of credits and acknowledgements that arrived already, without waiting.
void CollectVerdicts(TcpKvPeer& peer);

// Reads the next credit or acknowledgement while pieces are pending (one read at a time).
void ArmReader(TcpKvPeer& peer);

// An idle cached connection has nothing to read; EOF or an error means the receiver closed
// it, and bytes would be a protocol error. Either way it is not usable.
// One non-blocking peek (MSG_DONTWAIT: the descriptor's mode is left alone, one system call
// per Send).
bool LooksClosed(TcpKvPeer& peer);

// Where the ring has `n` contiguous free bytes: after its newest chunk, or (wrapping) at the
// start of the region before its oldest; nullopt when it has not.
std::optional<int64_t> RingRoom(const TcpKvPeer& peer, int64_t n);

// Runs the connection's handlers until `done()`; on the deadline closes the connection
// (failing what is pending with DeadlineExceeded). Returns whether `done()` came first.
template <typename Done>
bool WaitFor(TcpKvPeer& peer, Done done, const std::string& what,
             std::chrono::steady_clock::time_point deadline) {
    return RunUntilTrue(peer.io, done, deadline, [&] {
        CloseSocket(peer, Status(StatusCode::kDeadlineExceeded,
                                 what + ": not acknowledged by the deadline"));
    });
}

}  // namespace kvshard::internal
