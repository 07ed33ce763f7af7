// KV transports (comm/kv_transport.h): the piece arithmetic, the staging semantics shared by
// every transport, the in-process transport and the TCP transport over loopback.
#include "comm/kv_transport.h"

#include <gtest/gtest.h>

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on
#include <sys/resource.h>

#include <functional>
#include <map>
#include <thread>

#include "comm/kv_staging.h"
#include "comm/tcp_kv_wire.h"
#include "common/clock.h"

namespace kvshard {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Clock::time_point In(int64_t ms) { return Clock::now() + milliseconds(ms); }

KvPieceHeader Header(uint64_t transfer_id, int32_t layer_begin, int32_t layer_end,
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
        KvDtype dtype;
        int32_t blocks, layers, heads, block_size, head_dim;
        int64_t element_bytes, layer_bytes;
    };
    const Case cases[] = {
        {KvDtype::kFp32, 3, 2, 4, 16, 64, 4, 2 * 4 * 16 * 64 * 4},
        {KvDtype::kInt8, 3, 2, 4, 16, 64, 1, 2 * 4 * 16 * 64 + 2 * 4 * 16 * 4},
        {KvDtype::kFp8, 1, 5, 1, 32, 128, 1, 2 * 32 * 128 + 2 * 32 * 4},
        {KvDtype::kFp32, 1, 1, 1, 1, 1, 4, 8},
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
        EXPECT_EQ(KvDtypeBytes(c.dtype), c.element_bytes);
        EXPECT_EQ(KvPieceLayerBytes(h), c.layer_bytes);
        EXPECT_EQ(KvPieceBytes(h), int64_t{c.blocks} * c.layers * c.layer_bytes);
    }
}

// The wire keeps its explicit byte values (a peer of another build decodes the same dtype), and a
// byte that names no dtype is refused before anything is sized from it.
TEST(KvPiece, DtypeWireCodesAreStableAndCheckedOnDecode) {
    const std::pair<KvDtype, uint8_t> cases[] = {{KvDtype::kFp32, 0},
                                                 {KvDtype::kInt8, 1},
                                                 {KvDtype::kFp8, 2},
                                                 {KvDtype::kFp16, 3},
                                                 {KvDtype::kBf16, 4}};
    for (const auto& [dtype, code] : cases) {
        EXPECT_EQ(KvDtypeWireCode(dtype), code) << KvDtypeName(dtype);
        EXPECT_EQ(KvDtypeFromWireCode(code).value(), dtype) << int(code);
    }
    for (int code : {5, 9, 255}) {
        Result<KvDtype> bad = KvDtypeFromWireCode(static_cast<uint8_t>(code));
        ASSERT_FALSE(bad.ok()) << code;
        EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
        EXPECT_NE(bad.status().message().find("dtype=" + std::to_string(code)), std::string::npos);
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
        internal::EncodeKvPieceFrameHeader(piece.header, piece.data.size(), 0xdeadbeef01234567ull);
    Result<internal::DecodedKvPieceFrame> decoded = internal::DecodeKvPieceFrameHeader(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(decoded->header, piece.header);
    EXPECT_EQ(decoded->payload_bytes, piece.data.size());
    EXPECT_EQ(decoded->payload_hash, 0xdeadbeef01234567ull);
    EXPECT_FALSE(decoded->in_region);

    struct Case {
        size_t offset;
        uint8_t value;
        StatusCode code;
    };
    const Case cases[] = {
        {0, 'X', StatusCode::kDataLoss},        // magic
        {4, 1, StatusCode::kUnimplemented},     // version (1: before the handshake)
        {6, 5, StatusCode::kInvalidArgument},   // dtype (codes 0-4)
        {7, 2, StatusCode::kDataLoss},          // unknown flag
        {20, 0, StatusCode::kInvalidArgument},  // layer_end 0 < layer_begin
        {44, 0xff, StatusCode::kDataLoss},      // payload length vs header
    };
    for (const Case& c : cases) {
        internal::KvPieceFrameHeader bad = bytes;
        bad[c.offset] = c.value;
        EXPECT_EQ(internal::DecodeKvPieceFrameHeader(bad).status().code(), c.code) << c.offset;
    }
}

TEST(KvPiece, HelloAndTransferFramesRoundTripAndRejectCorruption) {
    const std::string hello = internal::EncodeKvHello("tok");
    ASSERT_EQ(hello.size(), internal::kKvHelloHeaderBytes + 3);
    std::array<uint8_t, internal::kKvHelloHeaderBytes> h{};
    std::copy_n(hello.begin(), h.size(), h.begin());
    ASSERT_EQ(internal::DecodeKvHelloHeader(h).value(), 3);
    auto bad_hello = [&](size_t offset, uint8_t value) {
        auto b = h;
        b[offset] = value;
        return internal::DecodeKvHelloHeader(b).status().code();
    };
    EXPECT_EQ(bad_hello(0, 'X'), StatusCode::kDataLoss);
    EXPECT_EQ(bad_hello(4, 1), StatusCode::kUnimplemented);
    EXPECT_EQ(bad_hello(7, 0xff), StatusCode::kDataLoss);  // a 65 KB token
    EXPECT_TRUE(internal::KvTokensEqual("abc", "abc"));
    EXPECT_FALSE(internal::KvTokensEqual("abc", "abd"));
    EXPECT_FALSE(internal::KvTokensEqual("abc", "ab"));

    const internal::KvTransferFrame t = internal::EncodeKvTransferFrame(0x1122334455667788ull);
    EXPECT_EQ(internal::DecodeKvFrameKind(t.data()).value(), internal::KvFrameKind::kTransfer);
    EXPECT_EQ(internal::DecodeKvTransferFrame(t).value(), 0x1122334455667788ull);
    auto bad_transfer = [&](size_t offset, uint8_t value) {
        auto b = t;
        b[offset] = value;
        return internal::DecodeKvTransferFrame(b).status().code();
    };
    EXPECT_EQ(bad_transfer(0, 'X'), StatusCode::kDataLoss);
    EXPECT_EQ(bad_transfer(5, 1), StatusCode::kUnimplemented);
    EXPECT_EQ(bad_transfer(6, 1), StatusCode::kDataLoss);
    const uint8_t garbage[4] = {'K', 'V', 'S', 'X'};
    EXPECT_EQ(internal::DecodeKvFrameKind(garbage).status().code(), StatusCode::kDataLoss);
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

TEST(KvStaging, GeometryBoundsTransfersBytesAndCount) {
    KvReceiveGeometry g;
    g.num_layers = 4;
    g.head_begin = 0;
    g.head_end = 2;
    g.block_size = 4;
    g.head_dim = 8;
    g.num_blocks = 3;
    ASSERT_TRUE(ValidateKvReceiveGeometry(g).ok());
    // A whole piece (4 layers × 2 heads × 2 blocks) is 2/3 of the pool.
    EXPECT_EQ(KvReceiveGeometryBytes(g), 3 * 4 * KvPieceLayerBytes(Header(0, 0, 1, 0, 2)));
    internal::KvStaging staging({}, "test");
    ASSERT_TRUE(staging.SetGeometry(g).ok());
    ASSERT_TRUE(staging.StageCopy(Piece(1, 0, 4, 0, 2)).ok());
    // Staged bytes stay within the pool's, whatever max_staged_bytes allows.
    EXPECT_EQ(staging.StageCopy(Piece(2, 0, 4, 0, 2)).code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(staging.staged_bytes(), KvPieceBytes(Piece(1, 0, 4, 0, 2).header));
    ASSERT_TRUE(staging.Receive(1, 8, In(1'000)).ok());
    // Transfers at most the pool's blocks (each fills one at least).
    for (uint64_t id = 10; id < 13; ++id)
        EXPECT_TRUE(staging.StageCopy(Piece(id, 0, 1, 0, 1)).ok());
    const Status fourth = staging.StageCopy(Piece(13, 0, 1, 0, 1));
    EXPECT_EQ(fourth.code(), StatusCode::kResourceExhausted) << fourth.ToString();
    EXPECT_NE(fourth.message().find("max_staged_transfers=3"), std::string::npos)
        << fourth.message();
    EXPECT_TRUE(staging.StageCopy(Piece(12, 1, 2, 0, 1)).ok());  // an existing one still grows
    EXPECT_EQ(staging.arriving_bytes(), 0);

    KvReceiveGeometry bad = g;
    bad.head_end = 0;
    EXPECT_EQ(staging.SetGeometry(bad).code(), StatusCode::kInvalidArgument);
    bad = g;
    bad.num_blocks = 0;
    EXPECT_EQ(ValidateKvReceiveGeometry(bad).code(), StatusCode::kInvalidArgument);
}

TEST(KvStaging, TransferCountLimitWithoutGeometry) {
    KvTransportOptions options;
    options.max_staged_transfers = 2;
    internal::KvStaging staging(options, "test");
    EXPECT_TRUE(staging.StageCopy(Piece(1, 0, 1, 0, 1)).ok());
    EXPECT_TRUE(staging.StageCopy(Piece(2, 0, 1, 0, 1)).ok());
    EXPECT_EQ(staging.StageCopy(Piece(3, 0, 1, 0, 1)).code(), StatusCode::kResourceExhausted);
    staging.Discard(1);
    EXPECT_TRUE(staging.StageCopy(Piece(3, 0, 1, 0, 1)).ok());
    // A failed delivery's reservation leaves no empty transfer behind to count.
    ASSERT_TRUE(staging.Receive(2, 1, In(1'000)).ok());
    ASSERT_TRUE(staging.Reserve(Piece(4, 0, 1, 0, 1).header).ok());
    EXPECT_GT(staging.arriving_bytes(), 0);
    staging.Unreserve(Piece(4, 0, 1, 0, 1).header);
    EXPECT_EQ(staging.arriving_bytes(), 0);
    EXPECT_TRUE(staging.StageCopy(Piece(5, 0, 1, 0, 1)).ok());
}

TEST(KvStaging, APieceArrivingWhileReceiveTakesItsTransferIsStillAccepted) {
    // A resend whose first copy completed the transfer: the sender must not hear Aborted (it would
    // take the transfer for failed while the receiver has it).
    internal::KvStaging staging({}, "test");
    const KvPiece piece = Piece(3, 0, 1, 0, 1);
    ASSERT_TRUE(staging.Reserve(piece.header).ok());  // the resend, still arriving
    ASSERT_TRUE(staging.StageCopy(piece).ok());       // the first copy
    ASSERT_TRUE(staging.Receive(3, 1, In(1'000)).ok());
    EXPECT_TRUE(staging.Commit(piece).ok());
    EXPECT_EQ(staging.arriving_bytes(), 0);
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

TEST(LocalKvTransport, RecycledBuffersAreReusedWithoutAllocating) {
    auto a = Local("recycle-a");
    auto b = Local("recycle-b");
    const KvPiece piece = Piece(90, 0, 3, 0, 2);
    ASSERT_TRUE(a->Send(b->endpoint(), piece, In(1'000)).ok());
    Result<std::vector<KvPiece>> first = b->Receive(90, 3 * 2, In(1'000));
    ASSERT_TRUE(first.ok());
    const uint8_t* buffer = (*first)[0].data.data();
    b->Recycle(std::move(*first));
    // The next piece of that size (or smaller) lands in the same memory, byte for byte.
    const KvPiece next = Piece(91, 0, 2, 0, 2);
    ASSERT_TRUE(a->Send(b->endpoint(), next, In(1'000)).ok());
    Result<std::vector<KvPiece>> second = b->Receive(91, 2 * 2, In(1'000));
    ASSERT_TRUE(second.ok());
    EXPECT_EQ((*second)[0].data.data(), buffer);
    EXPECT_EQ((*second)[0].data, next.data);
}

TEST(KvStaging, BufferPoolIsBoundedInCountAndBytes) {
    KvTransportOptions options;
    options.max_staged_bytes = 1 << 20;
    internal::KvStaging staging(options, "pool");
    std::vector<KvPiece> pieces(40);
    for (KvPiece& p : pieces) p.data.resize(64 << 10);
    staging.Recycle(std::move(pieces));
    EXPECT_LE(staging.pooled_bytes(), int64_t{1} << 20);  // 16 x 64 KiB = the staging limit
    EXPECT_GT(staging.pooled_bytes(), 0);
    std::vector<KvPiece> huge(1);
    huge[0].data.resize(2 << 20);  // more than the limit on its own: not kept
    staging.Recycle(std::move(huge));
    EXPECT_LE(staging.pooled_bytes(), int64_t{1} << 20);
    EXPECT_FALSE(staging.TakePooledBuffer(2 << 20).has_value());
    std::optional<std::vector<uint8_t>> taken = staging.TakePooledBuffer(1000);
    ASSERT_TRUE(taken.has_value());
    EXPECT_EQ(taken->size(), 1000u);
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

// The pool Header()/Piece() pieces are cut from: 4 layers, KV heads [0, 6), blocks of 4 slots ×
// 8 dims in f32, 16 blocks.
KvReceiveGeometry TestGeometry() {
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

std::unique_ptr<KvTransport> Tcp(KvTransportOptions options = {}) {
    Result<std::unique_ptr<KvTransport>> t = MakeTcpKvTransport("127.0.0.1", 0, options);
    KV_CHECK(t.ok()) << t.status().ToString();
    return std::move(t).value();
}

TEST(TcpKvTransport, SeveralPiecesFromConcurrentSenders) {
    auto r = Tcp();
    ASSERT_TRUE(r->SetReceiveGeometry(TestGeometry()).ok());
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

TEST(TcpKvTransport, OverTheSocketWhenSharedMemoryIsOff) {
    KvTransportOptions off;
    off.shared_memory = false;
    auto r = Tcp();
    auto s = Tcp(off);
    for (uint64_t id : {100u, 101u}) {
        const KvPiece piece = Piece(id, 0, 4, 0, 6);
        ASSERT_TRUE(s->Send(r->endpoint(), piece, In(5'000)).ok());
        Result<std::vector<KvPiece>> got = r->Receive(id, 4 * 6, In(5'000));
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ((*got)[0].data, piece.data);
        r->Recycle(std::move(*got));  // the second lands in the first's buffer
    }
}

// A receiver that accepts one connection only: the sender's second piece must come on the cached
// connection (a reconnect would wait for a hello answer that never comes). Sends used to reopen
// their connection every time (the idle check misread its own peek).
TEST(TcpKvTransport, ASecondSendReusesTheCachedConnection) {
    asio::io_context io;
    tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    const std::string endpoint = "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port());
    const KvPiece first = Piece(110, 0, 1, 0, 2);
    const KvPiece second = Piece(110, 1, 2, 0, 2);
    std::thread receiver([&] {
        tcp::socket socket(io);
        acceptor.accept(socket);
        boost::system::error_code ec;
        std::vector<uint8_t> bytes(internal::kKvHelloHeaderBytes);
        asio::read(socket, asio::buffer(bytes), ec);
        asio::write(socket, asio::buffer(internal::EncodeKvAckFrame(0, Status::Ok())), ec);
        for (size_t extra : {internal::kKvTransferFrameBytes, size_t{0}}) {
            bytes.resize(extra + internal::kKvPieceFrameHeaderBytes + first.data.size());
            asio::read(socket, asio::buffer(bytes), ec);
            asio::write(socket, asio::buffer(internal::EncodeKvAckFrame(110, Status::Ok())), ec);
        }
        std::array<uint8_t, 64> sink{};
        while (!ec) socket.read_some(asio::buffer(sink), ec);
    });
    auto s = Tcp();
    EXPECT_TRUE(s->Send(endpoint, first, In(5'000)).ok());
    const Status again = s->Send(endpoint, second, In(2'000));
    EXPECT_TRUE(again.ok()) << again.ToString();
    s.reset();  // closes the connection: the receiver thread ends
    receiver.join();
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

uint16_t PortOf(const KvTransport& t) {
    return static_cast<uint16_t>(std::stoi(t.endpoint().substr(t.endpoint().rfind(':') + 1)));
}

std::vector<uint8_t> Bytes(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    return std::vector<uint8_t>(p, p + n);
}

std::vector<uint8_t> Concat(std::initializer_list<std::vector<uint8_t>> parts) {
    std::vector<uint8_t> out;
    for (const std::vector<uint8_t>& p : parts) out.insert(out.end(), p.begin(), p.end());
    return out;
}

std::vector<uint8_t> HelloBytes(const std::string& token = "") {
    const std::string hello = internal::EncodeKvHello(token);
    return Bytes(hello.data(), hello.size());
}

std::vector<uint8_t> TransferBytes(uint64_t id) {
    const internal::KvTransferFrame f = internal::EncodeKvTransferFrame(id);
    return Bytes(f.data(), f.size());
}

std::vector<uint8_t> HeaderBytes(const KvPieceHeader& h, uint64_t payload_bytes, uint64_t hash = 0,
                                 uint8_t flags = 0) {
    const internal::KvPieceFrameHeader f =
        internal::EncodeKvPieceFrameHeader(h, payload_bytes, hash, flags);
    return Bytes(f.data(), f.size());
}

std::vector<uint8_t> PieceBytes(const KvPiece& piece) {
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

// Whether `done()` came true within `bound` (a bound against a hang: it polls).
template <typename Done>
bool Eventually(Done done, milliseconds bound = milliseconds(10'000)) {
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
bool ClosedAsTheClockMoves(VirtualClock& clock, RawPeer& peer, milliseconds step) {
    for (int moves = 0; moves < 20; ++moves) {
        clock.Advance(step);
        if (peer.Closed(milliseconds(500))) return true;
    }
    return false;
}

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
