// The receiving side of one TCP KV connection (comm/tcp_kv_session.h).
// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on
#include "comm/tcp_kv_session.h"

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <vector>

#include "comm/kv_hash.h"
#include "comm/shm_region.h"
#include "comm/tcp_kv_wire.h"
#include "common/logging.h"

namespace kvshard::internal {

namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// Refused payloads are read off the socket in chunks of this size (never allocated whole).
constexpr size_t kDrainChunkBytes = 64 * 1024;
// Accepted payloads are read in chunks of this size, so that the memory a piece takes grows with
// the bytes that arrived, not with what its header claims (unless a pooled buffer, memory this
// side already holds, takes the whole piece); each chunk is hashed while it is in cache.
constexpr size_t kPayloadChunkBytes = 1 << 20;

}  // namespace

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
// They are measured on KvTransportOptions::clock: on the real clock a timer fires; on a virtual
// one nothing fires by itself, and each move of the clock ends the sessions it took past their
// deadline (ExpireTcpKvSessions).
class TcpKvSession : public std::enable_shared_from_this<TcpKvSession> {
  public:
    TcpKvSession(tcp::socket socket, KvStaging* staging, const KvTransportOptions* options,
                 TcpKvSessions* live)
        : socket_(std::move(socket)),
          timer_(socket_.get_executor()),
          clock_(options->clock != nullptr ? *options->clock : Clock::Real()),
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

    // I/O thread, on a virtual clock: ends the connection if `now` reached its deadline.
    void ExpireIfDue(Clock::time_point now) {
        if (ended_ || deadline_why_ == nullptr || now < deadline_) return;
        Expire(deadline_why_);
    }

  private:
    // Closes the connection with `why` unless the next Arm (or End) comes first.
    void Arm(int64_t ms, const char* why) {
        const uint64_t generation = ++timer_generation_;
        if (clock_.is_virtual()) {
            deadline_ = clock_.Now() + std::chrono::milliseconds(ms);
            deadline_why_ = why;
            return;
        }
        timer_.expires_after(std::chrono::milliseconds(ms));
        timer_.async_wait(
            [self = shared_from_this(), generation, why](const boost::system::error_code& ec) {
                if (ec || generation != self->timer_generation_) return;
                self->Expire(why);
            });
    }

    void Expire(const char* why) {
        End(std::string(why) + " (" + std::to_string(reserved_ ? have_ : 0) + " payload bytes in)");
    }

    void ReadHello() {
        asio::async_read(socket_, asio::buffer(hello_),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) return self->End("closed during the hello: " + ec.message());
                             self->OnHelloHeader();
                         });
    }

    void OnHelloHeader() {
        Result<uint16_t> token_bytes = DecodeKvHelloHeader(hello_);
        if (!token_bytes.ok()) return End("malformed hello: " + token_bytes.status().ToString());
        token_.assign(*token_bytes, '\0');
        asio::async_read(socket_, asio::buffer(token_),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) return self->End("closed during the hello: " + ec.message());
                             self->OnHello();
                         });
    }

    void OnHello() {
        const bool accepted = options_->token.empty() || KvTokensEqual(options_->token, token_);
        std::string().swap(token_);
        if (!accepted) {
            // Refused as an ordinary answer, so the sender can say why; then closed.
            return Refuse(0, InvalidArgument("KV transport: the hello's token is not this "
                                             "deployment's"));
        }
        // The boot id tells the sender whether a shared-memory region could reach this side.
        WriteAck(0, Status(StatusCode::kOk, options_->shared_memory ? KvHostBootId() : ""),
                 /*then_close=*/false);
    }

    // Between frames: the connection holds nothing, so it may idle for idle_timeout_ms.
    void ReadFrame() {
        Arm(options_->idle_timeout_ms, "idle for idle_timeout_ms");
        asio::async_read(socket_, asio::buffer(frame_.data(), kKvFrameMagicBytes),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) {
                                 // Closed between frames: the sender is done with us.
                                 return self->End(ec == asio::error::eof ? "" : ec.message());
                             }
                             self->OnMagic();
                         });
    }

    void OnMagic() {
        Result<KvFrameKind> kind = DecodeKvFrameKind(frame_.data());
        if (!kind.ok()) return End("malformed KV frame: " + kind.status().ToString());
        Arm(options_->read_timeout_ms, "stalled mid-frame for read_timeout_ms");
        const size_t rest = KvFrameHeaderBytes(*kind) - kKvFrameMagicBytes;
        asio::async_read(
            socket_, asio::buffer(frame_.data() + kKvFrameMagicBytes, rest),
            [self = shared_from_this(), kind = *kind](const boost::system::error_code& ec,
                                                      size_t n) {
                if (ec) {
                    return self->End("closed mid-header after " + std::to_string(n) +
                                     " bytes: " + ec.message());
                }
                switch (kind) {
                    case KvFrameKind::kTransfer:
                        return self->OnTransferFrame();
                    case KvFrameKind::kPiece:
                        return self->OnPieceHeader();
                    case KvFrameKind::kOffer:
                        return self->OnOfferHeader();
                    case KvFrameKind::kChunk:
                        // Chunks belong to a piece; between pieces one is garbage.
                        return self->End("malformed KV frame: a chunk outside a piece");
                }
            });
    }

    void OnTransferFrame() {
        KvTransferFrame bytes{};
        std::copy_n(frame_.begin(), bytes.size(), bytes.begin());
        Result<uint64_t> id = DecodeKvTransferFrame(bytes);
        if (!id.ok()) return End("malformed KV frame: " + id.status().ToString());
        transfer_id_ = *id;
        ReadFrame();
    }

    void OnPieceHeader() {
        Result<DecodedKvPieceFrame> frame = DecodeKvPieceFrameHeader(frame_);
        if (!frame.ok()) {
            // A header that contradicts itself: nothing after it can be trusted.
            return Refuse(KvPieceFrameTransferId(frame_), frame.status());
        }
        decoded_ = *frame;
        const uint64_t id = decoded_.header.transfer_id;
        if (!transfer_id_.has_value() || *transfer_id_ != id) {
            return Refuse(
                id, Status(StatusCode::kNotFound, "KV piece of transfer " + std::to_string(id) +
                                                      ", which this connection did not name"));
        }
        if (decoded_.in_region && !region_.valid()) {
            return Refuse(id, InvalidArgument("KV piece through a shared-memory region, but this "
                                              "connection has none"));
        }
        have_ = 0;
        Status admitted = staging_->Reserve(decoded_.header);
        if (admitted.code() == StatusCode::kInvalidArgument) {
            // Does not fit this pool: a sender that means well never sends it.
            return Refuse(id, admitted);
        }
        if (!admitted.ok()) {
            // A verdict on the transfer (full, discarded): the stream stays in step, so read the
            // payload off without keeping it, then answer.
            refusal_ = std::move(admitted);
            if (decoded_.in_region) {
                discarding_ = true;
                return ReadChunk();
            }
            drain_left_ = decoded_.payload_bytes;
            scratch_.resize(std::min<uint64_t>(drain_left_, kDrainChunkBytes));
            return Drain();
        }
        reserved_ = true;
        discarding_ = false;
        piece_ = KvPiece();
        piece_.header = decoded_.header;
        std::optional<std::vector<uint8_t>> pooled =
            staging_->TakePooledBuffer(static_cast<size_t>(decoded_.payload_bytes));
        if (pooled.has_value()) {
            piece_.data = std::move(*pooled);
        } else {
            // Capacity only (address space; pages are touched as bytes arrive), bounded by
            // Reserve.
            piece_.data.reserve(static_cast<size_t>(decoded_.payload_bytes));
        }
        if (decoded_.in_region) return ReadChunk();
        XXH3_64bits_reset(hash_.get());
        ReadPayload();
    }

    // Makes room for `n` more payload bytes at have_ (a pooled buffer has it already).
    uint8_t* PayloadAt(size_t n) {
        if (piece_.data.size() < have_ + n) piece_.data.resize(have_ + n);
        return piece_.data.data() + have_;
    }

    void ReadPayload() {
        const size_t total = static_cast<size_t>(decoded_.payload_bytes);
        if (have_ == total) return OnPayload(XXH3_64bits_digest(hash_.get()));
        const size_t chunk = std::min(total - have_, kPayloadChunkBytes);
        uint8_t* at = PayloadAt(chunk);
        asio::async_read(
            socket_, asio::buffer(at, chunk),
            [self = shared_from_this(), at](const boost::system::error_code& ec, size_t n) {
                if (ec) {
                    return self->End("closed mid-payload after " + std::to_string(self->have_ + n) +
                                     " of " + std::to_string(self->decoded_.payload_bytes) +
                                     " bytes: " + ec.message());
                }
                XXH3_64bits_update(self->hash_.get(), at, n);
                self->have_ += n;
                self->ReadPayload();
            });
    }

    // A piece through the region: chunk frames until the payload is complete. Each chunk is
    // checked against the piece (no more than its payload) and the region (inside its announced
    // size), copied out of the mapped region and hashed in cache-sized pieces (one pass), and
    // credited, so the sender may overwrite it; the last one is answered by the piece's
    // acknowledgement (an uncredited piece's chunks get no credits: its sender reuses no slot
    // within it). A refused piece's chunks are credited without being read.
    void ReadChunk() {
        asio::async_read(socket_, asio::buffer(chunk_frame_),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) return self->End("closed mid-piece: " + ec.message());
                             self->OnChunk();
                         });
    }

    void OnChunk() {
        Result<KvChunk> chunk = DecodeKvChunkFrame(chunk_frame_);
        if (!chunk.ok()) return End("malformed KV chunk frame: " + chunk.status().ToString());
        const uint64_t total = decoded_.payload_bytes;
        if (chunk->bytes > total - have_) {
            return End("malformed KV chunk frame: " + std::to_string(chunk->bytes) +
                       " bytes where the piece has " + std::to_string(total - have_) + " left");
        }
        if (chunk->region_offset > static_cast<uint64_t>(region_.bytes()) ||
            chunk->bytes > static_cast<uint64_t>(region_.bytes()) - chunk->region_offset) {
            return End("malformed KV chunk frame: bytes [" + std::to_string(chunk->region_offset) +
                       ", +" + std::to_string(chunk->bytes) + ") outside the region of " +
                       std::to_string(region_.bytes()));
        }
        const auto n = static_cast<size_t>(chunk->bytes);
        if (!discarding_) {
            uint8_t* at = PayloadAt(n);
            Result<uint64_t> copied = region_.CopyOut(static_cast<int64_t>(chunk->region_offset),
                                                      static_cast<int64_t>(n), at);
            if (!copied.ok()) return End(copied.status().ToString());
            if (*copied != chunk->hash) {
                return End("malformed KV chunk frame: hash mismatch (transfer " +
                           std::to_string(decoded_.header.transfer_id) + ")");
            }
        }
        have_ += n;
        if (have_ < total && decoded_.uncredited) return ReadChunk();
        if (have_ < total) {
            credit_ = EncodeKvCreditFrame(chunk->region_offset);
            asio::async_write(
                socket_, asio::buffer(credit_),
                [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                    if (ec) return self->End("credit not written: " + ec.message());
                    self->ReadChunk();
                });
            return;
        }
        if (discarding_) {
            discarding_ = false;
            return WriteAck(decoded_.header.transfer_id, refusal_, /*then_close=*/false);
        }
        OnPayload(std::nullopt);
    }

    // An offer of a shared-memory region: its name follows the fixed header.
    void OnOfferHeader() {
        std::array<uint8_t, kKvOfferFrameHeaderBytes> bytes{};
        std::copy_n(frame_.begin(), bytes.size(), bytes.begin());
        Result<DecodedKvOfferHeader> offer = DecodeKvOfferFrameHeader(bytes);
        if (!offer.ok()) return Refuse(0, offer.status());
        offer_ = *offer;
        token_.assign(offer_.name_bytes, '\0');  // the hello's buffer, free since then
        asio::async_read(socket_, asio::buffer(token_),
                         [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                             if (ec) return self->End("closed during an offer: " + ec.message());
                             self->OnOffer();
                         });
    }

    void OnOffer() {
        const std::string name = std::move(token_);
        token_.clear();
        if (!options_->shared_memory || KvHostBootId().empty()) {
            return WriteAck(0, Unimplemented("KV transport: shared memory is off at this receiver"),
                            /*then_close=*/false);
        }
        Result<KvShmReceiverRegion> region =
            KvShmReceiverRegion::Open(name, static_cast<int64_t>(offer_.region_bytes));
        if (!region.ok()) {
            // A claim outside the agreement is a protocol violation; a region this side cannot
            // open (another process namespace) just means the socket carries the payloads.
            if (region.status().code() == StatusCode::kInvalidArgument) {
                return Refuse(0, region.status());
            }
            return WriteAck(0, region.status(), /*then_close=*/false);
        }
        region_ = std::move(*region);
        WriteAck(0, Status::Ok(), /*then_close=*/false);
    }

    // `hash`: of the payload read off the socket (checked against the header's); none for a
    // piece through the region (each chunk was checked).
    void OnPayload(std::optional<uint64_t> hash) {
        if (hash.has_value() && *hash != decoded_.payload_hash) {
            return End("malformed KV frame: payload hash mismatch (transfer " +
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
        ack_ = EncodeKvAckFrame(transfer_id, status);
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
        region_ = KvShmReceiverRegion();
        std::vector<uint8_t>().swap(scratch_);
        if (!why.empty()) spdlog::warn("KV transport: connection from {} closed: {}", peer_, why);
        Close();
        live_->erase(shared_from_this());
    }

    tcp::socket socket_;
    asio::steady_timer timer_;
    uint64_t timer_generation_ = 0;  // a wait armed under another generation is stale
    const Clock& clock_;             // the deadlines' (KvTransportOptions::clock)
    // The deadline last armed, on a virtual clock_ (the timer's on the real one), and its reason.
    Clock::time_point deadline_{};
    const char* deadline_why_ = nullptr;
    KvStaging* const staging_;
    const KvTransportOptions* const options_;  // the transport's
    TcpKvSessions* const live_;                // the transport's, I/O thread only
    std::string peer_;
    bool ended_ = false;
    std::array<uint8_t, kKvHelloHeaderBytes> hello_{};
    std::string token_;
    // The transfer this connection named last (its pieces are the only ones accepted).
    std::optional<uint64_t> transfer_id_;
    KvPieceFrameHeader frame_{};  // also holds a transfer or offer frame's header
    DecodedKvPieceFrame decoded_;
    KvPiece piece_;
    size_t have_ = 0;  // payload bytes of piece_ arrived
    // Of the payload read off the socket so far (libxxhash's opaque streaming state).
    std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> hash_{XXH3_createState(),
                                                                          XXH3_freeState};
    bool discarding_ = false;  // a refused region piece: its chunks are credited unread
    DecodedKvOfferHeader offer_;
    KvShmReceiverRegion region_;  // the region this connection's sender offered, if any
    KvChunkFrame chunk_frame_{};
    KvCreditFrame credit_{};
    bool reserved_ = false;  // staging holds a reservation for decoded_.header
    Status refusal_;
    uint64_t drain_left_ = 0;
    std::vector<uint8_t> scratch_;
    std::string ack_;
};

void StartTcpKvSession(tcp::socket socket, KvStaging* staging, const KvTransportOptions* options,
                       TcpKvSessions* live) {
    auto session = std::make_shared<TcpKvSession>(std::move(socket), staging, options, live);
    live->insert(session);
    session->Start();
}

void CloseTcpKvSessions(const TcpKvSessions& live) {
    for (const std::shared_ptr<TcpKvSession>& session : live) session->Close();
}

void ExpireTcpKvSessions(const TcpKvSessions& live, Clock::time_point now) {
    // A session that ends leaves `live`: walk a copy.
    const std::vector<std::shared_ptr<TcpKvSession>> sessions(live.begin(), live.end());
    for (const std::shared_ptr<TcpKvSession>& session : sessions) session->ExpireIfDue(now);
}

}  // namespace kvshard::internal
