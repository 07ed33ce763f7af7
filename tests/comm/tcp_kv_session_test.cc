// The TCP KV transport's receiving connections (comm/tcp_kv_session.h): the read and idle
// deadlines (on a virtual clock) and what they free, the token checked at the handshake, and a
// sender's reconnect once its idle connection was closed.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/kv_transport.h"
#include "common/clock.h"
#include "tests/comm/kv_transport_test_util.h"

// The helpers of kv_transport_test_util.h, and its aliases (Clock: the steady clock).
namespace kvshard::testing {
namespace {

TEST(TcpKvTransport, StalledOrIdleConnectionsAreClosedAndTheirStagingFreed) {
    // The deadlines are on a virtual clock: a connection stalls exactly as long as the test says,
    // however late a loaded machine runs either side.
    VirtualClock clock;
    KvTransportOptions options;
    options.read_timeout_ms = 200;
    options.idle_timeout_ms = 200;
    options.clock = &clock;
    auto r = Tcp(options);
    ASSERT_TRUE(r->SetReceiveGeometry(TestGeometry()).ok());
    const KvPiece piece = Piece(60, 0, 4, 0, 6);
    const std::vector<uint8_t> frame = PieceBytes(piece);
    const std::vector<uint8_t> named = Concat({HelloBytes(), TransferBytes(60)});
    struct Case {
        const char* name;
        std::vector<uint8_t> bytes;
        bool reserves;  // the header arrived whole: its payload is reserved while it stalls
    };
    const Case cases[] = {
        {"silent", {}, false},
        {"mid-hello", std::vector<uint8_t>(named.begin(), named.begin() + 5), false},
        {"idle after the hello", HelloBytes(), false},
        {"mid-header", Concat({named, std::vector<uint8_t>(frame.begin(), frame.begin() + 30)}),
         false},
        {"mid-payload",
         Concat({named, std::vector<uint8_t>(frame.begin(), frame.begin() + frame.size() / 2)}),
         true},
    };
    for (const Case& c : cases) {
        RawPeer peer(PortOf(*r));
        peer.Write(c.bytes);
        if (c.reserves) {
            const int64_t claimed = KvPieceBytes(piece.header);
            EXPECT_TRUE(Eventually([&] { return r->arriving_bytes() == claimed; }))
                << c.name << ": " << r->arriving_bytes() << " bytes arriving";
        }
        // Until the clock moves no deadline passes: what came so far is no reason to close.
        EXPECT_FALSE(peer.Closed(milliseconds(50))) << c.name;
        EXPECT_TRUE(ClosedAsTheClockMoves(clock, peer, milliseconds(200))) << c.name;
        EXPECT_EQ(r->arriving_bytes(), 0) << c.name;
        EXPECT_EQ(r->staged_bytes(), 0) << c.name;
    }
    // The transfer is not poisoned: a whole delivery of the same piece is staged.
    auto s = Tcp();
    ASSERT_TRUE(s->Send(r->endpoint(), piece, In(5'000)).ok());
    EXPECT_TRUE(r->Receive(60, 4 * 6, In(5'000)).ok());
}

TEST(TcpKvTransport, TokenIsCheckedAtTheHandshake) {
    KvTransportOptions secret;
    secret.token = "s3cret-token";
    auto r = Tcp(secret);
    {
        RawPeer peer(PortOf(*r));
        peer.Write(
            Concat({HelloBytes("guess"), TransferBytes(70), PieceBytes(Piece(70, 0, 1, 0, 1))}));
        EXPECT_EQ(peer.ReadAck().code(), StatusCode::kInvalidArgument);
        EXPECT_TRUE(peer.Closed());
    }
    auto stranger = Tcp();
    const Status refused = stranger->Send(r->endpoint(), Piece(71, 0, 1, 0, 1), In(5'000));
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
    EXPECT_NE(refused.message().find("token"), std::string::npos) << refused.message();
    EXPECT_EQ(r->staged_bytes(), 0);
    auto member = Tcp(secret);
    ASSERT_TRUE(member->Send(r->endpoint(), Piece(72, 0, 1, 0, 1), In(5'000)).ok());
    EXPECT_TRUE(r->Receive(72, 1, In(5'000)).ok());
}

TEST(TcpKvTransport, IdleClosedConnectionIsReopenedBySender) {
    VirtualClock clock;  // the idle deadline passes when the test moves the clock, not before
    KvTransportOptions options;
    options.idle_timeout_ms = 100;
    options.clock = &clock;
    auto r = Tcp(options);
    auto s = Tcp();
    ASSERT_TRUE(s->Send(r->endpoint(), Piece(80, 0, 1, 0, 1), In(5'000)).ok());
    // Whether or not the sender has seen the receiver close the cached connection, the next Send
    // works.
    RawPeer witness(PortOf(*r));
    witness.Write(HelloBytes());
    ASSERT_TRUE(witness.ReadAck().ok());
    // The sender's connection went idle before the witness's did: the move that closes the
    // witness's has passed its idle deadline too.
    EXPECT_TRUE(ClosedAsTheClockMoves(clock, witness, milliseconds(100)));
    ASSERT_TRUE(s->Send(r->endpoint(), Piece(80, 1, 2, 0, 1), In(5'000)).ok());
    EXPECT_TRUE(r->Receive(80, 2, In(5'000)).ok());
}

}  // namespace
}  // namespace kvshard::testing
