// The TCP KV transport against hostile or broken peers (RawPeer, a hand-written sender): a
// malformed frame closes only its connection, a huge claim or one that does not fit the pool is
// refused before anything is allocated, and a piece of a transfer its connection did not name is
// refused.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <string>
#include <vector>

#include "comm/kv_staging.h"
#include "comm/kv_transport.h"
#include "comm/tcp_kv_wire.h"
#include "tests/comm/kv_transport_test_util.h"

// The helpers of kv_transport_test_util.h, and its aliases (Clock: the steady clock).
namespace kvshard::testing {
namespace {

// How much peak RSS may grow while a claim is refused or read in pieces. AddressSanitizer keeps
// freed chunks in its quarantine (256 MiB by default), so its builds get more room: the
// reservation counters asserted next to this bound are what show nothing was held.
#if defined(__SANITIZE_ADDRESS__)
constexpr int64_t kRssSlack = int64_t{320} << 20;
#else
constexpr int64_t kRssSlack = int64_t{64} << 20;
#endif

int64_t MaxRssBytes() {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return int64_t{usage.ru_maxrss} * 1024;
}

// A header that passes every check of its own, claiming 0.96 GiB: 1 layer × 1 head of 4-slot,
// 8-dim f32 blocks is 256 bytes a block.
KvPieceHeader HugeHeader(uint64_t transfer_id) {
    KvPieceHeader h = Header(transfer_id, 0, 1, 0, 1);
    h.num_blocks = static_cast<int32_t>((int64_t{1} << 30) * 96 / 100 / 256);
    return h;
}

TEST(TcpKvTransport, MalformedFrameClosesOnlyThatConnection) {
    auto r = Tcp();
    auto s = Tcp();
    const KvPiece piece = Piece(4, 0, 1, 0, 1);
    const std::vector<uint8_t> good = PieceBytes(piece);
    auto corrupt = [&](size_t offset, uint8_t value) {
        std::vector<uint8_t> bytes = good;
        bytes[offset] = value;
        return bytes;
    };
    const std::vector<uint8_t> hello = HelloBytes();
    const std::vector<uint8_t> named = Concat({hello, TransferBytes(4)});
    const std::vector<uint8_t> cases[] = {
        std::vector<uint8_t>(100, 0xAB),                             // garbage instead of a hello
        Concat({hello, std::vector<uint8_t>(100, 0xAB)}),            // garbage after it
        Concat({named, corrupt(1, 'X')}),                            // magic
        Concat({named, corrupt(4, 9)}),                              // version
        Concat({named, corrupt(45, good[45] ^ 1)}),                  // length vs header
        Concat({named, corrupt(good.size() - 1, good.back() ^ 1)}),  // CRC mismatch
    };
    for (const std::vector<uint8_t>& bytes : cases) {
        RawPeer peer(PortOf(*r));
        peer.Write(bytes);
        EXPECT_TRUE(peer.Closed());
        EXPECT_EQ(r->staged_bytes(), 0);
        EXPECT_EQ(r->arriving_bytes(), 0);
    }
    // Still serving: a proper sender gets through.
    ASSERT_TRUE(s->Send(r->endpoint(), piece, In(5'000)).ok());
    Result<std::vector<KvPiece>> got = r->Receive(4, 1, In(5'000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ((*got)[0].data, piece.data);
}

TEST(TcpKvTransport, HugeClaimedPieceIsRefusedBeforeAnythingIsAllocated) {
    auto r = Tcp();
    ASSERT_TRUE(r->SetReceiveGeometry(TestGeometry()).ok());
    const KvPieceHeader huge = HugeHeader(30);
    ASSERT_GT(KvPieceBytes(huge), int64_t{900} << 20);
    const int64_t rss_before = MaxRssBytes();
    RawPeer peer(PortOf(*r));
    peer.Write(HelloBytes());
    ASSERT_TRUE(peer.ReadAck().ok());
    peer.Write(Concat({TransferBytes(30), HeaderBytes(huge, KvPieceBytes(huge))}));
    const Status refused = peer.ReadAck();
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
    EXPECT_NE(refused.message().find("num_blocks"), std::string::npos) << refused.message();
    EXPECT_TRUE(peer.Closed());
    EXPECT_EQ(r->arriving_bytes(), 0);
    EXPECT_EQ(r->staged_bytes(), 0);
    EXPECT_LT(MaxRssBytes() - rss_before, kRssSlack);
}

TEST(TcpKvTransport, WithoutGeometryAClaimCostsOnlyWhatArrivesUntilTheReadDeadline) {
    KvTransportOptions options;
    options.read_timeout_ms = 300;
    auto r = Tcp(options);
    const KvPieceHeader huge = HugeHeader(31);
    const int64_t rss_before = MaxRssBytes();
    RawPeer peer(PortOf(*r));
    peer.Write(HelloBytes());
    ASSERT_TRUE(peer.ReadAck().ok());
    // The header and 1 MiB of its 0.96 GiB, then nothing.
    peer.Write(Concat({TransferBytes(31), HeaderBytes(huge, KvPieceBytes(huge)),
                       std::vector<uint8_t>(1 << 20, 0x5A)}));
    EXPECT_TRUE(peer.Closed());
    EXPECT_EQ(r->arriving_bytes(), 0);  // the reservation was given back
    EXPECT_EQ(r->staged_bytes(), 0);
    EXPECT_LT(MaxRssBytes() - rss_before, kRssSlack);
}

TEST(TcpKvTransport, PiecesThatDoNotFitThePoolAreRefused) {
    struct Case {
        const char* name;
        void (*mutate)(KvPieceHeader&);
        StatusCode code;
        const char* message_part;
    };
    const Case cases[] = {
        {"block size", [](KvPieceHeader& h) { h.block_size = 8; }, StatusCode::kInvalidArgument,
         "block_size=8"},
        {"head dim", [](KvPieceHeader& h) { h.head_dim = 16; }, StatusCode::kInvalidArgument,
         "head_dim=16"},
        {"dtype", [](KvPieceHeader& h) { h.dtype = KvDtype::kInt8; }, StatusCode::kInvalidArgument,
         "dtype=int8"},
        {"layers", [](KvPieceHeader& h) { h.layer_end = 5; }, StatusCode::kInvalidArgument,
         "layers"},
        {"heads", [](KvPieceHeader& h) { h.head_end = 7; }, StatusCode::kInvalidArgument, "heads"},
        {"blocks", [](KvPieceHeader& h) { h.num_blocks = 17; }, StatusCode::kInvalidArgument,
         "num_blocks=17"},
    };
    auto r = Tcp();
    ASSERT_TRUE(r->SetReceiveGeometry(TestGeometry()).ok());
    auto local = Local("fit-r");
    ASSERT_TRUE(local->SetReceiveGeometry(TestGeometry()).ok());
    auto local_sender = Local("fit-s");
    for (const Case& c : cases) {
        KvPieceHeader h = Header(40, 0, 4, 0, 6);
        c.mutate(h);
        ASSERT_TRUE(internal::ValidateKvPieceHeader(h).ok()) << c.name;
        RawPeer peer(PortOf(*r));
        peer.Write(Concat({HelloBytes(), TransferBytes(40), HeaderBytes(h, KvPieceBytes(h))}));
        ASSERT_TRUE(peer.ReadAck().ok()) << c.name;  // the hello's
        const Status refused = peer.ReadAck();
        EXPECT_EQ(refused.code(), c.code) << c.name << ": " << refused.ToString();
        EXPECT_NE(refused.message().find(c.message_part), std::string::npos)
            << c.name << ": " << refused.message();
        EXPECT_TRUE(peer.Closed()) << c.name;
        EXPECT_EQ(r->arriving_bytes(), 0) << c.name;

        // The in-process transport applies the same geometry.
        KvPiece piece;
        piece.header = h;
        piece.data.resize(static_cast<size_t>(KvPieceBytes(h)));
        EXPECT_EQ(local_sender->Send("local:fit-r", piece, In(1'000)).code(), c.code) << c.name;
    }
    // A byte count that does not match the header's blocks × layers × heads.
    const KvPieceHeader h = Header(41, 0, 1, 0, 1);
    RawPeer peer(PortOf(*r));
    peer.Write(Concat({HelloBytes(), TransferBytes(41), HeaderBytes(h, KvPieceBytes(h) + 1)}));
    ASSERT_TRUE(peer.ReadAck().ok());
    EXPECT_EQ(peer.ReadAck().code(), StatusCode::kDataLoss);
    EXPECT_TRUE(peer.Closed());
    EXPECT_EQ(r->staged_bytes(), 0);
    EXPECT_EQ(local->staged_bytes(), 0);
    // What fits is still staged.
    EXPECT_TRUE(local_sender->Send("local:fit-r", Piece(42, 0, 4, 0, 6), In(1'000)).ok());
}

TEST(TcpKvTransport, PieceOfATransferTheConnectionDidNotNameIsRefused) {
    auto r = Tcp();
    const KvPiece piece = Piece(50, 0, 1, 0, 1);
    const std::vector<uint8_t> cases[] = {
        Concat({HelloBytes(), PieceBytes(piece)}),                     // no transfer named
        Concat({HelloBytes(), TransferBytes(51), PieceBytes(piece)}),  // another one named
    };
    for (const std::vector<uint8_t>& bytes : cases) {
        RawPeer peer(PortOf(*r));
        peer.Write(bytes);
        ASSERT_TRUE(peer.ReadAck().ok());
        const Status refused = peer.ReadAck();
        EXPECT_EQ(refused.code(), StatusCode::kNotFound) << refused.ToString();
        EXPECT_NE(refused.message().find("transfer 50"), std::string::npos) << refused.message();
        EXPECT_TRUE(peer.Closed());
        EXPECT_EQ(r->staged_bytes(), 0);
        EXPECT_EQ(r->arriving_bytes(), 0);
    }
    // Named, it is staged.
    RawPeer peer(PortOf(*r));
    peer.Write(Concat({HelloBytes(), TransferBytes(50), PieceBytes(piece)}));
    ASSERT_TRUE(peer.ReadAck().ok());
    EXPECT_TRUE(peer.ReadAck().ok());
    EXPECT_EQ(r->staged_bytes(), static_cast<int64_t>(piece.data.size()));
}

}  // namespace
}  // namespace kvshard::testing
