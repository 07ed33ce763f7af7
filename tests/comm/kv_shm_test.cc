// The TCP KV transport's shared-memory path between processes of one host (comm/shm_region.h,
// docs/disaggregation.md): payloads arrive intact through the region, one piece or many
// pipelined, between two processes too; either side switched off carries them over the socket;
// neither descriptors nor mappings outlive their connection; the region's copies stay inside it
// and check what they copied. Loopback in one process: the receiver opens the region by name
// (/proc/PID/fd/FD) exactly as another process would. kv_shm_refusal_test.cc and
// kv_shm_dead_peer_test.cc have the broken and the dying peers.
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
#include "tests/comm/kv_shm_test_util.h"

namespace kvshard::testing {
namespace {

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
    KvTransportOptions on, off;
    off.shared_memory = false;
    const int descriptors_before = ShmDescriptors();
    struct Case {
        const char* name;
        KvTransportOptions sender, receiver;
    };
    // Named options, not `{}`: GCC 12 warns (-Wmaybe-uninitialized) about a value-initialized
    // member string in the array's initializer.
    const Case cases[] = {{"sender off", off, on}, {"receiver off", on, off}};
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
}  // namespace kvshard::testing
