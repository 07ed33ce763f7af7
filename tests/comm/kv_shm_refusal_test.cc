// The shared-memory KV path against a broken peer (a hand-written sender on a raw socket, or a
// receiver that never credits): claims outside the agreement or not sealed are refused and the
// connection closed, corrupt or out-of-bounds chunks stage nothing, a deadline passes cleanly,
// and a failed verdict among pipelined pieces fails the transfer and leaves the connection in
// step.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "comm/kv_transport.h"
#include "comm/shm_region.h"
#include "comm/tcp_kv_wire.h"
#include "tests/comm/kv_shm_test_util.h"

namespace kvshard::testing {
namespace {

TEST(KvShm, AClaimOutsideTheAgreementIsRefusedAndTheConnectionClosed) {
    SKIP_WITHOUT_SHM();
    auto r = Tcp();
    Result<internal::KvShmSenderRegion> region =
        internal::KvShmSenderRegion::Create(internal::kMinKvShmRegionBytes * 2);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    struct Case {
        const char* name;
        std::string region_name;
        uint64_t claimed;
    };
    const Case cases[] = {
        {"larger than the agreed maximum", region->name(),
         static_cast<uint64_t>(internal::kMaxKvShmRegionBytes) + 4096},
        {"larger than the object", region->name(), static_cast<uint64_t>(region->bytes()) + 4096},
        {"smaller than the object", region->name(), static_cast<uint64_t>(region->bytes()) / 2},
        {"a name outside /kvshard-kv-PID-FD-SALT", "/../etc/passwd",
         static_cast<uint64_t>(region->bytes())},
    };
    for (const Case& c : cases) {
        RawSender peer(*r);
        const Status answer = peer.HelloAndOffer(c.region_name, c.claimed);
        EXPECT_EQ(answer.code(), StatusCode::kInvalidArgument)
            << c.name << ": " << answer.ToString();
        EXPECT_TRUE(peer.Closed()) << c.name;
    }
    // A memory file that is not sealed could be shrunk under the receiver's mapping: refused.
    {
        const int fd = memfd_create("kvshard-kv-00000000000000aa", MFD_CLOEXEC);
        ASSERT_GE(fd, 0);
        ASSERT_EQ(ftruncate(fd, internal::kMinKvShmRegionBytes), 0);
        char name[64];
        std::snprintf(name, sizeof(name), "/kvshard-kv-%x-%x-00000000000000aa",
                      static_cast<unsigned>(getpid()), static_cast<unsigned>(fd));
        RawSender peer(*r);
        const Status unsealed = peer.HelloAndOffer(name, internal::kMinKvShmRegionBytes);
        EXPECT_EQ(unsealed.code(), StatusCode::kInvalidArgument) << unsealed.ToString();
        EXPECT_TRUE(peer.Closed());
        close(fd);
    }
    // A region the receiver cannot reach (no such process here, or the descriptor is not that
    // region: another process namespace) is declined, not a violation: the connection stays,
    // and carries the payload itself.
    std::string other_salt = region->name();
    other_salt.back() = other_salt.back() == '0' ? '1' : '0';
    for (const std::string& unreachable :
         {std::string("/kvshard-kv-7ffffffe-3-0000000000000000"), other_salt}) {
        RawSender peer(*r);
        const Status missing = peer.HelloAndOffer(unreachable, region->bytes());
        EXPECT_EQ(missing.code(), StatusCode::kNotFound)
            << unreachable << ": " << missing.ToString();
    }
    RawSender peer(*r);
    const Status missing = peer.HelloAndOffer("/kvshard-kv-7ffffffe-3-0000000000000000", 1 << 20);
    EXPECT_EQ(missing.code(), StatusCode::kNotFound) << missing.ToString();
    const KvPiece piece = Piece(11, 2);
    peer.Write(internal::EncodeKvTransferFrame(11));
    peer.Write(internal::EncodeKvPieceFrameHeader(piece.header, piece.data.size(),
                                                  internal::KvPayloadHash(piece.data)));
    peer.Write(piece.data.data(), piece.data.size());
    EXPECT_TRUE(peer.Read().ok());
    EXPECT_TRUE(r->Receive(11, 4 * 6, In(5'000)).ok());
}

TEST(KvShm, CorruptOrOutOfBoundsChunksCloseTheConnectionAndStageNothing) {
    SKIP_WITHOUT_SHM();
    auto r = Tcp();
    const KvPiece piece = Piece(12, 16);  // 96 KiB
    const uint64_t n = piece.data.size();
    struct Case {
        const char* name;
        internal::KvChunk chunk;
        bool corrupt_region;
    };
    const uint64_t region_bytes = 128 << 10;
    const Case cases[] = {
        {"bytes changed after hashing", {0, n, internal::KvPayloadHash(piece.data)}, true},
        {"wrong hash", {0, n, internal::KvPayloadHash(piece.data) ^ 1}, false},
        {"past the region's end", {region_bytes - 4096, 8192, 0}, false},
        {"more than the piece", {0, n + 4096, 0}, false},
    };
    for (const Case& c : cases) {
        Result<internal::KvShmSenderRegion> region =
            internal::KvShmSenderRegion::Create(region_bytes);
        ASSERT_TRUE(region.ok());
        std::memcpy(region->data(), piece.data.data(), n);
        if (c.corrupt_region) region->data()[n / 2] ^= 0x40;
        RawSender peer(*r);
        ASSERT_TRUE(peer.HelloAndOffer(region->name(), region_bytes).ok()) << c.name;
        peer.Write(internal::EncodeKvTransferFrame(12));
        peer.Write(
            internal::EncodeKvPieceFrameHeader(piece.header, n, 0, internal::kKvPieceInRegion));
        peer.Write(internal::EncodeKvChunkFrame(c.chunk));
        EXPECT_TRUE(peer.Closed()) << c.name;
        EXPECT_EQ(r->staged_bytes(), 0) << c.name;
        EXPECT_EQ(r->arriving_bytes(), 0) << c.name;
    }
    // A region piece on a connection that was offered no region is a violation too.
    RawSender bare(*r);
    bare.Write(internal::EncodeKvHello(""));
    ASSERT_TRUE(bare.Read().ok());
    bare.Write(internal::EncodeKvTransferFrame(12));
    bare.Write(internal::EncodeKvPieceFrameHeader(piece.header, n, 0, internal::kKvPieceInRegion));
    EXPECT_EQ(bare.Read().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(bare.Closed());
    // Chunk by chunk with credits, as the transport does, it is staged.
    Result<internal::KvShmSenderRegion> region = internal::KvShmSenderRegion::Create(region_bytes);
    ASSERT_TRUE(region.ok());
    RawSender good(*r);
    ASSERT_TRUE(good.HelloAndOffer(region->name(), region_bytes).ok());
    good.Write(internal::EncodeKvTransferFrame(12));
    good.Write(internal::EncodeKvPieceFrameHeader(piece.header, n, 0, internal::kKvPieceInRegion));
    const uint64_t half = n / 2;
    for (uint64_t at : {uint64_t{0}, half}) {
        std::memcpy(region->data(), piece.data.data() + at, half);
        good.Write(internal::EncodeKvChunkFrame(
            {0, half, internal::KvPayloadHash(piece.data.data() + at, half)}));
        bool credit = false;
        ASSERT_TRUE(good.Read(&credit).ok());
        EXPECT_EQ(credit, at == 0);  // the last chunk is answered by the acknowledgement
    }
    Result<std::vector<KvPiece>> got = r->Receive(12, 4 * 6, In(5'000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE((*got)[0].data == piece.data);
    // Uncredited, its chunks in distinct slots: no credit comes back, the first answer is the
    // acknowledgement, and the piece is staged.
    good.Write(internal::EncodeKvTransferFrame(14));
    KvPiece other = Piece(14, 16);
    good.Write(internal::EncodeKvPieceFrameHeader(
        other.header, n, 0, internal::kKvPieceInRegion | internal::kKvPieceUncredited));
    for (uint64_t at : {uint64_t{0}, half}) {
        std::memcpy(region->data() + at, other.data.data() + at, half);
        good.Write(internal::EncodeKvChunkFrame(
            {at, half, internal::KvPayloadHash(other.data.data() + at, half)}));
    }
    bool credit = true;
    EXPECT_TRUE(good.Read(&credit).ok());
    EXPECT_FALSE(credit) << "a credit for an uncredited piece";
    got = r->Receive(14, 4 * 6, In(5'000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE((*got)[0].data == other.data);
    // The flag means nothing without the region: a piece carrying it alone is malformed.
    EXPECT_EQ(
        internal::DecodeKvPieceFrameHeader(
            internal::EncodeKvPieceFrameHeader(other.header, n, 0, internal::kKvPieceUncredited))
            .status()
            .code(),
        StatusCode::kDataLoss);
}

// A receiver that accepts the region and then never credits a chunk: the sender's deadline
// passes, and its region goes with the connection.
TEST(KvShm, ADeadlinePassesCleanlyAndTheRegionGoesWithTheConnection) {
    SKIP_WITHOUT_SHM();
    asio::io_context io;
    tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    const std::string endpoint = "127.0.0.1:" + std::to_string(acceptor.local_endpoint().port());
    std::thread receiver([&] {
        tcp::socket socket(io);
        acceptor.accept(socket);
        boost::system::error_code ec;
        if (!AcceptHelloAndRegion(socket, ec)) return;
        std::array<uint8_t, 4096> sink{};
        while (!ec) socket.read_some(asio::buffer(sink), ec);  // until the sender gives up
    });
    const int descriptors_before = ShmDescriptors();
    auto s = Tcp(SmallRegion());
    const Clock::time_point deadline = In(300);
    const Status status = s->Send(endpoint, Piece(13, 64), deadline);
    EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
    EXPECT_GE(Clock::now(), deadline);
    EXPECT_LT(Clock::now(), deadline + milliseconds(2'000));
    receiver.join();
    EXPECT_EQ(ShmDescriptors(), descriptors_before);
    EXPECT_EQ(ShmMappings(), 0);
}

// A refusal among pipelined pieces (the receiver's staging is full) fails the transfer: the next
// SendPipelined or the Flush returns it, and once flushed nothing of it is in flight, the
// connection stays in step, and the next transfer goes through.
TEST(KvShm, AFailedVerdictAmongPipelinedPiecesFailsTheTransferCleanly) {
    SKIP_WITHOUT_SHM();
    KvTransportOptions small;
    small.max_staged_bytes = 3 * KvPieceBytes(Piece(0, 8).header);  // three pieces
    auto r = Tcp(small);
    auto s = Tcp(SmallRegion());
    Status first_failure;
    int sent = 0;
    for (int layer = 0; layer < 4 && first_failure.ok(); ++layer) {
        KvPiece piece = Piece(41, 8);
        piece.header.layer_begin = layer;
        piece.header.layer_end = layer + 1;
        piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
        piece.header.num_blocks = 8 * 4;  // four times the bytes per layer: 48 KiB
        piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
        first_failure = s->SendPipelined(r->endpoint(), piece, In(10'000));
        if (first_failure.ok()) ++sent;
    }
    const Status flushed = s->Flush(r->endpoint(), 41, In(10'000));
    const Status verdict = first_failure.ok() ? flushed : first_failure;
    EXPECT_EQ(verdict.code(), StatusCode::kResourceExhausted) << verdict.ToString();
    EXPECT_GE(sent, 3);
    // Collected: flushing again finds nothing, and the receiver holds no reservation.
    EXPECT_TRUE(s->Flush(r->endpoint(), 41, In(10'000)).ok());
    EXPECT_EQ(r->arriving_bytes(), 0);
    r->Discard(41);  // as the coordinator does with a failed transfer
    EXPECT_EQ(r->staged_bytes(), 0);
    // A receiver that discards the transfer while its pieces are in flight: Aborted.
    KvPiece piece = Piece(42, 8);
    ASSERT_TRUE(s->SendPipelined(r->endpoint(), piece, In(10'000)).ok());
    r->Discard(42);
    piece.header.layer_begin = 1;  // a distinct piece (1 layer of the 4 heads' rows)
    piece.header.layer_end = 2;
    piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
    const Status after_discard = s->SendPipelined(r->endpoint(), piece, In(10'000));
    const Status discarded =
        after_discard.ok() ? s->Flush(r->endpoint(), 42, In(10'000)) : after_discard;
    EXPECT_EQ(discarded.code(), StatusCode::kAborted) << discarded.ToString();
    (void)s->Flush(r->endpoint(), 42, In(10'000));
    // The same connection carries the next transfer.
    const KvPiece next = Piece(43, 8);
    ASSERT_TRUE(s->Send(r->endpoint(), next, In(10'000)).ok());
    Result<std::vector<KvPiece>> got = r->Receive(43, 4 * 6, In(10'000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE((*got)[0].data == next.data);
}

}  // namespace
}  // namespace kvshard::testing
