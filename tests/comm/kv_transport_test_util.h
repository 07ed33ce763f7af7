// Helpers shared by the KV transport tests (kv_piece_wire_test.cc, kv_staging_test.cc and the
// tcp_kv_*_test.cc files): pieces whose bytes depend on their whole header, a TCP transport on a
// free loopback port, the frames a hand-written peer sends, and RawPeer, that peer on a raw socket.
#pragma once

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/kv_transport.h"
#include "comm/tcp_kv_wire.h"
#include "common/check.h"
#include "common/clock.h"

namespace kvshard::testing {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

inline Clock::time_point In(int64_t ms) { return Clock::now() + milliseconds(ms); }

inline KvPieceHeader Header(uint64_t transfer_id, int32_t layer_begin, int32_t layer_end,
                            int32_t head_begin, int32_t head_end, KvDtype dtype = KvDtype::kFp32) {
    KvPieceHeader h;
    h.transfer_id = transfer_id;
    h.layer_begin = layer_begin;
    h.layer_end = layer_end;
    h.head_begin = head_begin;
    h.head_end = head_end;
    h.num_blocks = 2;
    h.block_size = 4;
    h.head_dim = 8;
    h.dtype = dtype;
    return h;
}

// A valid piece whose bytes depend on all of its header, so a mix-up shows.
inline KvPiece Piece(uint64_t transfer_id, int32_t layer_begin, int32_t layer_end,
                     int32_t head_begin, int32_t head_end) {
    KvPiece piece;
    piece.header = Header(transfer_id, layer_begin, layer_end, head_begin, head_end);
    piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
    for (size_t i = 0; i < piece.data.size(); ++i) {
        piece.data[i] =
            static_cast<uint8_t>(i * 7 + transfer_id * 13 + layer_begin * 31 + head_begin * 17);
    }
    return piece;
}

// An in-process transport named `name`.
inline std::unique_ptr<KvTransport> Local(const std::string& name,
                                          KvTransportOptions options = {}) {
    Result<std::unique_ptr<KvTransport>> t = MakeLocalKvTransport(name, options);
    KV_CHECK(t.ok()) << t.status().ToString();
    return std::move(t).value();
}

// The pool Header()/Piece() pieces are cut from: 4 layers, KV heads [0, 6), blocks of 4 slots ×
// 8 dims in f32, 16 blocks.
inline KvReceiveGeometry TestGeometry() {
    KvReceiveGeometry g;
    g.num_layers = 4;
    g.head_begin = 0;
    g.head_end = 6;
    g.block_size = 4;
    g.head_dim = 8;
    g.dtype = KvDtype::kFp32;
    g.num_blocks = 16;
    return g;
}

inline std::unique_ptr<KvTransport> Tcp(KvTransportOptions options = {}) {
    Result<std::unique_ptr<KvTransport>> t = MakeTcpKvTransport("127.0.0.1", 0, options);
    KV_CHECK(t.ok()) << t.status().ToString();
    return std::move(t).value();
}

inline uint16_t PortOf(const KvTransport& t) {
    return static_cast<uint16_t>(std::stoi(t.endpoint().substr(t.endpoint().rfind(':') + 1)));
}

inline std::vector<uint8_t> Bytes(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    return std::vector<uint8_t>(p, p + n);
}

inline std::vector<uint8_t> Concat(std::initializer_list<std::vector<uint8_t>> parts) {
    std::vector<uint8_t> out;
    for (const std::vector<uint8_t>& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
}

inline std::vector<uint8_t> HelloBytes(const std::string& token = "") {
    const std::string hello = internal::EncodeKvHello(token);
    return Bytes(hello.data(), hello.size());
}

inline std::vector<uint8_t> TransferBytes(uint64_t id) {
    const internal::KvTransferFrame f = internal::EncodeKvTransferFrame(id);
    return Bytes(f.data(), f.size());
}

inline std::vector<uint8_t> HeaderBytes(const KvPieceHeader& h, uint64_t payload_bytes,
                                        uint64_t hash = 0, uint8_t flags = 0) {
    const internal::KvPieceFrameHeader f =
        internal::EncodeKvPieceFrameHeader(h, payload_bytes, hash, flags);
    return Bytes(f.data(), f.size());
}

inline std::vector<uint8_t> PieceBytes(const KvPiece& piece) {
    return Concat(
        {HeaderBytes(piece.header, piece.data.size(), internal::KvPayloadHash(piece.data)),
         piece.data});
}

// A hand-written sender on a raw socket: what a hostile or broken peer can do.
class RawPeer {
  public:
    explicit RawPeer(uint16_t port) : socket_(io_) {
        socket_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    }

    void Write(const std::vector<uint8_t>& bytes) {
        boost::system::error_code ignored;  // a receiver that already closed is what tests check
        asio::write(socket_, asio::buffer(bytes), ignored);
    }

    // The next acknowledgement's status (Internal when none came, e.g. the connection closed).
    Status ReadAck() {
        std::array<uint8_t, internal::kKvAckFrameHeaderBytes> header{};
        if (!ReadExactly(header.data(), header.size())) {
            return Status(StatusCode::kInternal, "no acknowledgement");
        }
        Result<internal::DecodedKvAckHeader> ack = internal::DecodeKvAckFrameHeader(header);
        if (!ack.ok()) return Status(StatusCode::kInternal, ack.status().ToString());
        std::string message(ack->message_bytes, '\0');
        if (!ReadExactly(message.data(), message.size())) {
            return Status(StatusCode::kInternal, "acknowledgement cut short");
        }
        return ack->code == StatusCode::kOk ? Status::Ok() : Status(ack->code, message);
    }

    // Whether the transport closed the connection within `bound` (reads and drops anything
    // before the end). The default is a bound against a hang, not a synchronization.
    bool Closed(milliseconds bound = milliseconds(10'000)) {
        std::array<uint8_t, 256> buffer{};
        bool closed = false;
        bool reading = true;  // until the read ends: closed, or cancelled past the bound
        bool stop = false;    // past the bound: the read is not issued again
        std::function<void()> read = [&] {
            socket_.async_read_some(asio::buffer(buffer),
                                    [&](const boost::system::error_code& ec, size_t) {
                                        if (ec || stop) {
                                            closed = ec && ec != asio::error::operation_aborted;
                                            reading = false;
                                            return;
                                        }
                                        read();
                                    });
        };
        read();
        io_.restart();
        io_.run_for(bound);
        if (reading) {
            // Still open: the pending read ends here, as its handler refers to this frame.
            stop = true;
            boost::system::error_code ignored;
            socket_.cancel(ignored);
            io_.restart();
            io_.run();
        }
        return closed;
    }

  private:
    bool ReadExactly(void* data, size_t n) {
        bool ok = false;
        asio::async_read(socket_, asio::buffer(data, n),
                         [&](const boost::system::error_code& ec, size_t) { ok = !ec; });
        io_.restart();
        io_.run_for(milliseconds(10'000));  // a bound against a hang
        return ok;
    }

    asio::io_context io_;
    tcp::socket socket_;
};

// Whether `done()` came true within `bound` (a bound against a hang: it polls).
template <typename Done>
inline bool Eventually(Done done, milliseconds bound = milliseconds(10'000)) {
    const Clock::time_point deadline = Clock::now() + bound;
    while (!done()) {
        if (Clock::now() >= deadline) return false;
        std::this_thread::sleep_for(milliseconds(1));
    }
    return true;
}

// Moves `clock` on by `step` until `peer` sees its connection closed (20 moves at most). A move
// closes the connections whose deadline it passed before it returns; a connection whose deadline
// was armed after a move (its session had not read the peer's bytes yet) is closed by the next.
inline bool ClosedAsTheClockMoves(VirtualClock& clock, RawPeer& peer, milliseconds step) {
    for (int moves = 0; moves < 20; ++moves) {
        clock.Advance(step);
        if (peer.Closed(milliseconds(500))) return true;
    }
    return false;
}

}  // namespace kvshard::testing
