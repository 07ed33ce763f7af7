// The TCP KV transport end to end over loopback (MakeTcpKvTransport): transport to transport,
// with and without shared memory, the cached connection, and the sender's errors (a closed or
// silent receiver, a refusal, a discarded transfer, a bad endpoint).
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "comm/kv_transport.h"
#include "comm/tcp_kv_wire.h"
#include "tests/comm/kv_transport_test_util.h"

// The helpers of kv_transport_test_util.h, and its aliases (Clock: the steady clock).
namespace kvshard::testing {
namespace {

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
}  // namespace kvshard::testing
