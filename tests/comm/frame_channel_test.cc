#include "comm/frame_channel.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "common/clock.h"

namespace kvshard {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

constexpr milliseconds kConnectTimeout{10'000};

SteadyClock::time_point In(milliseconds ms) { return SteadyClock::now() + ms; }

// A connected coordinator-side and worker-side channel on a loopback ephemeral port.
struct Pair {
    std::unique_ptr<FrameListener> listener;
    std::unique_ptr<FrameChannel> server;
    std::unique_ptr<FrameChannel> client;
};

Pair Connect(const FrameChannelOptions& options = {}) {
    Pair pair;
    Result<std::unique_ptr<FrameListener>> listener = FrameListener::Listen("127.0.0.1", 0);
    EXPECT_TRUE(listener.ok()) << listener.status().ToString();
    if (!listener.ok()) return pair;
    pair.listener = std::move(*listener);
    EXPECT_NE(pair.listener->port(), 0);
    Result<std::unique_ptr<FrameChannel>> client =
        ConnectFrameChannel("127.0.0.1", pair.listener->port(), kConnectTimeout, options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    Result<std::unique_ptr<FrameChannel>> server = pair.listener->Accept(kConnectTimeout, options);
    EXPECT_TRUE(server.ok()) << server.status().ToString();
    if (client.ok()) pair.client = std::move(*client);
    if (server.ok()) pair.server = std::move(*server);
    return pair;
}

// A hand-driven TCP client, for peers that misbehave.
struct RawPeer {
    asio::io_context io;
    tcp::socket socket{io};
    void ConnectTo(uint16_t port) {
        socket.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    }
    void Write(std::string_view bytes) { asio::write(socket, asio::buffer(bytes)); }
};

// A listener plus the server side of a connection from a RawPeer.
struct RawPair {
    std::unique_ptr<FrameListener> listener;
    std::unique_ptr<FrameChannel> server;
    RawPeer peer;
};

void ConnectRaw(RawPair& pair, const FrameChannelOptions& options = {}) {
    pair.listener = std::move(FrameListener::Listen("127.0.0.1", 0).value());
    pair.peer.ConnectTo(pair.listener->port());
    Result<std::unique_ptr<FrameChannel>> server = pair.listener->Accept(kConnectTimeout, options);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    pair.server = std::move(*server);
}

StepPlan PlanWithId(uint64_t id) {
    StepPlan plan;
    plan.step_id = id;
    ScheduledSequence seq;
    seq.seq_id = static_cast<int64_t>(id) * 10;
    seq.token_ids.assign(id % 50, static_cast<int32_t>(id));
    seq.slot_mapping.assign(id % 50, static_cast<int64_t>(id));
    plan.sequences.push_back(seq);
    return plan;
}

TEST(FrameChannel, ExchangesPlansAndResults) {
    Pair pair = Connect();
    ASSERT_TRUE(pair.server && pair.client);
    for (uint64_t step = 0; step < 100; ++step) {
        ASSERT_TRUE(pair.server->Send(PlanWithId(step)).ok());
        Result<Message> plan = pair.client->Receive(In(milliseconds(10'000)));
        ASSERT_TRUE(plan.ok()) << plan.status().ToString();
        ASSERT_EQ(std::get<StepPlan>(*plan), PlanWithId(step));

        StepResult result;
        result.step_id = step;
        result.tokens.push_back({static_cast<int64_t>(step) * 10, 7, -0.5f, {}});
        ASSERT_TRUE(pair.client->Send(result).ok());
        Result<Message> back = pair.server->Receive(In(milliseconds(10'000)));
        ASSERT_TRUE(back.ok()) << back.status().ToString();
        ASSERT_EQ(std::get<StepResult>(*back), result);
    }
}

TEST(FrameChannel, RegistersAndShutsDown) {
    Pair pair = Connect();
    ASSERT_TRUE(pair.server && pair.client);
    const RegisterMessage hello{1, 2, "mixed-0", kControlProtocolVersion, "127.0.0.1:9", "tok"};
    ASSERT_TRUE(pair.client->Send(hello).ok());
    Result<Message> got = pair.server->Receive(In(milliseconds(10'000)));
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(std::get<RegisterMessage>(*got), hello);
    const RegisterAckMessage ack{true, "", "/m.gguf", 2, {{"block_size", "16"}}};
    ASSERT_TRUE(pair.server->Send(ack).ok());
    ASSERT_TRUE(pair.server->Send(ShutdownMessage{"done"}).ok());
    got = pair.client->Receive(In(milliseconds(10'000)));
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(std::get<RegisterAckMessage>(*got), ack);
    got = pair.client->Receive(In(milliseconds(10'000)));
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(std::get<ShutdownMessage>(*got).reason, "done");
}

// Sends from several threads must never interleave inside a frame.
TEST(FrameChannel, ConcurrentSendsArriveWhole) {
    Pair pair = Connect();
    ASSERT_TRUE(pair.server && pair.client);
    constexpr int kThreads = 4;
    constexpr int kPerThread = 50;
    std::vector<std::thread> senders;
    for (int t = 0; t < kThreads; ++t) {
        senders.emplace_back([&, t] {
            for (int i = 0; i < kPerThread; ++i) {
                EXPECT_TRUE(pair.client->Send(PlanWithId(t * 1000 + i)).ok());
            }
        });
    }
    std::set<uint64_t> seen;
    for (int i = 0; i < kThreads * kPerThread; ++i) {
        Result<Message> got = pair.server->Receive(In(milliseconds(10'000)));
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        const auto& plan = std::get<StepPlan>(*got);
        EXPECT_EQ(plan, PlanWithId(plan.step_id));
        seen.insert(plan.step_id);
    }
    for (std::thread& t : senders) t.join();
    EXPECT_EQ(seen.size(), static_cast<size_t>(kThreads * kPerThread));
}

TEST(FrameChannel, ReceiveTimesOutButStaysOpen) {
    Pair pair = Connect();
    ASSERT_TRUE(pair.server && pair.client);
    const Result<Message> none = pair.server->Receive(In(milliseconds(20)));
    EXPECT_EQ(none.status().code(), StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(pair.server->status().ok());
    ASSERT_TRUE(pair.client->Send(HeartbeatMessage{}).ok());
    ASSERT_TRUE(pair.client->Send(ShutdownMessage{"after"}).ok());
    const Result<Message> got = pair.server->Receive(In(milliseconds(10'000)));
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(std::get<ShutdownMessage>(*got).reason, "after");  // the heartbeat was absorbed
}

TEST(FrameChannel, PeerClosingIsAnErrorNotAHang) {
    Pair pair = Connect();
    ASSERT_TRUE(pair.server && pair.client);
    ASSERT_TRUE(pair.client->Send(ShutdownMessage{"last words"}).ok());
    pair.client.reset();
    // Messages that arrived before the close are still delivered, then the error.
    Result<Message> got = pair.server->Receive(In(milliseconds(30'000)));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(std::get<ShutdownMessage>(*got).reason, "last words");
    got = pair.server->Receive(In(milliseconds(30'000)));
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().ToString();
    EXPECT_NE(got.status().message().find("closed the connection"), std::string::npos);
    EXPECT_EQ(pair.server->Send(HeartbeatMessage{}).code(), StatusCode::kUnavailable);
}

TEST(FrameChannel, PeerClosingMidFrameIsAnError) {
    RawPair pair;
    ASSERT_NO_FATAL_FAILURE(ConnectRaw(pair));
    const std::string frame = EncodeFrame(PlanWithId(40));
    pair.peer.Write(std::string_view(frame).substr(0, frame.size() / 2));
    pair.peer.socket.close();
    const Result<Message> got = pair.server->Receive(In(milliseconds(30'000)));
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().ToString();
    EXPECT_NE(got.status().message().find("mid-frame"), std::string::npos)
        << got.status().ToString();
}

TEST(FrameChannel, MalformedFramesCloseTheChannel) {
    struct Case {
        const char* name;
        std::string bytes;
        StatusCode code;
    };
    std::string bad_crc = EncodeFrame(ShutdownMessage{"hello"});
    bad_crc.back() = '!';
    std::string oversized = EncodeFrame(ShutdownMessage{std::string(2000, 'x')});
    const std::vector<Case> cases = {
        {"garbage", "GARBAGE-GARBAGE-GARBAGE", StatusCode::kDataLoss},
        {"bad crc", bad_crc, StatusCode::kDataLoss},
        {"oversized", oversized, StatusCode::kResourceExhausted},
    };
    for (const Case& c : cases) {
        RawPair pair;
        FrameChannelOptions options;
        options.max_payload_bytes = 1024;
        ASSERT_NO_FATAL_FAILURE(ConnectRaw(pair, options));
        pair.peer.Write(c.bytes);
        const Result<Message> got = pair.server->Receive(In(milliseconds(30'000)));
        EXPECT_EQ(got.status().code(), c.code) << c.name << ": " << got.status().ToString();
        EXPECT_EQ(pair.server->status().code(), c.code) << c.name;
    }
}

// Heartbeats on a VirtualClock: time moves only when the test moves it, and each move runs the
// heartbeat due by then before it returns, so nothing here sleeps or depends on real time.
TEST(FrameChannel, SilentPeerIsDeclaredDeadWhenTheClockSaysSo) {
    VirtualClock clock;
    RawPair pair;
    FrameChannelOptions options;
    options.heartbeat_interval_ms = 20;
    options.dead_after_ms = 200;
    options.clock = &clock;
    ASSERT_NO_FATAL_FAILURE(ConnectRaw(pair, options));
    // The raw peer keeps the connection open but never sends: only heartbeats would save it.
    // A receiver waiting with a distant deadline is released when the peer is declared dead.
    Result<Message> got = Status(StatusCode::kInternal, "not received");
    std::thread receiver([&] { got = pair.server->Receive(In(milliseconds(600'000))); });
    for (int i = 0; i < 10; ++i) {
        clock.Advance(milliseconds(20));  // 200 ms of silence: not more than dead_after_ms
        ASSERT_TRUE(pair.server->status().ok()) << "at " << 20 * (i + 1) << " ms";
    }
    EXPECT_EQ(pair.server->heartbeats_sent(), 10);
    clock.Advance(milliseconds(20));
    receiver.join();
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable) << got.status().ToString();
    EXPECT_NE(got.status().message().find("sent nothing for 220 ms (dead after 200 ms)"),
              std::string::npos)
        << got.status().ToString();
    EXPECT_EQ(pair.server->status().code(), StatusCode::kUnavailable);
}

TEST(FrameChannel, AClockMoveRunsAtMostTheHeartbeatDue) {
    VirtualClock clock;
    RawPair pair;
    FrameChannelOptions options;
    options.heartbeat_interval_ms = 100;
    options.dead_after_ms = 1'000;
    options.clock = &clock;
    ASSERT_NO_FATAL_FAILURE(ConnectRaw(pair, options));
    clock.Advance(milliseconds(99));
    EXPECT_EQ(pair.server->heartbeats_sent(), 0) << "not due yet";
    clock.Advance(milliseconds(1));
    EXPECT_EQ(pair.server->heartbeats_sent(), 1);
    clock.Advance(milliseconds(50));
    EXPECT_EQ(pair.server->heartbeats_sent(), 1);
    // A jump of several intervals is one check at its end (nobody could answer in between).
    clock.Advance(milliseconds(500));
    EXPECT_EQ(pair.server->heartbeats_sent(), 2);
    EXPECT_TRUE(pair.server->status().ok());
    clock.Advance(milliseconds(451));  // 1101 ms of silence
    EXPECT_EQ(pair.server->status().code(), StatusCode::kUnavailable);
}

TEST(FrameChannel, HeartbeatsKeepAnIdleChannelAlive) {
    VirtualClock clock;
    FrameChannelOptions options;
    options.heartbeat_interval_ms = 20;
    options.dead_after_ms = 100;
    options.clock = &clock;
    Pair pair = Connect(options);
    ASSERT_TRUE(pair.server && pair.client);
    // Ten times dead_after_ms with nothing but heartbeats on the wire. After each move both
    // sides have queued a heartbeat; a message sent after it arrives after it (one TCP stream),
    // so receiving the message means the heartbeat arrived before time moves on.
    constexpr int kBeats = 50;
    for (int i = 1; i <= kBeats; ++i) {
        clock.Advance(milliseconds(20));
        ASSERT_TRUE(pair.client->Send(ShutdownMessage{"to server"}).ok());
        ASSERT_TRUE(pair.server->Receive(In(kConnectTimeout)).ok()) << "beat " << i;
        ASSERT_TRUE(pair.server->Send(ShutdownMessage{"to client"}).ok());
        ASSERT_TRUE(pair.client->Receive(In(kConnectTimeout)).ok()) << "beat " << i;
        ASSERT_EQ(pair.server->heartbeats_received(), i);
        ASSERT_EQ(pair.client->heartbeats_received(), i);
    }
    // Only heartbeats now: still alive after another 10 intervals, each answered in time.
    for (int i = 0; i < 10; ++i) {
        clock.Advance(milliseconds(20));
        const int64_t want = kBeats + i + 1;
        // Wait (on the socket, not on time) for the other side's heartbeat to arrive.
        while (pair.server->heartbeats_received() < want ||
               pair.client->heartbeats_received() < want) {
            ASSERT_TRUE(pair.server->status().ok() && pair.client->status().ok());
            std::this_thread::yield();
        }
    }
    EXPECT_TRUE(pair.server->status().ok()) << pair.server->status().ToString();
    EXPECT_TRUE(pair.client->status().ok()) << pair.client->status().ToString();
    EXPECT_EQ(pair.client->heartbeats_sent(), kBeats + 10);
    EXPECT_EQ(pair.server->heartbeats_sent(), kBeats + 10);
}

TEST(FrameChannel, APeerWhoseClockStopsIsDeclaredDead) {
    // The client's heartbeats run on a clock nobody moves: it sends none, and the server, whose
    // clock moves, declares it dead after dead_after_ms though the connection stays open.
    VirtualClock server_clock, client_clock;
    FrameChannelOptions server_options, client_options;
    server_options.heartbeat_interval_ms = client_options.heartbeat_interval_ms = 10;
    server_options.dead_after_ms = client_options.dead_after_ms = 50;
    server_options.clock = &server_clock;
    client_options.clock = &client_clock;
    Result<std::unique_ptr<FrameListener>> listener = FrameListener::Listen("127.0.0.1", 0);
    ASSERT_TRUE(listener.ok());
    Result<std::unique_ptr<FrameChannel>> client =
        ConnectFrameChannel("127.0.0.1", (*listener)->port(), kConnectTimeout, client_options);
    ASSERT_TRUE(client.ok());
    Result<std::unique_ptr<FrameChannel>> server =
        (*listener)->Accept(kConnectTimeout, server_options);
    ASSERT_TRUE(server.ok());
    for (int i = 0; i < 5; ++i) server_clock.Advance(milliseconds(10));
    EXPECT_TRUE((*server)->status().ok());
    server_clock.Advance(milliseconds(10));
    EXPECT_EQ((*server)->status().code(), StatusCode::kUnavailable);
    EXPECT_EQ((*client)->heartbeats_sent(), 0);
}

TEST(FrameChannel, CloseReleasesAWaitingReceiver) {
    Pair pair = Connect();
    ASSERT_TRUE(pair.server && pair.client);
    std::thread closer([&] { pair.server->Close(); });
    const Result<Message> got = pair.server->Receive(In(milliseconds(60'000)));
    closer.join();
    EXPECT_EQ(got.status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(pair.server->Send(HeartbeatMessage{}).code(), StatusCode::kUnavailable);
}

TEST(FrameChannel, RefusesMessagesOverTheLimitWithoutClosing) {
    FrameChannelOptions options;
    options.max_payload_bytes = 64;
    Pair pair = Connect(options);
    ASSERT_TRUE(pair.server && pair.client);
    EXPECT_EQ(pair.client->Send(ShutdownMessage{std::string(100, 'x')}).code(),
              StatusCode::kResourceExhausted);
    EXPECT_TRUE(pair.client->Send(ShutdownMessage{"small"}).ok());
    const Result<Message> got = pair.server->Receive(In(milliseconds(10'000)));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(std::get<ShutdownMessage>(*got).reason, "small");
}

// This process's socket descriptors, by fd, each with its "socket:[inode]" link.
std::map<int, std::string> OpenSockets() {
    std::map<int, std::string> out;
    DIR* dir = opendir("/proc/self/fd");
    if (dir == nullptr) return out;
    while (dirent* e = readdir(dir)) {
        const std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        char target[256];
        const std::string link = "/proc/self/fd/" + name;
        const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
        if (n <= 0) continue;
        target[n] = '\0';
        if (std::string(target).rfind("socket:", 0) == 0) out[std::stoi(name)] = target;
    }
    closedir(dir);
    return out;
}

// A process spawned by the coordinator must not inherit its listening socket or its workers'
// connections (it would hold them open after the coordinator closed them).
TEST(FrameListener, ListeningAcceptedAndConnectedSocketsAreCloseOnExec) {
    const std::map<int, std::string> before = OpenSockets();
    Pair pair = Connect();
    ASSERT_NE(pair.server, nullptr);
    ASSERT_NE(pair.client, nullptr);
    int checked = 0;
    for (const auto& [fd, what] : OpenSockets()) {
        if (before.count(fd) != 0 && before.at(fd) == what) continue;
        const int flags = fcntl(fd, F_GETFD);
        ASSERT_GE(flags, 0) << "fd " << fd;
        EXPECT_TRUE(flags & FD_CLOEXEC) << "fd " << fd << " (" << what << ") is inheritable";
        ++checked;
    }
    // The listener, the accepted and the connected socket at least (asio may add its own).
    EXPECT_GE(checked, 3);
}

TEST(FrameListener, AcceptTimesOut) {
    auto listener = FrameListener::Listen("127.0.0.1", 0);
    ASSERT_TRUE(listener.ok());
    EXPECT_EQ((*listener)->Accept(milliseconds(30)).status().code(), StatusCode::kDeadlineExceeded);
    (*listener)->Close();
    EXPECT_EQ((*listener)->Accept(milliseconds(30)).status().code(), StatusCode::kUnavailable);
}

TEST(FrameListener, ConnectToAClosedPortFails) {
    uint16_t port = 0;
    {
        auto listener = FrameListener::Listen("127.0.0.1", 0);
        ASSERT_TRUE(listener.ok());
        port = (*listener)->port();
    }
    const Status status = ConnectFrameChannel("127.0.0.1", port, kConnectTimeout).status();
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
}

TEST(FrameChannelOptions, AreValidated) {
    FrameChannelOptions bad;
    bad.heartbeat_interval_ms = 0;
    EXPECT_EQ(ValidateFrameChannelOptions(bad).code(), StatusCode::kInvalidArgument);
    bad = {};
    bad.dead_after_ms = 10;
    bad.heartbeat_interval_ms = 100;
    EXPECT_NE(ValidateFrameChannelOptions(bad).message().find("dead_after_ms"), std::string::npos);
    EXPECT_TRUE(ValidateFrameChannelOptions({}).ok());
    EXPECT_EQ(ConnectFrameChannel("127.0.0.1", 1, kConnectTimeout, bad).status().code(),
              StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvshard
