// The shared-memory KV path when a peer dies or goes silent mid-transfer: the sender learns of a
// dead receiver at once, a lost verdict ends by the deadline, and a receiver whose sender died
// mid-piece stages nothing; on both sides the connection, the region and every descriptor go.
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

// A receiver of its own making (a thread on a raw socket) that accepts the hello and the
// region, then reads `read_bytes` of what follows (a transfer frame, a piece header, chunk
// frames) and either closes the connection (it died: the kernel closes a dead process's
// sockets just so) or keeps reading and never answers (the verdict is lost).
class FakeReceiver {
  public:
    enum class Then { kClose, kNeverAnswer };
    FakeReceiver(size_t read_bytes, Then then)
        : acceptor_(io_, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)) {
        endpoint_ = "127.0.0.1:" + std::to_string(acceptor_.local_endpoint().port());
        thread_ = std::thread([this, read_bytes, then] { Serve(read_bytes, then); });
    }
    ~FakeReceiver() { thread_.join(); }
    const std::string& endpoint() const { return endpoint_; }

  private:
    void Serve(size_t read_bytes, Then then) {
        tcp::socket socket(io_);
        acceptor_.accept(socket);
        boost::system::error_code ec;
        if (!AcceptHelloAndRegion(socket, ec)) return;
        std::vector<uint8_t> frames(read_bytes);
        asio::read(socket, asio::buffer(frames), ec);
        if (then == Then::kClose) return;  // the socket closes as the thread ends
        std::array<uint8_t, 4096> sink{};
        while (!ec) socket.read_some(asio::buffer(sink), ec);  // until the sender gives up
    }

    asio::io_context io_;
    tcp::acceptor acceptor_;
    std::string endpoint_;
    std::thread thread_;
};

// The receiver dies mid-transfer, with pieces in flight in the pipeline and one mid-payload
// (waiting for credits): the sender learns it at once (Unavailable, not its deadline), the
// transfer fails, and its connection, region and descriptors are gone.
TEST(KvShm, AReceiverThatDiesMidTransferFailsItAndLeavesNothingAtTheSender) {
    SKIP_WITHOUT_SHM();
    const int descriptors_before = OpenDescriptors();
    const int mappings_before = ShmMappings();
    {
        auto s = Tcp(SmallRegion());
        // Two small pieces' frames (transfer, header, one chunk each) and part of a third's.
        const size_t small_frames =
            internal::kKvTransferFrameBytes +
            2 * (internal::kKvPieceFrameHeaderBytes + internal::kKvChunkFrameBytes) +
            internal::kKvPieceFrameHeaderBytes;
        FakeReceiver dying(small_frames, FakeReceiver::Then::kClose);
        const Clock::time_point deadline = In(60'000);
        Status status;
        for (int layer = 0; layer < 4 && status.ok(); ++layer) {
            KvPiece piece = Piece(51, layer < 2 ? 1 : 64);  // 1.5 KiB twice, then 96 KiB
            piece.header.layer_begin = layer;
            piece.header.layer_end = layer + 1;
            piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
            status = s->SendPipelined(dying.endpoint(), piece, deadline);
        }
        const Status flushed = s->Flush(dying.endpoint(), 51, deadline);
        const Status verdict = status.ok() ? flushed : status;
        EXPECT_EQ(verdict.code(), StatusCode::kUnavailable) << verdict.ToString();
        EXPECT_TRUE(s->Flush(dying.endpoint(), 51, deadline).ok()) << "collected once";
        EXPECT_EQ(ShmMappings(), mappings_before);
    }
    EXPECT_EQ(OpenDescriptors(), descriptors_before);
}

// The verdict is lost (the receiver takes every byte and never answers): the pieces went
// (SendPipelined returned), Flush ends by its deadline with DeadlineExceeded, and the connection
// and its region are gone; a later Flush has nothing left to wait for.
TEST(KvShm, ALostVerdictEndsByTheDeadlineAndFreesTheRegion) {
    SKIP_WITHOUT_SHM();
    const int descriptors_before = OpenDescriptors();
    {
        auto s = Tcp(SmallRegion());
        FakeReceiver silent(1, FakeReceiver::Then::kNeverAnswer);
        ASSERT_TRUE(s->SendPipelined(silent.endpoint(), Piece(61, 2), In(10'000)).ok());
        const Status flushed = s->Flush(silent.endpoint(), 61, In(300));
        EXPECT_EQ(flushed.code(), StatusCode::kDeadlineExceeded) << flushed.ToString();
        EXPECT_EQ(ShmMappings(), 0);
        EXPECT_TRUE(s->Flush(silent.endpoint(), 61, In(300)).ok());
    }
    EXPECT_EQ(OpenDescriptors(), descriptors_before);
}

// The sender's process dies mid-piece (killed: no chance to close anything): the receiver ends
// the connection, gives back the piece's reservation, stages nothing, and lets go of the dead
// sender's region (its descriptor and mapping), and of every descriptor the connection took.
TEST(KvShm, ASenderThatDiesMidPieceLeavesNothingAtTheReceiver) {
    SKIP_WITHOUT_SHM();
    auto r = Tcp();
    int to_parent[2];
    ASSERT_EQ(pipe(to_parent), 0);
    const int descriptors_before = OpenDescriptors();
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        // A sender by hand: the region, a piece of two chunks, only the first one sent.
        Result<internal::KvShmSenderRegion> region =
            internal::KvShmSenderRegion::Create(internal::kMinKvShmRegionBytes);
        RawSender peer(*r);
        const bool offered =
            region.ok() && peer.HelloAndOffer(region->name(), region->bytes()).ok();
        const KvPiece piece = Piece(71, 16);  // 96 KiB
        const uint64_t half = piece.data.size() / 2;
        peer.Write(internal::EncodeKvTransferFrame(71));
        peer.Write(internal::EncodeKvPieceFrameHeader(piece.header, piece.data.size(), 0,
                                                      internal::kKvPieceInRegion));
        std::memcpy(region->data(), piece.data.data(), half);
        peer.Write(internal::EncodeKvChunkFrame(
            {0, half, internal::KvPayloadHash(piece.data.data(), half)}));
        bool credit = false;
        const char ok = offered && peer.Read(&credit).ok() && credit ? 1 : 0;
        (void)!write(to_parent[1], &ok, 1);
        pause();  // killed here, mid-piece
        _exit(1);
    }
    char ok = 0;
    ASSERT_EQ(read(to_parent[0], &ok, 1), 1);
    EXPECT_EQ(ok, 1) << "the first chunk was copied out and credited";
    EXPECT_GT(r->arriving_bytes(), 0);  // the piece is reserved, half arrived
    EXPECT_EQ(ShmMappings(), 1);        // the receiver's, of the child's region
    ASSERT_EQ(kill(child, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    // The receiver's I/O thread notices the end of the connection on its own time: wait for it
    // (bounded), then check that nothing is left.
    for (int i = 0; i < 1'000 && (r->arriving_bytes() != 0 || ShmMappings() != 0 ||
                                  OpenDescriptors() != descriptors_before);
         ++i) {
        std::this_thread::sleep_for(milliseconds(10));
    }
    EXPECT_EQ(r->arriving_bytes(), 0);
    EXPECT_EQ(r->staged_bytes(), 0);
    EXPECT_EQ(ShmDescriptors(), 0);
    EXPECT_EQ(ShmMappings(), 0);
    EXPECT_EQ(OpenDescriptors(), descriptors_before);
    close(to_parent[0]);
    close(to_parent[1]);
}

}  // namespace
}  // namespace kvshard::testing
