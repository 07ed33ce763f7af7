// KvStaging: the receiving side shared by every KvTransport (comm/kv_transport.h). Pieces that
// arrived, keyed by transfer id, until Receive takes them; the staging limit, staleness and
// discarded transfers. Internal to comm/: the transports own one each and feed it from their
// delivery path (a memcpy in-process, the I/O thread for TCP).
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "comm/kv_transport.h"
#include "common/status.h"

namespace kvshard::internal {

// The header checks of ValidateKvPiece (everything but the data size), for a header read off
// the network before its payload is allocated (kv_transport.cc).
Status ValidateKvPieceHeader(const KvPieceHeader& header);

// The buffer pool of a staging keeps at most this many buffers and bytes. Enough buffers for a
// layerwise transfer of a deep model (one piece per layer: 80 layers for the largest served
// models), so that its pieces all land in pooled memory; the byte bound is what limits memory.
inline constexpr size_t kMaxPooledBuffers = 128;
inline constexpr int64_t kMaxPooledBytes = int64_t{512} << 20;

// KvTransportOptions::token is at most this long (it travels in the TCP handshake).
inline constexpr size_t kMaxKvTokenBytes = 256;

// InvalidArgument naming the field.
Status ValidateKvTransportOptions(const KvTransportOptions& options);

// Layers × heads of a piece: what Receive's expected_cells counts.
int64_t KvPieceCells(const KvPieceHeader& header);

class KvStaging {
  public:
    using Clock = std::chrono::steady_clock;
    // `owner` names this staging in error messages (the transport's endpoint). `now` is the
    // clock staleness is measured with (tests pass a fake one).
    KvStaging(const KvTransportOptions& options, std::string owner,
              std::function<Clock::time_point()> now = Clock::now);

    // Two phases, so that a transport can refuse a piece before it allocates or reads it:
    // Reserve counts KvPieceBytes(header) against the limits for a piece about to be delivered;
    // Commit stages it, Unreserve gives the bytes back when the delivery failed.
    // REQUIRES: ValidateKvPieceHeader(header) passed.
    // Reserve errors: InvalidArgument (the piece does not fit the receive geometry),
    // ResourceExhausted (a byte or transfer-count limit), Aborted (the transfer was discarded or
    // went stale), Unavailable (closed).
    Status Reserve(const KvPieceHeader& header);
    // REQUIRES: a successful Reserve(header) not yet committed or unreserved.
    void Unreserve(const KvPieceHeader& header);
    // REQUIRES: a successful Reserve(piece.header), and a valid piece. A piece whose layers ×
    // heads are already staged for the transfer (a resend) is dropped and reported OK, so that a
    // sender may retry. Aborted when the transfer was discarded meanwhile.
    Status Commit(KvPiece piece);
    // Reserve + Commit of a copy of `piece` (into a pooled buffer when one is big enough).
    Status StageCopy(const KvPiece& piece);

    // The buffer pool (KvTransport::Recycle): a buffer of capacity >= `bytes`, resized to
    // `bytes` (pages already touched, nothing zero-filled when it held as much before), or
    // nullopt when the pool has none. Pooled capacity is bounded (kMaxPooledBuffers buffers,
    // and no more bytes than the staging limit or kMaxPooledBytes, the largest kept).
    std::optional<std::vector<uint8_t>> TakePooledBuffer(size_t bytes);
    // Gives the buffers of received pieces back to the pool (what does not fit is freed).
    void Recycle(std::vector<KvPiece> pieces);
    int64_t pooled_bytes() const;  // capacity held by the pool (tests)

    // KvTransport::SetReceiveGeometry: from now on pieces must fit `geometry`, and the limits
    // are at most the pool's (bytes: KvReceiveGeometryBytes; transfers: its blocks).
    Status SetGeometry(const KvReceiveGeometry& geometry);

    // KvTransport::Receive, ::Discard, ::staged_bytes and ::arriving_bytes.
    Result<std::vector<KvPiece>> Receive(uint64_t transfer_id, int64_t expected_cells,
                                         Clock::time_point deadline);
    void Discard(uint64_t transfer_id);
    int64_t staged_bytes() const;
    int64_t arriving_bytes() const;

    // Later Reserves return Unavailable (the transport is going away).
    void Close();

  private:
    struct Transfer {
        std::vector<KvPiece> pieces;  // in arrival order
        int64_t cells = 0;
        int64_t bytes = 0;           // of `pieces`
        int64_t reserved_bytes = 0;  // of pieces still arriving
        Clock::time_point last_arrival;
    };

    // Drops transfers no piece arrived for within stale_after_ms, and forgets old discards.
    // REQUIRES: mu_ held.
    void DropStaleLocked(Clock::time_point now);
    void RememberDiscardLocked(uint64_t transfer_id, Clock::time_point now);

    // The byte and transfer limits in force (the options', lowered to the pool's by a geometry).
    // REQUIRES: mu_ held.
    int64_t MaxBytesLocked() const;
    int64_t MaxTransfersLocked() const;

    const KvTransportOptions options_;
    const std::string owner_;
    const std::function<Clock::time_point()> now_;

    mutable std::mutex mu_;
    std::condition_variable arrived_;
    std::map<uint64_t, Transfer> transfers_;  // guarded by mu_
    // Receive calls waiting per transfer id: such a transfer does not go stale (guarded by mu_).
    std::map<uint64_t, int> waiting_;
    int64_t staged_bytes_ = 0;    // guarded by mu_: bytes of committed pieces
    int64_t reserved_bytes_ = 0;  // guarded by mu_: reserved, not yet committed
    // Discarded or stale transfer ids, oldest first, bounded in count and age (guarded by mu_).
    std::deque<std::pair<uint64_t, Clock::time_point>> discarded_order_;
    std::unordered_set<uint64_t> discarded_;
    // Idle piece buffers by capacity (guarded by mu_), and their total capacity.
    std::multimap<size_t, std::vector<uint8_t>> pool_;
    int64_t pooled_bytes_ = 0;                   // guarded by mu_
    bool closed_ = false;                        // guarded by mu_
    std::optional<KvReceiveGeometry> geometry_;  // guarded by mu_
    int64_t geometry_bytes_ = 0;                 // guarded by mu_: KvReceiveGeometryBytes
};

}  // namespace kvshard::internal
