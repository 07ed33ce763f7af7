// FrameChannel: one TCP connection carrying frames (comm/plan_codec.h) between the coordinator
// and a worker process, over Boost.Asio. A listener accepts channels on the coordinator's side;
// ConnectFrameChannel opens one from a worker.
//
// Each channel runs one I/O thread of its own. It reads frames as they arrive into a queue that
// Receive() drains, writes the frames Send() hands it, and every heartbeat interval sends a
// HeartbeatMessage and checks that some frame (of any type) arrived within dead_after_ms. So a
// worker busy with a long step still proves itself alive, and a peer that died, hung or
// vanished from the network is detected within dead_after_ms + heartbeat_interval_ms even by a
// caller blocked in Receive with a distant deadline.
//
// Heartbeat time is FrameChannelOptions::clock's (common/clock.h): on the real clock a timer
// fires every interval; on a VirtualClock nothing fires by itself — each move of the clock
// (its driver's Set or Advance) runs the heartbeat due by then, on the I/O thread, before the
// move returns, so a test declares a peer dead or keeps it alive by moving time, never by
// sleeping. Send's timeout and Receive's deadline stay real time: they wait on the socket.
//
// Failure: the first error closes the channel for good (a TCP stream cannot resynchronize after
// a bad frame): the peer closed the connection (also mid-frame), a malformed, oversized or
// wrong-version frame, a dead peer, a Send that did not complete in time. Messages received
// before the error are still returned by Receive; after them, Receive and Send return the error.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "comm/control_messages.h"
#include "comm/plan_codec.h"
#include "common/clock.h"
#include "common/status.h"

namespace kvshard {

struct FrameChannelOptions {
    int64_t heartbeat_interval_ms = 1'000;  // > 0
    int64_t dead_after_ms = 5'000;          // >= heartbeat_interval_ms
    int64_t send_timeout_ms = 5'000;        // > 0: a Send not written by then closes the channel
    uint32_t max_payload_bytes = kDefaultMaxFramePayloadBytes;  // larger frames are refused
    // Frames received but not yet taken by Receive; more closes the channel (ResourceExhausted)
    // rather than growing without bound. The protocol is request/response, so a few suffice.
    size_t max_queued_messages = 1'024;
    // What heartbeat_interval_ms and dead_after_ms are measured on; null: Clock::Real(). Not
    // owned; must outlive the channel.
    const Clock* clock = nullptr;
};

// InvalidArgument naming the bad field, or OK.
Status ValidateFrameChannelOptions(const FrameChannelOptions& options);

// Thread-safety: Send, Close and the accessors may be called from any thread; Receive from one
// thread at a time. Destroy only when no other thread uses the channel.
class FrameChannel {
  public:
    class Impl;
    explicit FrameChannel(std::unique_ptr<Impl> impl);
    // Closes the connection and joins the I/O thread.
    ~FrameChannel();
    FrameChannel(const FrameChannel&) = delete;
    FrameChannel& operator=(const FrameChannel&) = delete;

    // Queues `message` and waits until it has been written to the socket (or the channel
    // failed). ResourceExhausted, without closing, for a message over max_payload_bytes.
    Status Send(const Message& message);

    // The next message other than a heartbeat (heartbeats are counted, not returned). Returns
    // DeadlineExceeded when none arrived by `deadline` (the channel stays open), or the
    // channel's error once it failed and the queue is empty.
    Result<Message> Receive(std::chrono::steady_clock::time_point deadline);

    // Closes the connection; idempotent. Pending and later calls return Unavailable.
    void Close();

    // OK while open; otherwise why it closed.
    Status status() const;
    // "address:port" of the other side.
    const std::string& peer() const;
    int64_t heartbeats_received() const;
    int64_t heartbeats_sent() const;

  private:
    std::unique_ptr<Impl> impl_;
};

// Accepts channels on a TCP port. Thread-safety: one thread calls Accept; Close from any thread.
class FrameListener {
  public:
    // Binds `host` (an address or name; "127.0.0.1" for loopback only) at `port`; 0 picks a free
    // port (see port()).
    static Result<std::unique_ptr<FrameListener>> Listen(const std::string& host, uint16_t port);
    ~FrameListener();
    FrameListener(const FrameListener&) = delete;
    FrameListener& operator=(const FrameListener&) = delete;

    uint16_t port() const;

    // The next connection, as a channel with `options`; DeadlineExceeded when none came within
    // `timeout`, Unavailable after Close(), ResourceExhausted when the accept itself failed (out
    // of file descriptors: the caller should pause before trying again). Listening and accepted
    // sockets are close-on-exec: processes this one spawns do not inherit them.
    Result<std::unique_ptr<FrameChannel>> Accept(std::chrono::milliseconds timeout,
                                                 const FrameChannelOptions& options = {});

    // Stops listening; a pending or later Accept returns Unavailable.
    void Close();

    class Impl;

  private:
    explicit FrameListener(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// Connects to host:port within `timeout` (name resolution included).
Result<std::unique_ptr<FrameChannel>> ConnectFrameChannel(const std::string& host, uint16_t port,
                                                          std::chrono::milliseconds timeout,
                                                          const FrameChannelOptions& options = {});

}  // namespace kvshard
