// The staging every KV transport shares (comm/kv_staging.h) and the in-process transport
// (MakeLocalKvTransport): stale and discarded transfers, the geometry's and the options' limits,
// the buffer pool, waiting receives and resends.
#include "comm/kv_staging.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "comm/kv_transport.h"
#include "tests/comm/kv_transport_test_util.h"

// The helpers of kv_transport_test_util.h, and its aliases (Clock: the steady clock).
namespace kvshard::testing {
namespace {

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

}  // namespace
}  // namespace kvshard::testing
