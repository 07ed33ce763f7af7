// The socket test link of the KV pair path (comm/socket_kv_pair_channel.h) on loopback: the
// transfer protocol (comm/kv_pair_protocol.h) over it in announcement order, a sender that starts
// before the receiver, a peer that goes away mid-transfer (the other side fails at once, not at
// its deadline), a receive timeout that fails the channel for good, a frame of the wrong size,
// a connection with another pair's id ignored, and bad ids and ranks refused.
#include "comm/socket_kv_pair_channel.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <map>
#include <numeric>
#include <thread>
#include <vector>

#include "comm/kv_nccl_pairs.h"
#include "comm/kv_pair_protocol.h"

namespace kvshard {
namespace {

using Clock = KvPairChannel::Clock;
using std::chrono::milliseconds;

struct Pair {
    std::unique_ptr<KvPairChannel> sender;
    std::unique_ptr<KvPairChannel> receiver;
};

Pair MakePair() {
    Result<std::string> id = NewSocketKvPairId("127.0.0.1");
    EXPECT_TRUE(id.ok()) << id.status().ToString();
    Pair p;
    Result<std::unique_ptr<KvPairChannel>> r = MakeSocketKvPairChannel(*id, 1);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    Result<std::unique_ptr<KvPairChannel>> s = MakeSocketKvPairChannel(*id, 0);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    p.receiver = std::move(*r);
    p.sender = std::move(*s);
    return p;
}

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
    std::vector<uint8_t> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
    return v;
}

TEST(SocketKvPairChannel, IdsAreUniqueAndRecognized) {
    Result<std::string> a = NewSocketKvPairId("127.0.0.1");
    Result<std::string> b = NewSocketKvPairId("127.0.0.1");
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->size(), kKvNcclUniqueIdBytes);
    EXPECT_NE(*a, *b);
    EXPECT_TRUE(IsSocketKvPairId(*a));
    EXPECT_FALSE(IsSocketKvPairId(std::string(kKvNcclUniqueIdBytes, 'x')));
}

TEST(SocketKvPairChannel, RefusesBadIdsAndRanks) {
    Result<std::string> id = NewSocketKvPairId("127.0.0.1");
    ASSERT_TRUE(id.ok());
    EXPECT_EQ(MakeSocketKvPairChannel(*id, 2).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(MakeSocketKvPairChannel("not an id", 0).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(MakeSocketKvPairChannel(std::string(kKvNcclUniqueIdBytes, '\0'), 1).status().code(),
              StatusCode::kInvalidArgument);
    Pair p = MakePair();
    std::vector<uint8_t> buf(4);
    EXPECT_EQ(p.sender->Recv(buf.data(), 4, Clock::now() + milliseconds(100)).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(p.receiver->Send(buf.data(), 4, Clock::now() + milliseconds(100)).code(),
              StatusCode::kInvalidArgument);
}

// The protocol over the link: offers sent in the order the receiver announces them, not the
// order they were offered; bytes arrive intact.
TEST(SocketKvPairChannel, ProtocolSendsInAnnouncementOrder) {
    Pair p = MakePair();
    // Before the sender: its thread may end them until it is destroyed.
    std::vector<std::vector<uint8_t>> data;
    std::vector<std::promise<Status>> done(3);
    KvPairSender sender(p.sender.get(), 5'000, 8);
    for (uint64_t t = 0; t < 3; ++t) data.push_back(Bytes(3 * 1'000 * (t + 1), uint8_t(t)));
    for (uint64_t t = 0; t < 3; ++t) {
        ASSERT_TRUE(sender
                        .Offer({.transfer_id = 10 + t,
                                .num_blocks = int64_t(3 * (t + 1)),
                                .bytes_per_block = 1'000},
                               data[t].data(), [&, t](const Status& st) { done[t].set_value(st); })
                        .ok());
    }
    // The receiver numbers its receives 20, 21, 22; they ask for offers 12, 10, 11.
    const std::map<uint64_t, uint64_t> asks = {{20, 12}, {21, 10}, {22, 11}};
    KvPairReceiver receiver(
        p.receiver.get(), {.max_blocks = 100, .bytes_per_block = 1'000},
        [&](uint64_t id) { return sender.Ready(asks.at(id)); }, 5'000);
    uint64_t next = 20;
    for (uint64_t t : {2, 0, 1}) {
        std::vector<uint8_t> got(data[t].size());
        ASSERT_TRUE(receiver
                        .Receive({.transfer_id = next++,
                                  .num_blocks = int64_t(3 * (t + 1)),
                                  .bytes_per_block = 1'000},
                                 got.data(), got.size())
                        .ok());
        EXPECT_EQ(got, data[t]);
    }
    for (auto& d : done) EXPECT_TRUE(d.get_future().get().ok());
}

TEST(SocketKvPairChannel, SenderFirstConnectsWhenTheReceiverComes) {
    Pair p = MakePair();
    const std::vector<uint8_t> data = Bytes(64, 3);
    std::future<Status> sent = std::async(std::launch::async, [&] {
        return p.sender->Send(data.data(), data.size(), Clock::now() + milliseconds(5'000));
    });
    std::vector<uint8_t> got(64);
    ASSERT_TRUE(p.receiver->Recv(got.data(), got.size(), Clock::now() + milliseconds(5'000)).ok());
    EXPECT_TRUE(sent.get().ok());
    EXPECT_EQ(got, data);
}

TEST(SocketKvPairChannel, PeerGoneFailsTheOtherSideAtOnce) {
    Pair p = MakePair();
    std::vector<uint8_t> one = Bytes(16, 1), got(16);
    std::future<Status> sent = std::async(std::launch::async, [&] {
        return p.sender->Send(one.data(), one.size(), Clock::now() + milliseconds(5'000));
    });
    ASSERT_TRUE(p.receiver->Recv(got.data(), got.size(), Clock::now() + milliseconds(5'000)).ok());
    ASSERT_TRUE(sent.get().ok());
    // The sender's process goes away while the receiver waits for the next transfer.
    const auto start = Clock::now();
    std::thread killer([&] {
        std::this_thread::sleep_for(milliseconds(100));  // the receive is posted by then
        p.sender.reset();
    });
    const Status st = p.receiver->Recv(got.data(), got.size(), Clock::now() + milliseconds(20'000));
    killer.join();
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
    EXPECT_LT(Clock::now() - start, milliseconds(10'000));
    // Failed for good.
    EXPECT_FALSE(p.receiver->Recv(got.data(), got.size(), Clock::now() + milliseconds(100)).ok());
}

TEST(SocketKvPairChannel, AbortEndsACallInProgress) {
    Pair p = MakePair();
    std::vector<uint8_t> got(16);
    std::thread aborter([&] {
        std::this_thread::sleep_for(milliseconds(100));
        p.receiver->Abort(Aborted("test"));
    });
    const auto start = Clock::now();
    const Status st = p.receiver->Recv(got.data(), got.size(), Clock::now() + milliseconds(20'000));
    aborter.join();
    EXPECT_EQ(st.code(), StatusCode::kAborted) << st.ToString();
    EXPECT_LT(Clock::now() - start, milliseconds(10'000));
}

TEST(SocketKvPairChannel, ReceiveTimeoutFailsTheChannel) {
    Pair p = MakePair();
    std::vector<uint8_t> got(16);
    const Status st = p.receiver->Recv(got.data(), got.size(), Clock::now() + milliseconds(200));
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
    EXPECT_EQ(p.receiver->Recv(got.data(), got.size(), Clock::now() + milliseconds(5'000)).code(),
              StatusCode::kDeadlineExceeded);
}

TEST(SocketKvPairChannel, SendWithoutAReceiverTimesOut) {
    Result<std::string> id = NewSocketKvPairId("127.0.0.1");
    ASSERT_TRUE(id.ok());
    Result<std::unique_ptr<KvPairChannel>> s = MakeSocketKvPairChannel(*id, 0);
    ASSERT_TRUE(s.ok());
    std::vector<uint8_t> data(16);
    const Status st = (*s)->Send(data.data(), data.size(), Clock::now() + milliseconds(300));
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
}

TEST(SocketKvPairChannel, FrameOfAnotherSizeIsRefused) {
    Pair p = MakePair();
    std::vector<uint8_t> data(8), got(16);
    std::future<Status> sent = std::async(std::launch::async, [&] {
        return p.sender->Send(data.data(), data.size(), Clock::now() + milliseconds(5'000));
    });
    const Status st = p.receiver->Recv(got.data(), got.size(), Clock::now() + milliseconds(5'000));
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
    EXPECT_NE(st.message().find("sent 8"), std::string::npos) << st.ToString();
    (void)sent.get();
}

TEST(SocketKvPairChannel, ConnectionWithAnotherPairsIdIsIgnored) {
    Result<std::string> id = NewSocketKvPairId("127.0.0.1");
    ASSERT_TRUE(id.ok());
    Result<std::unique_ptr<KvPairChannel>> r = MakeSocketKvPairChannel(*id, 1);
    ASSERT_TRUE(r.ok());
    // Same address, another secret.
    std::string other = *id;
    const size_t secret = other.rfind(' ') + 1;
    other[secret] = other[secret] == 'a' ? 'b' : 'a';
    Result<std::unique_ptr<KvPairChannel>> s = MakeSocketKvPairChannel(other, 0);
    ASSERT_TRUE(s.ok());
    std::vector<uint8_t> data(16), got(16);
    std::future<Status> sent = std::async(std::launch::async, [&] {
        return (*s)->Send(data.data(), data.size(), Clock::now() + milliseconds(2'000));
    });
    const Status st = (*r)->Recv(got.data(), got.size(), Clock::now() + milliseconds(500));
    EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
    (void)sent.get();
}

}  // namespace
}  // namespace kvshard
