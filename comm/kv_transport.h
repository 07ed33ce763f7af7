// KvTransport: moves pieces of KV cache from a rank of one instance (a prefill instance) to a rank
// of another (a decode instance) — DESIGN.md data flow step 6. A piece is some layers × some KV
// heads of a list of blocks, self-describing, so the receiver can write it into its own blocks
// whatever the sender's tensor-parallel layout was.
//
// Delivery is decoupled from the receiver's steps: each transport stages arriving pieces in
// memory, keyed by transfer id, until the receiving worker's step asks for them with Receive. So a
// sender never waits for the receiver's step loop (no cross-instance deadlock) and the receiver
// never waits for the sender's step either, only for bytes already on their way.
//
// Implementations: LocalKvTransport (ranks of this process: one memcpy into the receiver's
// staging) and TcpKvTransport (worker processes: Boost.Asio, one listening port per rank; between
// processes of one host the payloads go through a shared-memory region named over the TCP
// session, comm/shm_region.h). GPUs: comm/nccl_kv_transport.h (ncclSend/ncclRecv between paired
// ranks). Staging buffers are pooled: a receiver that gives its received pieces back (Recycle)
// has later pieces land in memory that is already mapped, with no allocation per piece.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/kv_dtype.h"
#include "common/status.h"

namespace kvshard {

// The KV dtype's byte on the wire, explicit and stable: fp32 0, int8 1, fp8 2, fp16 3, bf16 4.
uint8_t KvDtypeWireCode(KvDtype dtype);
// The dtype a wire byte names; InvalidArgument naming the byte for any other value (a frame's
// header comes from the network).
Result<KvDtype> KvDtypeFromWireCode(uint8_t code);

struct KvPieceHeader {
    uint64_t transfer_id = 0;
    int32_t layer_begin = 0;  // layers [layer_begin, layer_end)
    int32_t layer_end = 0;
    int32_t head_begin = 0;  // global KV heads [head_begin, head_end)
    int32_t head_end = 0;
    int32_t num_blocks = 0;
    int32_t block_size = 0;
    int32_t head_dim = 0;
    KvDtype dtype = KvDtype::kFp32;  // as stored in the pools; both sides use the same
    friend bool operator==(const KvPieceHeader&, const KvPieceHeader&) = default;
};

// The payload layout, for each block in order, for each layer in order:
//   K [head][slot][head_dim] elements, V likewise, then (8-bit only) K scales [head][slot]
//   floats, V scales likewise
// which is the pool's per-layer layout (kernels/paged_attention.h) restricted to the piece's heads:
// with all of a rank's heads, one block-layer of a piece is one memcpy from the pool.
struct KvPiece {
    KvPieceHeader header;
    std::vector<uint8_t> data;
};

// Bytes of one block-layer of a piece, and of the whole piece:
//   blocks × layers × 2 × heads × block_size × head_dim × element bytes (+ 2 × heads × block_size
//   × 4 for the scales of dtypes with KvPoolHasScales).
int64_t KvPieceLayerBytes(const KvPieceHeader& h);
int64_t KvPieceBytes(const KvPieceHeader& h);
// InvalidArgument naming the field: non-positive sizes, empty or inverted ranges, data of the
// wrong size.
Status ValidateKvPiece(const KvPiece& piece);

// What a receiving rank's KV pool can hold: every arriving piece is checked against it before
// anything is allocated for it (KvTransport::SetReceiveGeometry).
struct KvReceiveGeometry {
    int32_t num_layers = 0;  // layers of the model
    int32_t head_begin = 0;  // global KV heads this rank holds: [head_begin, head_end)
    int32_t head_end = 0;
    int32_t block_size = 0;  // token slots per block
    int32_t head_dim = 0;
    KvDtype dtype = KvDtype::kFp32;
    int64_t num_blocks = 0;  // blocks of this rank's pool
};
// InvalidArgument naming the field: non-positive sizes, an empty head range, a bad dtype.
Status ValidateKvReceiveGeometry(const KvReceiveGeometry& geometry);
// Bytes of every block of the pool with all of its layers and heads: the most one transfer, or
// everything staged, can usefully be. REQUIRES: a valid geometry.
int64_t KvReceiveGeometryBytes(const KvReceiveGeometry& geometry);
// Whether a piece with this (otherwise valid) header can be written into such a pool:
// InvalidArgument naming the field otherwise (dtype, block_size, head_dim other than the pool's;
// layers or heads outside it; more blocks than the pool has).
Status ValidateKvPieceFits(const KvPieceHeader& header, const KvReceiveGeometry& geometry);

struct KvTransportOptions {
    // Bytes staged (received, not yet taken by Receive) at most; a piece beyond it is refused and
    // its sender gets ResourceExhausted, so a receiver that stopped taking cannot exhaust memory.
    // With a receive geometry the limit is also at most the pool's bytes.
    int64_t max_staged_bytes = int64_t{1} << 30;
    // Transfers staged at once at most (with a receive geometry also at most the pool's blocks,
    // as each transfer fills one block at least); a piece of one more is ResourceExhausted.
    int64_t max_staged_transfers = 4'096;
    // A transfer no piece arrived for within this long, and no Receive waits for, is dropped
    // (it was abandoned) and treated as discarded. Checked lazily, on any call.
    int64_t stale_after_ms = 120'000;

    // TCP only. The secret of this deployment: a sender presents it when it opens a connection
    // and a receiver closes connections that present another. Empty: any sender is accepted
    // (loopback and tests); the handshake is still required.
    std::string token;
    // TCP only. A frame (the handshake, a piece's header and payload) must arrive whole within
    // this long once its first bytes did; a stalled connection is closed and what it had
    // reserved is given back.
    int64_t read_timeout_ms = 30'000;
    // TCP only. A connection that sends nothing for this long between frames is closed (it holds
    // no staging; a sender reopens its connection on the next Send).
    int64_t idle_timeout_ms = 600'000;
    // TCP only. What read_timeout_ms and idle_timeout_ms are measured on; null: Clock::Real().
    // On a VirtualClock no connection's deadline passes until the clock's driver moves it past
    // (each move closes those it passed before it returns). Not owned; outlives the transport.
    const Clock* clock = nullptr;
    // TCP only. Accepted connections at once at most; more are closed as they arrive.
    int64_t max_connections = 1'024;
    // TCP only. Between processes of one host (the receiver's boot id, sent in the handshake,
    // equals the sender's, and the receiver can open the sender's region), payloads go
    // through a shared-memory region of shm_region_bytes per connection instead of the socket;
    // otherwise, or when false on either side, over the socket. Set false where the peers share a
    // kernel but must not share memory.
    bool shared_memory = true;
    // TCP only. The sender's region per destination, in [64 KiB, 256 MiB]: split in 4 slots that
    // the sender fills while the receiver copies out the previous ones.
    int64_t shm_region_bytes = int64_t{16} << 20;
};

class KvTransport {
  public:
    virtual ~KvTransport() = default;

    // Where other ranks send pieces for this one ("local:NAME" or "HOST:PORT").
    virtual const std::string& endpoint() const = 0;

    // Hands `piece` to the rank at `dst_endpoint` and returns once that rank staged or refused
    // it (TCP: its acknowledgement arrived); the caller's buffers are free to reuse after it
    // returns. A piece whose transfer, layers and heads are already staged there is dropped as
    // a resend (OK), so a sender may retry a piece whose outcome it did not learn.
    // Errors: DeadlineExceeded, Unavailable (no such endpoint, connection refused or dropped),
    // ResourceExhausted (receiver's staging full), Aborted (the receiver discarded the transfer
    // or dropped it as stale: stop sending it), InvalidArgument (malformed piece or endpoint).
    virtual Status Send(const std::string& dst_endpoint, const KvPiece& piece,
                        std::chrono::steady_clock::time_point deadline) = 0;

    // Like Send, but may return before the receiver's verdict: once the piece is on its way and
    // the caller's buffers are free to reuse (TCP through a shared-memory region: its payload is
    // in the region), so that the next piece travels while the receiver still copies this one
    // out. The verdicts of a transfer's pieces are collected by Flush, which a sender must call
    // before it relies on the transfer having arrived. The pieces awaiting a verdict are bounded
    // per destination (by the region and a count; a call waits, under its deadline, for room).
    // Errors: those of Send for this piece, and the first failed verdict of an earlier piece of
    // the same transfer to that destination, if one arrived already (this piece is then not
    // sent). The default is Send.
    virtual Status SendPipelined(const std::string& dst_endpoint, const KvPiece& piece,
                                 std::chrono::steady_clock::time_point deadline) {
        return Send(dst_endpoint, piece, deadline);
    }

    // Waits until every piece of `transfer_id` sent to `dst_endpoint` with SendPipelined has its
    // verdict and returns the first failed one (Send's errors; a connection lost or the deadline
    // passed before a verdict: Unavailable or DeadlineExceeded, and the connection is closed, so
    // nothing of the transfer is left in flight). OK when every piece was staged (or there were
    // none). The default has nothing to wait for.
    virtual Status Flush(const std::string& dst_endpoint, uint64_t transfer_id,
                         std::chrono::steady_clock::time_point deadline) {
        (void)dst_endpoint;
        (void)transfer_id;
        (void)deadline;
        return Status::Ok();
    }

    // Waits until pieces of `transfer_id` covering `expected_cells` (layers × heads, summed over
    // pieces) are staged, then removes and returns them. DeadlineExceeded when they have not all
    // arrived by `deadline` (what arrived stays staged until Discard or staleness); Aborted when
    // the transfer was discarded or went stale. A transfer does not go stale while a Receive
    // waits for it.
    virtual Result<std::vector<KvPiece>> Receive(
        uint64_t transfer_id, int64_t expected_cells,
        std::chrono::steady_clock::time_point deadline) = 0;

    // Drops whatever is staged for `transfer_id`, and pieces of it that arrive later.
    virtual void Discard(uint64_t transfer_id) = 0;

    // Gives the buffers of pieces that Receive returned back to this transport, to stage later
    // pieces in (bounded pool; see KvStaging). Optional: pieces simply dropped are freed. The
    // default frees them.
    virtual void Recycle(std::vector<KvPiece> pieces) { (void)pieces; }

    // Bytes currently staged (for tests and metrics).
    virtual int64_t staged_bytes() const = 0;
    // Bytes reserved for pieces still arriving (TCP: a header was accepted, its payload is being
    // read), for tests and metrics. 0 whenever no piece is mid-delivery.
    virtual int64_t arriving_bytes() const = 0;

    // Tells the receiving side what its KV pool can hold, once the pool exists; from then on a
    // piece that does not fit it (ValidateKvPieceFits) is refused before anything is allocated
    // for it (TCP: the connection is closed with the reason logged and acknowledged), and the
    // staging limits shrink to the pool's (KvTransportOptions). Until then only the options'
    // limits and the piece's own consistency are checked. InvalidArgument for a bad geometry.
    virtual Status SetReceiveGeometry(const KvReceiveGeometry& geometry) = 0;
};

// In-process transport: registers `name` so that Send("local:" + name, ...) from any transport of
// this process reaches it; unregisters on destruction. InvalidArgument for an empty name or a
// name in use (common/status.h has no AlreadyExists).
Result<std::unique_ptr<KvTransport>> MakeLocalKvTransport(const std::string& name,
                                                          const KvTransportOptions& options = {});

// TCP transport: listens on host:port (0: a free port; endpoint() then names the real one) with an
// I/O thread that stages arriving pieces. Connections to peers are opened on first Send and kept.
// Each connection opens with a handshake (magic "KVSH", a version, options.token) that the
// receiver acknowledges; before the pieces of a transfer the sender names the transfer ("KVST");
// a piece travels as one frame: magic "KVSP", a version, the header fields, the payload length
// and an XXH3-64 hash of the payload; the receiver answers each with an acknowledgement frame
// carrying its status. Same host (options.shared_memory): the handshake's answer carries the
// receiver's boot id; when it is the sender's, the sender offers a shared-memory region (a sealed
// memfd) by name and size ("KVSM"), the receiver opens and maps it read-only (refusing a claim
// over the agreed maximum, other than the file's real size, or a file not sealed against
// shrinking); pieces' payloads then go through
// it in chunks ("KVSC", each with its own hash), each credited back ("KVSF") once copied out, so
// that the sender never overwrites what the receiver still reads. A receiver that cannot open the
// region (another process namespace) refuses the offer and the connection carries payloads
// itself. A
// malformed frame, a wrong token, a piece of a transfer not named on that connection, a piece that
// does not fit the receive geometry, or a connection stalled mid-frame past read_timeout_ms closes
// that connection (never crashes). Sends to one destination are serialized; a Send that misses its
// deadline closes that connection. Through a region, SendPipelined returns once the payload is in
// the region, and the next piece's chunks follow before the previous verdict: the region is a
// ring freed in order by credits and acknowledgements, which later calls read. Endpoints are
// "HOST:PORT" (InvalidArgument otherwise).
Result<std::unique_ptr<KvTransport>> MakeTcpKvTransport(const std::string& host, uint16_t port,
                                                        const KvTransportOptions& options = {});

}  // namespace kvshard
