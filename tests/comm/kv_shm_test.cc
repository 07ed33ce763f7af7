// The TCP KV transport's shared-memory path between processes of one host (comm/shm_region.h,
// docs/disaggregation.md): payloads arrive intact through the region, corruption and claims
// outside the agreement or not sealed are refused, a deadline passes cleanly, and neither
// descriptors nor mappings outlive their connection. Loopback in one process: the receiver opens
// the region by name (/proc/PID/fd/FD) exactly as another process would.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

// Boost 1.74's asio/awaitable.hpp uses std::exchange without including <utility>.
// clang-format off
#include <utility>
#include <boost/asio.hpp>
// clang-format on

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/kv_transport.h"
#include "comm/shm_region.h"
#include "comm/tcp_kv_wire.h"
#include "common/check.h"

namespace kvshard {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Clock::time_point In(int64_t ms) { return Clock::now() + milliseconds(ms); }

// `blocks` blocks of 4 layers x 6 heads x 4 slots x 8 dims of f32: 1.5 KiB a block-layer.
KvPiece Piece(uint64_t transfer_id, int32_t blocks) {
    KvPiece piece;
    piece.header = {.transfer_id = transfer_id,
                    .layer_begin = 0,
                    .layer_end = 4,
                    .head_begin = 0,
                    .head_end = 6,
                    .num_blocks = blocks,
                    .block_size = 4,
                    .head_dim = 8,
                    .dtype = KvDtype::kFp32};
    piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
    for (size_t i = 0; i < piece.data.size(); ++i) {
        piece.data[i] = static_cast<uint8_t>((i * 2654435761u) >> 13 ^ transfer_id);
    }
    return piece;
}

std::unique_ptr<KvTransport> Tcp(KvTransportOptions options = {}) {
    Result<std::unique_ptr<KvTransport>> t = MakeTcpKvTransport("127.0.0.1", 0, options);
    KV_CHECK(t.ok()) << t.status().ToString();
    return std::move(t).value();
}

KvTransportOptions SmallRegion() {
    KvTransportOptions options;
    options.shm_region_bytes = internal::kMinKvShmRegionBytes;  // 4 slots of 16 KiB
    return options;
}

constexpr char kRegionFile[] = "/memfd:kvshard-kv-";

// Descriptors of this process open on a region (the receiver's, and the sender's).
int ShmDescriptors() {
    int n = 0;
    DIR* dir = opendir("/proc/self/fd");
    KV_CHECK(dir != nullptr);
    while (dirent* e = readdir(dir)) {
        char target[512] = {};
        const std::string path = std::string("/proc/self/fd/") + e->d_name;
        const ssize_t len = readlink(path.c_str(), target, sizeof(target) - 1);
        if (len > 0 && std::string(target, len).rfind(kRegionFile, 0) == 0) ++n;
    }
    closedir(dir);
    return n;
}

// Every descriptor this process has open.
int OpenDescriptors() {
    int n = 0;
    DIR* dir = opendir("/proc/self/fd");
    KV_CHECK(dir != nullptr);
    while (dirent* e = readdir(dir)) {
        if (e->d_name[0] != '.') ++n;
    }
    closedir(dir);
    return n - 1;  // the directory's own
}

// Mappings of regions in this process (the receiver's, and the sender's).
int ShmMappings() {
    std::ifstream maps("/proc/self/maps");
    int n = 0;
    for (std::string line; std::getline(maps, line);) {
        if (line.find(kRegionFile) != std::string::npos) ++n;
    }
    return n;
}

bool SameHostPathAvailable() {
    if (internal::KvHostBootId().empty()) return false;
    Result<internal::KvShmSenderRegion> probe =
        internal::KvShmSenderRegion::Create(internal::kMinKvShmRegionBytes);
    return probe.ok();
}

#define SKIP_WITHOUT_SHM() \
    if (!SameHostPathAvailable()) GTEST_SKIP() << "no boot id or no memfd_create here"

TEST(KvShm, ManyChunkPiecesArriveIntactThroughTheRegionAndNothingOutlivesIt) {
    SKIP_WITHOUT_SHM();
    const int descriptors_before = ShmDescriptors();
    const int mappings_before = ShmMappings();
    {
        auto r = Tcp();
        auto s = Tcp(SmallRegion());
        // 64 blocks: 384 KiB, 24 chunks through 4 slots of 16 KiB, the ring wrapping 6 times.
        for (uint64_t id = 1; id <= 3; ++id) {
            const KvPiece piece = Piece(id, 64);
            ASSERT_TRUE(s->Send(r->endpoint(), piece, In(10'000)).ok());
            Result<std::vector<KvPiece>> got = r->Receive(id, 4 * 6, In(10'000));
            ASSERT_TRUE(got.ok()) << got.status().ToString();
            ASSERT_EQ(got->size(), 1u);
            EXPECT_EQ((*got)[0].header, piece.header);
            EXPECT_TRUE((*got)[0].data == piece.data) << "transfer " << id;
            r->Recycle(std::move(*got));
        }
        // It went through one region for the connection's life: the receiver and the sender
        // each hold one descriptor and one mapping of it.
        EXPECT_EQ(ShmDescriptors() - descriptors_before, 2);
        EXPECT_EQ(ShmMappings() - mappings_before, 2);
    }
    EXPECT_EQ(ShmDescriptors(), descriptors_before);
    EXPECT_EQ(ShmMappings(), mappings_before);
}

// Two processes: a forked child sends through its own region; the piece arrives intact and it
// went through shared memory (the receiver holds a descriptor and a mapping of the child's
// region, which stays readable after the child is gone, until the connection closes).
TEST(KvShm, BetweenTwoProcesses) {
    SKIP_WITHOUT_SHM();
    auto r = Tcp();
    const std::string endpoint = r->endpoint();
    const KvPiece piece = Piece(20, 96);  // 576 KiB
    int to_parent[2], to_child[2];
    ASSERT_EQ(pipe(to_parent), 0);
    ASSERT_EQ(pipe(to_child), 0);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        // The child makes its own transport, sends, reports, waits for the parent's look at
        // the descriptors, and leaves without running the parent's destructors.
        Result<std::unique_ptr<KvTransport>> s = MakeTcpKvTransport("127.0.0.1", 0, {});
        const char ok = s.ok() && (*s)->Send(endpoint, piece, In(10'000)).ok() ? 1 : 0;
        (void)!write(to_parent[1], &ok, 1);
        char go = 0;
        (void)!read(to_child[0], &go, 1);
        _exit(ok ? 0 : 1);
    }
    char ok = 0;
    ASSERT_EQ(read(to_parent[0], &ok, 1), 1);
    EXPECT_EQ(ok, 1);
    EXPECT_EQ(ShmDescriptors(), 1);  // the receiver's, of the child's region
    EXPECT_EQ(ShmMappings(), 1);
    Result<std::vector<KvPiece>> got = r->Receive(20, 4 * 6, In(10'000));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE((*got)[0].data == piece.data);
    const char go = 1;
    ASSERT_EQ(write(to_child[1], &go, 1), 1);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    r.reset();  // closes the connection: its region goes with it
    EXPECT_EQ(ShmDescriptors(), 0);
    EXPECT_EQ(ShmMappings(), 0);
    for (int fd : {to_parent[0], to_parent[1], to_child[0], to_child[1]}) close(fd);
}

TEST(KvShm, EitherSideSwitchedOffCarriesPayloadsOverTheSocket) {
    SKIP_WITHOUT_SHM();
    KvTransportOptions off;
    off.shared_memory = false;
    const int descriptors_before = ShmDescriptors();
    struct Case {
        const char* name;
        KvTransportOptions sender, receiver;
    };
    const Case cases[] = {{"sender off", off, {}}, {"receiver off", {}, off}};
    for (const Case& c : cases) {
        auto r = Tcp(c.receiver);
        auto s = Tcp(c.sender);
        const KvPiece piece = Piece(9, 40);
        ASSERT_TRUE(s->Send(r->endpoint(), piece, In(10'000)).ok()) << c.name;
        Result<std::vector<KvPiece>> got = r->Receive(9, 4 * 6, In(10'000));
        ASSERT_TRUE(got.ok()) << c.name << ": " << got.status().ToString();
        EXPECT_TRUE((*got)[0].data == piece.data) << c.name;
        EXPECT_EQ(ShmDescriptors(), descriptors_before) << c.name;
    }
}

// A hand-written sender on a raw socket that offers a region of its own making.
class RawSender {
  public:
    explicit RawSender(const KvTransport& receiver) : socket_(io_) {
        const std::string& e = receiver.endpoint();
        const auto port = static_cast<uint16_t>(std::stoi(e.substr(e.rfind(':') + 1)));
        socket_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    }

    void Write(const void* data, size_t n) {
        boost::system::error_code ignored;  // a receiver that already closed is what tests check
        asio::write(socket_, asio::buffer(data, n), ignored);
    }
    void Write(const std::string& s) { Write(s.data(), s.size()); }
    template <size_t N>
    void Write(const std::array<uint8_t, N>& a) {
        Write(a.data(), a.size());
    }

    // The next frame from the receiver: an acknowledgement's status, or OK for a credit;
    // Internal when the connection closed first.
    Status Read(bool* was_credit = nullptr) {
        std::array<uint8_t, internal::kKvAckFrameHeaderBytes> header{};
        boost::system::error_code ec;
        asio::read(socket_, asio::buffer(header), ec);
        if (ec) return Status(StatusCode::kInternal, "closed: " + ec.message());
        if (was_credit != nullptr) *was_credit = internal::IsKvCreditFrame(header.data());
        if (internal::IsKvCreditFrame(header.data())) return Status::Ok();
        Result<internal::DecodedKvAckHeader> ack = internal::DecodeKvAckFrameHeader(header);
        if (!ack.ok()) return Status(StatusCode::kInternal, ack.status().ToString());
        std::string message(ack->message_bytes, '\0');
        asio::read(socket_, asio::buffer(message), ec);
        if (ec) return Status(StatusCode::kInternal, "cut short");
        last_message_ = message;
        return Status(ack->code, message);
    }

    // Whether the receiver closed the connection (anything before the end is dropped).
    bool Closed() {
        std::array<uint8_t, 256> buffer{};
        boost::system::error_code ec;
        while (!ec) socket_.read_some(asio::buffer(buffer), ec);
        return ec == asio::error::eof || ec == asio::error::connection_reset;
    }

    // Hello, then an offer of `name` claiming `claimed` bytes; the offer's answer.
    Status HelloAndOffer(const std::string& name, uint64_t claimed) {
        Write(internal::EncodeKvHello(""));
        Status hello = Read();
        if (!hello.ok()) return hello.WithContext("hello");
        EXPECT_EQ(last_message_, internal::KvHostBootId());
        Write(internal::EncodeKvOfferFrame(name, claimed));
        return Read();
    }

    const std::string& last_message() const { return last_message_; }

  private:
    asio::io_context io_;
    tcp::socket socket_;
    std::string last_message_;
};

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
        std::array<uint8_t, internal::kKvHelloHeaderBytes> hello{};
        asio::read(socket, asio::buffer(hello), ec);
        asio::write(socket,
                    asio::buffer(internal::EncodeKvAckFrame(
                        0, Status(StatusCode::kOk, internal::KvHostBootId()))),
                    ec);
        std::array<uint8_t, internal::kKvOfferFrameHeaderBytes> offer{};
        asio::read(socket, asio::buffer(offer), ec);
        Result<internal::DecodedKvOfferHeader> decoded = internal::DecodeKvOfferFrameHeader(offer);
        if (!decoded.ok()) return;
        std::string name(decoded->name_bytes, '\0');
        asio::read(socket, asio::buffer(name), ec);
        asio::write(socket, asio::buffer(internal::EncodeKvAckFrame(0, Status::Ok())), ec);
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

// A layer-wise transfer, pipelined as a sending worker sends it: pieces of several sizes (some
// fit the region whole and go uncredited, some need credits), two transfers interleaved, the ring
// wrapping across pieces; every piece arrives intact, Flush collects every verdict, and nothing
// of it outlives the connection.
TEST(KvShm, PipelinedPiecesOfSeveralSizesArriveIntactAndFlushCollectsTheirVerdicts) {
    SKIP_WITHOUT_SHM();
    const int descriptors_before = OpenDescriptors();
    const int mappings_before = ShmMappings();
    {
        auto r = Tcp();
        auto s = Tcp(SmallRegion());  // 64 KiB
        std::vector<KvPiece> sent;
        const int32_t blocks[] = {1, 3, 64, 2, 10, 40, 5};  // 6 KiB .. 384 KiB
        for (int layer = 0; layer < 4; ++layer) {
            for (uint64_t id : {31, 32}) {
                KvPiece piece = Piece(id, blocks[(layer * 2 + id) % 7]);
                piece.header.layer_begin = layer;
                piece.header.layer_end = layer + 1;
                piece.data.resize(static_cast<size_t>(KvPieceBytes(piece.header)));
                ASSERT_TRUE(s->SendPipelined(r->endpoint(), piece, In(10'000)).ok());
                sent.push_back(std::move(piece));
            }
        }
        EXPECT_TRUE(s->Flush(r->endpoint(), 31, In(10'000)).ok());
        EXPECT_TRUE(s->Flush(r->endpoint(), 32, In(10'000)).ok());
        EXPECT_TRUE(s->Flush(r->endpoint(), 99, In(10'000)).ok()) << "nothing sent: nothing due";
        for (uint64_t id : {31, 32}) {
            // Every verdict came back OK, so every piece is staged already.
            Result<std::vector<KvPiece>> got = r->Receive(id, 4 * 6, In(0));
            ASSERT_TRUE(got.ok()) << got.status().ToString();
            ASSERT_EQ(got->size(), 4u);
            for (const KvPiece& g : *got) {
                bool found = false;
                for (const KvPiece& want : sent) {
                    if (want.header == g.header) {
                        found = true;
                        EXPECT_TRUE(want.data == g.data)
                            << "transfer " << id << " layer " << g.header.layer_begin;
                    }
                }
                EXPECT_TRUE(found);
            }
        }
        EXPECT_EQ(ShmMappings() - mappings_before, 2);  // one region for the connection
    }
    EXPECT_EQ(OpenDescriptors(), descriptors_before);
    EXPECT_EQ(ShmMappings(), mappings_before);
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
        std::array<uint8_t, internal::kKvHelloHeaderBytes> hello{};
        asio::read(socket, asio::buffer(hello), ec);
        asio::write(socket,
                    asio::buffer(internal::EncodeKvAckFrame(
                        0, Status(StatusCode::kOk, internal::KvHostBootId()))),
                    ec);
        std::array<uint8_t, internal::kKvOfferFrameHeaderBytes> offer{};
        asio::read(socket, asio::buffer(offer), ec);
        Result<internal::DecodedKvOfferHeader> decoded = internal::DecodeKvOfferFrameHeader(offer);
        if (!decoded.ok()) return;
        std::string name(decoded->name_bytes, '\0');
        asio::read(socket, asio::buffer(name), ec);
        asio::write(socket, asio::buffer(internal::EncodeKvAckFrame(0, Status::Ok())), ec);
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

TEST(KvShm, RegionCopiesStayInsideTheAnnouncedSizeAndCheckWhatWasCopied) {
    SKIP_WITHOUT_SHM();
    Result<internal::KvShmSenderRegion> region =
        internal::KvShmSenderRegion::Create(internal::kMinKvShmRegionBytes * 4);
    ASSERT_TRUE(region.ok());
    // Larger than one hashed piece, so the copy is hashed piece by piece.
    std::vector<uint8_t> in(40'000 * 4);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 7 + (i >> 9));
    const uint64_t sent_hash = region->CopyIn(4096, in.data(), in.size());
    EXPECT_EQ(sent_hash, internal::KvPayloadHash(in));
    Result<internal::KvShmReceiverRegion> opened =
        internal::KvShmReceiverRegion::Open(region->name(), region->bytes());
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    std::vector<uint8_t> out(in.size());
    Result<uint64_t> got = opened->CopyOut(4096, static_cast<int64_t>(out.size()), out.data());
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, sent_hash);
    EXPECT_TRUE(out == in);
    EXPECT_EQ(opened->CopyOut(region->bytes() - 8, 16, out.data()).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(opened->CopyOut(-1, 8, out.data()).status().code(), StatusCode::kInvalidArgument);
    // The sender's region is sealed: it cannot shrink it under the receiver's mapping.
    Result<internal::KvShmName> parts = internal::ParseKvShmName(region->name());
    ASSERT_TRUE(parts.ok());
    EXPECT_EQ(parts->pid, getpid());
    EXPECT_NE(ftruncate(parts->fd, 4096), 0);
    // Gone with its sender; what the receiver mapped stays readable until it lets go.
    const std::string name = region->name();
    const int64_t bytes = region->bytes();
    *region = internal::KvShmSenderRegion();
    EXPECT_EQ(internal::KvShmReceiverRegion::Open(name, bytes).status().code(),
              StatusCode::kNotFound);
    got = opened->CopyOut(4096, 64, out.data());
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(out[10], in[10]);
    for (const char* bad : {"/kvshard-kv-", "/kvshard-kv-ab/c", "/kvshard-kv-1-2-3",
                            "/kvshard-kv-0-3-0123456789abcdef", "/kvshard-kv-1-3-0123456789ABCDEF",
                            "/kvshard-kv-123456789-3-0123456789abcdef"}) {
        EXPECT_FALSE(internal::IsKvShmName(bad)) << bad;
    }
    EXPECT_TRUE(internal::IsKvShmName("/kvshard-kv-1f-3-0123456789abcdef"));
}

// The receiver's copy out streams to its destination past a bounce buffer: every destination
// alignment and every size around the 16-byte stores and the bounce buffer's edge gets exactly
// the bytes, and the hash of what it wrote.
TEST(KvShm, CopiesOutIntactAtEveryDestinationAlignmentAndSize) {
    SKIP_WITHOUT_SHM();
    Result<internal::KvShmSenderRegion> region =
        internal::KvShmSenderRegion::Create(internal::kMinKvShmRegionBytes);
    ASSERT_TRUE(region.ok());
    std::vector<uint8_t> in(40'000);
    for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint8_t>(i * 13 + (i >> 7));
    region->CopyIn(0, in.data(), in.size());
    Result<internal::KvShmReceiverRegion> opened =
        internal::KvShmReceiverRegion::Open(region->name(), region->bytes());
    ASSERT_TRUE(opened.ok()) << opened.status().ToString();
    std::vector<uint8_t> out(in.size() + 80);
    for (size_t misalign = 0; misalign < 17; ++misalign) {
        for (size_t n : {size_t{1}, size_t{15}, size_t{16}, size_t{63}, size_t{64}, size_t{65},
                         size_t{16'383}, size_t{16'384}, size_t{16'385}, size_t{39'999}}) {
            std::fill(out.begin(), out.end(), uint8_t{0xA5});
            Result<uint64_t> got =
                opened->CopyOut(1, static_cast<int64_t>(n), out.data() + misalign);
            ASSERT_TRUE(got.ok()) << got.status().ToString();
            const std::vector<uint8_t> want(in.begin() + 1, in.begin() + 1 + static_cast<long>(n));
            EXPECT_EQ(*got, internal::KvPayloadHash(want)) << misalign << " " << n;
            EXPECT_TRUE(std::equal(want.begin(), want.end(), out.begin() + misalign))
                << misalign << " " << n;
            // Nothing written outside [misalign, misalign + n).
            for (size_t i = 0; i < misalign; ++i) ASSERT_EQ(out[i], 0xA5) << misalign << " " << n;
            for (size_t i = misalign + n; i < out.size(); ++i) {
                ASSERT_EQ(out[i], 0xA5) << misalign << " " << n;
            }
        }
    }
}

}  // namespace
}  // namespace kvshard
