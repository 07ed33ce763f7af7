// KV transports (comm/kv_transport.h): the piece arithmetic, the staging semantics shared by
// every transport, the in-process transport and the TCP transport over loopback.
#include "comm/kv_transport.h"

#include <gtest/gtest.h>

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on
#include <map>
#include <thread>

#include "comm/kv_staging.h"
#include "comm/tcp_kv_wire.h"

namespace kvshard {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Clock::time_point In(int64_t ms) { return Clock::now() + milliseconds(ms); }

KvPieceHeader Header(uint64_t transfer_id, int32_t layer_begin, int32_t layer_end,
                     int32_t head_begin, int32_t head_end, KvWireDtype dtype = KvWireDtype::kF32) {
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
KvPiece Piece(uint64_t transfer_id, int32_t layer_begin, int32_t layer_end, int32_t head_begin,
              int32_t head_end) {
    KvPiece piece;
    piece.header = Header(transfer_id, layer_begin, layer_end, head_begin, head_end);
    piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
    for (size_t i = 0; i < piece.data.size(); ++i) {
        piece.data[i] =
            static_cast<uint8_t>(i * 7 + transfer_id * 13 + layer_begin * 31 + head_begin * 17);
    }
    return piece;
}

// ---- piece arithmetic ----

TEST(KvPiece, ByteFormulas) {
    struct Case {
        KvWireDtype dtype;
        int32_t blocks, layers, heads, block_size, head_dim;
        int64_t element_bytes, layer_bytes;
    };
    const Case cases[] = {
        {KvWireDtype::kF32, 3, 2, 4, 16, 64, 4, 2 * 4 * 16 * 64 * 4},
        {KvWireDtype::kInt8, 3, 2, 4, 16, 64, 1, 2 * 4 * 16 * 64 + 2 * 4 * 16 * 4},
        {KvWireDtype::kFp8E4M3, 1, 5, 1, 32, 128, 1, 2 * 32 * 128 + 2 * 32 * 4},
        {KvWireDtype::kF32, 1, 1, 1, 1, 1, 4, 8},
    };
    for (const Case& c : cases) {
        KvPieceHeader h;
        h.dtype = c.dtype;
        h.num_blocks = c.blocks;
        h.layer_begin = 7;
        h.layer_end = 7 + c.layers;
        h.head_begin = 2;
        h.head_end = 2 + c.heads;
        h.block_size = c.block_size;
        h.head_dim = c.head_dim;
        EXPECT_EQ(KvWireElementBytes(c.dtype), c.element_bytes);
        EXPECT_EQ(KvPieceLayerBytes(h), c.layer_bytes);
        EXPECT_EQ(KvPieceBytes(h), int64_t{c.blocks} * c.layers * c.layer_bytes);
    }
}

TEST(KvPiece, ValidateRejectsEachBadField) {
    struct Case {
        const char* name;
        void (*mutate)(KvPiece&);
        const char* message_part;
    };
    const Case cases[] = {
        {"negative layer", [](KvPiece& p) { p.header.layer_begin = -1; }, "layer_begin=-1"},
        {"empty layers", [](KvPiece& p) { p.header.layer_end = p.header.layer_begin; }, "layers"},
        {"negative head", [](KvPiece& p) { p.header.head_begin = -2; }, "head_begin=-2"},
        {"inverted heads", [](KvPiece& p) { p.header.head_end = 0; }, "heads"},
        {"no blocks", [](KvPiece& p) { p.header.num_blocks = 0; }, "num_blocks=0"},
        {"block size", [](KvPiece& p) { p.header.block_size = -4; }, "block_size=-4"},
        {"head dim", [](KvPiece& p) { p.header.head_dim = 0; }, "head_dim=0"},
        {"dtype", [](KvPiece& p) { p.header.dtype = static_cast<KvWireDtype>(9); }, "dtype=9"},
        {"short data", [](KvPiece& p) { p.data.pop_back(); }, "data bytes"},
        {"long data", [](KvPiece& p) { p.data.push_back(0); }, "data bytes"},
        {"overflowing sizes",
         [](KvPiece& p) {
             p.header.num_blocks = 1 << 30;
             p.header.block_size = 1 << 30;
         },
         "exceeds"},
    };
    ASSERT_TRUE(ValidateKvPiece(Piece(1, 0, 2, 1, 3)).ok());
    for (const Case& c : cases) {
        KvPiece piece = Piece(1, 0, 2, 1, 3);
        c.mutate(piece);
        const Status status = ValidateKvPiece(piece);
        EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << c.name;
        EXPECT_NE(status.message().find(c.message_part), std::string::npos)
            << c.name << ": " << status.message();
    }
}

TEST(KvPiece, WireHeaderRoundTripsAndRejectsCorruption) {
    const KvPiece piece = Piece(0x0102030405060708ull, 3, 5, 1, 2);
    const internal::KvPieceFrameHeader bytes =
        internal::EncodeKvPieceFrameHeader(piece.header, piece.data.size(), 0xdeadbeef);
    Result<internal::DecodedKvPieceFrame> decoded = internal::DecodeKvPieceFrameHeader(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(decoded->header, piece.header);
    EXPECT_EQ(decoded->payload_bytes, piece.data.size());
    EXPECT_EQ(decoded->payload_crc, 0xdeadbeefu);

    struct Case {
        size_t offset;
        uint8_t value;
        StatusCode code;
    };
    const Case cases[] = {
        {0, 'X', StatusCode::kDataLoss},        // magic
        {4, 2, StatusCode::kUnimplemented},     // version
        {6, 3, StatusCode::kInvalidArgument},   // dtype
        {7, 1, StatusCode::kDataLoss},          // reserved
        {20, 0, StatusCode::kInvalidArgument},  // layer_end 0 < layer_begin
        {44, 0xff, StatusCode::kDataLoss},      // payload length vs header
    };
    for (const Case& c : cases) {
        internal::KvPieceFrameHeader bad = bytes;
        bad[c.offset] = c.value;
        EXPECT_EQ(internal::DecodeKvPieceFrameHeader(bad).status().code(), c.code) << c.offset;
    }
}

// ---- staging (shared by the transports) ----

TEST(KvStaging, StaleTransfersAreDroppedAndRememberedAsDiscarded) {
    KvTransportOptions options;
    options.stale_after_ms = 1'000;
    Clock::time_point now = Clock::now();
    internal::KvStaging staging(options, "test", [&] { return now; });
    ASSERT_TRUE(staging.StageCopy(Piece(5, 0, 1, 0, 1)).ok());
    const int64_t bytes = staging.staged_bytes();
    EXPECT_GT(bytes, 0);
    now += milliseconds(999);
    EXPECT_EQ(staging.staged_bytes(), bytes);
    ASSERT_TRUE(staging.StageCopy(Piece(5, 1, 2, 0, 1)).ok());  // an arrival renews it
    now += milliseconds(999);
    EXPECT_EQ(staging.staged_bytes(), 2 * bytes);
    now += milliseconds(2);
    EXPECT_EQ(staging.staged_bytes(), 0);
    EXPECT_EQ(staging.StageCopy(Piece(5, 2, 3, 0, 1)).code(), StatusCode::kAborted);
    EXPECT_EQ(staging.Receive(5, 1, Clock::now()).status().code(), StatusCode::kAborted);
    // The memory of the drop expires too, after which the id is an ordinary new transfer.
    now += milliseconds(1'001);
    EXPECT_TRUE(staging.StageCopy(Piece(5, 2, 3, 0, 1)).ok());
}

// ---- in-process transport ----

std::unique_ptr<KvTransport> Local(const std::string& name, KvTransportOptions options = {}) {
    Result<std::unique_ptr<KvTransport>> t = MakeLocalKvTransport(name, options);
    KV_CHECK(t.ok()) << t.status().ToString();
    return std::move(t).value();
}

TEST(LocalKvTransport, RoundTrip) {
    auto a = Local("rt-a");
    auto b = Local("rt-b");
    EXPECT_EQ(b->endpoint(), "local:rt-b");
    const KvPiece piece = Piece(42, 0, 3, 0, 2);
    ASSERT_TRUE(a->Send(b->endpoint(), piece, In(1'000)).ok());
    EXPECT_EQ(b->staged_bytes(), static_cast<int64_t>(piece.data.size()));
    Result<std::vector<KvPiece>> got = b->Receive(42, 3 * 2, In(1'000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), 1u);
    EXPECT_EQ((*got)[0].header, piece.header);
    EXPECT_EQ((*got)[0].data, piece.data);
    EXPECT_EQ(b->staged_bytes(), 0);
}

TEST(LocalKvTransport, ReceiveWaitsForPiecesFromTwoSenders) {
    auto receiver = Local("two-r");
    auto s0 = Local("two-s0");
    auto s1 = Local("two-s1");
    // Each sender holds half the heads; the receiver needs 4 layers × 4 heads.
    Status sent0, sent1;
    std::thread t0([&] { sent0 = s0->Send("local:two-r", Piece(7, 0, 4, 0, 2), In(10'000)); });
    std::thread t1([&] { sent1 = s1->Send("local:two-r", Piece(7, 0, 4, 2, 4), In(10'000)); });
    Result<std::vector<KvPiece>> got = receiver->Receive(7, 16, In(10'000));
    t0.join();
    t1.join();
    ASSERT_TRUE(sent0.ok()) << sent0.ToString();
    ASSERT_TRUE(sent1.ok()) << sent1.ToString();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), 2u);
    std::map<int32_t, std::vector<uint8_t>> by_head;
    for (const KvPiece& p : *got) by_head[p.header.head_begin] = p.data;
    EXPECT_EQ(by_head[0], Piece(7, 0, 4, 0, 2).data);
    EXPECT_EQ(by_head[2], Piece(7, 0, 4, 2, 4).data);
}

TEST(LocalKvTransport, MissingPieceIsDeadlineExceededAndStaysStaged) {
    auto r = Local("miss-r");
    auto s = Local("miss-s");
    ASSERT_TRUE(s->Send("local:miss-r", Piece(8, 0, 2, 0, 1), In(1'000)).ok());
    const Clock::time_point deadline = In(50);
    Result<std::vector<KvPiece>> got = r->Receive(8, 4, deadline);
    EXPECT_EQ(got.status().code(), StatusCode::kDeadlineExceeded);
    EXPECT_GE(Clock::now(), deadline);
    EXPECT_NE(got.status().message().find("2 of 4 cells"), std::string::npos)
        << got.status().message();
    EXPECT_GT(r->staged_bytes(), 0);
    ASSERT_TRUE(s->Send("local:miss-r", Piece(8, 2, 4, 0, 1), In(1'000)).ok());
    EXPECT_EQ(r->Receive(8, 4, In(1'000)).value().size(), 2u);
}

TEST(LocalKvTransport, DiscardDropsStagedAndLaterPieces) {
    auto r = Local("disc-r");
    auto s = Local("disc-s");
    ASSERT_TRUE(s->Send("local:disc-r", Piece(9, 0, 1, 0, 1), In(1'000)).ok());
    ASSERT_TRUE(s->Send("local:disc-r", Piece(10, 0, 1, 0, 1), In(1'000)).ok());
    const int64_t one = r->staged_bytes() / 2;
    r->Discard(9);
    EXPECT_EQ(r->staged_bytes(), one);  // transfer 10 untouched
    EXPECT_EQ(s->Send("local:disc-r", Piece(9, 1, 2, 0, 1), In(1'000)).code(),
              StatusCode::kAborted);
    EXPECT_EQ(r->staged_bytes(), one);
    EXPECT_EQ(r->Receive(9, 1, In(1'000)).status().code(), StatusCode::kAborted);
    EXPECT_TRUE(r->Receive(10, 1, In(1'000)).ok());
}

TEST(LocalKvTransport, DiscardEndsAWaitingReceive) {
    auto r = Local("wake-r");
    Result<std::vector<KvPiece>> got = Status(StatusCode::kInternal, "not run");
    // Whether the Receive starts waiting before or after the Discard, it returns Aborted, long
    // before its deadline.
    std::thread receiver([&] { got = r->Receive(11, 1, In(60'000)); });
    r->Discard(11);
    receiver.join();
    EXPECT_EQ(got.status().code(), StatusCode::kAborted);
}

TEST(LocalKvTransport, ResendOfAStagedPieceIsDropped) {
    auto r = Local("dup-r");
    auto s = Local("dup-s");
    const KvPiece piece = Piece(12, 0, 1, 0, 2);
    ASSERT_TRUE(s->Send("local:dup-r", piece, In(1'000)).ok());
    ASSERT_TRUE(s->Send("local:dup-r", piece, In(1'000)).ok());
    EXPECT_EQ(r->staged_bytes(), static_cast<int64_t>(piece.data.size()));
    // 2 cells, not 4: a Receive for more does not complete on the duplicate.
    EXPECT_EQ(r->Receive(12, 4, In(20)).status().code(), StatusCode::kDeadlineExceeded);
}

TEST(LocalKvTransport, StagingLimitRefusesWithResourceExhausted) {
    const KvPiece piece = Piece(13, 0, 1, 0, 1);
    KvTransportOptions options;
    options.max_staged_bytes = static_cast<int64_t>(piece.data.size()) * 3 / 2;
    auto r = Local("full-r", options);
    auto s = Local("full-s");
    ASSERT_TRUE(s->Send("local:full-r", piece, In(1'000)).ok());
    const Status refused = s->Send("local:full-r", Piece(14, 0, 1, 0, 1), In(1'000));
    EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
    ASSERT_TRUE(r->Receive(13, 1, In(1'000)).ok());
    EXPECT_TRUE(s->Send("local:full-r", Piece(14, 0, 1, 0, 1), In(1'000)).ok());
    // A piece larger than the whole staging never fits.
    EXPECT_EQ(s->Send("local:full-r", Piece(15, 0, 2, 0, 2), In(1'000)).code(),
              StatusCode::kResourceExhausted);
}

TEST(LocalKvTransport, EndpointAndNameErrors) {
    auto s = Local("err-s");
    const Status unknown = s->Send("local:nobody", Piece(1, 0, 1, 0, 1), In(1'000));
    EXPECT_EQ(unknown.code(), StatusCode::kUnavailable);
    EXPECT_NE(unknown.message().find("local:nobody"), std::string::npos) << unknown.message();
    EXPECT_EQ(s->Send("127.0.0.1:80", Piece(1, 0, 1, 0, 1), In(1'000)).code(),
              StatusCode::kInvalidArgument);
    KvPiece bad = Piece(1, 0, 1, 0, 1);
    bad.data.clear();
    EXPECT_EQ(s->Send("local:err-s", bad, In(1'000)).code(), StatusCode::kInvalidArgument);

    // A name in use is refused (status.h has no AlreadyExists); free again once destroyed.
    EXPECT_EQ(MakeLocalKvTransport("err-s").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(MakeLocalKvTransport("").status().code(), StatusCode::kInvalidArgument);
    KvTransportOptions zero;
    zero.max_staged_bytes = 0;
    EXPECT_EQ(MakeLocalKvTransport("err-z", zero).status().code(), StatusCode::kInvalidArgument);
    s.reset();
    EXPECT_TRUE(MakeLocalKvTransport("err-s").ok());
}

TEST(LocalKvTransport, SendRacingDestructionIsSafe) {
    auto s = Local("race-s");
    for (int round = 0; round < 20; ++round) {
        auto r = Local("race-r");
        Status last;
        std::thread sender([&] {
            for (int i = 0; i < 50; ++i) {
                last = s->Send("local:race-r", Piece(100 + i, 0, 1, 0, 1), In(1'000));
                if (!last.ok()) break;
            }
        });
        r.reset();
        sender.join();
        EXPECT_TRUE(last.ok() || last.code() == StatusCode::kUnavailable) << last.ToString();
    }
}

// ---- TCP transport ----

std::unique_ptr<KvTransport> Tcp(KvTransportOptions options = {}) {
    Result<std::unique_ptr<KvTransport>> t = MakeTcpKvTransport("127.0.0.1", 0, options);
    KV_CHECK(t.ok()) << t.status().ToString();
    return std::move(t).value();
}

TEST(TcpKvTransport, SeveralPiecesFromConcurrentSenders) {
    auto r = Tcp();
    auto s0 = Tcp();
    auto s1 = Tcp();
    EXPECT_NE(r->endpoint().find("127.0.0.1:"), std::string::npos);
    EXPECT_NE(r->endpoint(), "127.0.0.1:0");
    // Three threads, two of them sharing s0's connection: 4 layers × 6 heads, one layer each.
    std::vector<std::thread> threads;
    std::vector<Status> sent(3);
    const std::pair<KvTransport*, int32_t> senders[] = {
        {s0.get(), 0}, {s0.get(), 2}, {s1.get(), 4}};
    for (int t = 0; t < 3; ++t) {
        threads.emplace_back([&, t] {
            for (int32_t layer = 0; layer < 4 && sent[t].ok(); ++layer) {
                const int32_t head = senders[t].second;
                sent[t] = senders[t].first->Send(
                    r->endpoint(), Piece(21, layer, layer + 1, head, head + 2), In(10'000));
            }
        });
    }
    Result<std::vector<KvPiece>> got = r->Receive(21, 4 * 6, In(10'000));
    for (std::thread& t : threads) t.join();
    for (const Status& s : sent) ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), 12u);
    for (const KvPiece& p : *got) {
        const KvPiece expected = Piece(21, p.header.layer_begin, p.header.layer_end,
                                       p.header.head_begin, p.header.head_end);
        EXPECT_EQ(p.header, expected.header);
        EXPECT_EQ(p.data, expected.data);
    }
    EXPECT_EQ(r->staged_bytes(), 0);
}

TEST(TcpKvTransport, ClosedReceiverIsAnErrorWithinTheDeadline) {
    auto s = Tcp();
    auto r = Tcp();
    const std::string endpoint = r->endpoint();
    ASSERT_TRUE(s->Send(endpoint, Piece(1, 0, 1, 0, 1), In(5'000)).ok());  // connection cached
    r.reset();
    const Clock::time_point deadline = In(5'000);
    const Status status = s->Send(endpoint, Piece(2, 0, 1, 0, 1), deadline);
    EXPECT_FALSE(status.ok());
    EXPECT_LT(Clock::now(), deadline);
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
}

TEST(TcpKvTransport, SilentReceiverIsDeadlineExceeded) {
    // Accepts and never answers.
    asio::io_context io;
    tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    const std::string endpoint = "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port());
    auto s = Tcp();
    const Clock::time_point deadline = In(200);
    const Status status = s->Send(endpoint, Piece(3, 0, 1, 0, 1), deadline);
    EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
    EXPECT_GE(Clock::now(), deadline);
    EXPECT_LT(Clock::now(), deadline + milliseconds(2'000));
}

// Writes `bytes` on a raw connection to `port` and reports whether the transport closed it.
bool ClosesConnectionAfter(uint16_t port, const std::vector<uint8_t>& bytes) {
    asio::io_context io;
    tcp::socket socket(io);
    socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    asio::write(socket, asio::buffer(bytes));
    std::array<uint8_t, 64> buffer{};
    bool closed = false;
    socket.async_read_some(asio::buffer(buffer),
                           [&](const boost::system::error_code& ec, size_t) { closed = bool(ec); });
    io.run_for(milliseconds(5'000));  // a bound against a hang, not a synchronization
    return closed;
}

TEST(TcpKvTransport, MalformedFrameClosesOnlyThatConnection) {
    auto r = Tcp();
    auto s = Tcp();
    const uint16_t port =
        static_cast<uint16_t>(std::stoi(r->endpoint().substr(r->endpoint().rfind(':') + 1)));
    const KvPiece piece = Piece(4, 0, 1, 0, 1);
    const internal::KvPieceFrameHeader good = internal::EncodeKvPieceFrameHeader(
        piece.header, piece.data.size(), internal::KvPayloadCrc(piece.data));
    auto frame = [&](internal::KvPieceFrameHeader header, bool corrupt_payload) {
        std::vector<uint8_t> bytes(header.size() + piece.data.size());
        std::copy(header.begin(), header.end(), bytes.begin());
        std::copy(piece.data.begin(), piece.data.end(), bytes.begin() + header.size());
        if (corrupt_payload) bytes.back() ^= 1;
        return bytes;
    };
    internal::KvPieceFrameHeader bad_magic = good, bad_version = good, bad_length = good;
    bad_magic[1] = 'X';
    bad_version[4] = 9;
    bad_length[45] ^= 1;
    const std::vector<uint8_t> cases[] = {
        std::vector<uint8_t>(100, 0xAB),  // garbage
        frame(bad_magic, false),         frame(bad_version, false),
        frame(bad_length, false),        frame(good, true),  // CRC mismatch
    };
    for (const std::vector<uint8_t>& bytes : cases) {
        EXPECT_TRUE(ClosesConnectionAfter(port, bytes));
        EXPECT_EQ(r->staged_bytes(), 0);
    }
    // Still serving: a proper sender gets through.
    ASSERT_TRUE(s->Send(r->endpoint(), piece, In(5'000)).ok());
    Result<std::vector<KvPiece>> got = r->Receive(4, 1, In(5'000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ((*got)[0].data, piece.data);
}

TEST(TcpKvTransport, OversizedPieceIsRefusedAndTheConnectionStaysUsable) {
    const KvPiece small = Piece(5, 0, 1, 0, 1);
    KvTransportOptions options;
    options.max_staged_bytes = static_cast<int64_t>(small.data.size()) * 2;
    auto r = Tcp(options);
    auto s = Tcp();
    const Status refused = s->Send(r->endpoint(), Piece(6, 0, 4, 0, 4), In(5'000));
    EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
    EXPECT_NE(refused.message().find("max_staged_bytes"), std::string::npos) << refused.message();
    EXPECT_EQ(r->staged_bytes(), 0);
    ASSERT_TRUE(s->Send(r->endpoint(), small, In(5'000)).ok());
    EXPECT_TRUE(r->Receive(5, 1, In(5'000)).ok());
}

TEST(TcpKvTransport, DiscardedTransferIsAbortedAtTheSender) {
    auto r = Tcp();
    auto s = Tcp();
    r->Discard(7);
    EXPECT_EQ(s->Send(r->endpoint(), Piece(7, 0, 1, 0, 1), In(5'000)).code(), StatusCode::kAborted);
    EXPECT_EQ(r->staged_bytes(), 0);
}

TEST(TcpKvTransport, BadEndpointsAreInvalidArgument) {
    auto s = Tcp();
    for (const char* endpoint : {"nocolon", "127.0.0.1:", ":80", "127.0.0.1:0", "127.0.0.1:65536",
                                 "127.0.0.1:8x", "local:r"}) {
        EXPECT_EQ(s->Send(endpoint, Piece(1, 0, 1, 0, 1), In(1'000)).code(),
                  StatusCode::kInvalidArgument)
            << endpoint;
    }
}

}  // namespace
}  // namespace kvshard
