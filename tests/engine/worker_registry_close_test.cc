// WorkerRegistry (coordinator/worker_registry.cc): its destruction while a registration is held
// for a re-form (a replacement worker that arrived in the restart backoff) wakes the held
// handshake and refuses it at once, naming the shutdown, instead of holding the destructor's join
// for the handshake's whole deadline.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <variant>

#include "comm/control_messages.h"
#include "comm/frame_channel.h"
#include "coordinator/remote_executor.h"

namespace kvshard {
namespace {

using std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

constexpr const char* kToken = "registry-close-test-token";

// Registers on `port`; the answer, or an empty ack with `closed` set when the connection ended
// without one.
RegisterAckMessage RegisterAs(uint16_t port, const RegisterMessage& reg, bool* closed,
                              std::unique_ptr<FrameChannel>* keep = nullptr) {
    *closed = false;
    Result<std::unique_ptr<FrameChannel>> c =
        ConnectFrameChannel("127.0.0.1", port, milliseconds(5'000));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    if (!c.ok()) return {};
    EXPECT_TRUE((*c)->Send(reg).ok());
    Result<Message> answer = (*c)->Receive(SteadyClock::now() + milliseconds(60'000));
    if (!answer.ok()) {
        *closed = true;
        return {};
    }
    const auto* ack = std::get_if<RegisterAckMessage>(&*answer);
    EXPECT_NE(ack, nullptr);
    if (ack == nullptr) return {};
    RegisterAckMessage out = *ack;
    if (keep != nullptr) *keep = std::move(*c);
    return out;
}

bool WaitFor(const std::function<bool()>& condition) {
    const auto deadline = SteadyClock::now() + milliseconds(30'000);
    while (!condition()) {
        if (SteadyClock::now() >= deadline) return false;
        std::this_thread::sleep_for(milliseconds(10));
    }
    return true;
}

TEST(WorkerRegistryCloseTest, DestructionRefusesARegistrationHeldForAReformAtOnce) {
    WorkerRegistryOptions options;
    options.token = kToken;
    // Long enough that waiting it out would fail the timing below by a wide margin.
    options.register_message_timeout_ms = 30'000;
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(options);
    ASSERT_TRUE(registry.ok()) << registry.status().ToString();
    const uint16_t port = (*registry)->port();
    RemoteInstanceOptions o;
    o.instance_id = "g";
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    RemoteStepExecutor& ex = **executor;

    bool closed = false;
    std::unique_ptr<FrameChannel> worker;
    ASSERT_TRUE(RegisterAs(port, {0, 1, "g", kControlProtocolVersion, "h:1", kToken}, &closed,
                           &worker)
                    .accepted);
    ASSERT_TRUE(worker->Send(ReadyMessage{true, "", 8}).ok());
    ASSERT_TRUE(ex.WaitReady(milliseconds(10'000)).ok());
    worker->Close();  // the worker dies; nobody begins the re-form (the backoff)
    ASSERT_TRUE(WaitFor([&] { return !ex.Health().ok(); }));

    RegisterAckMessage held;
    bool held_closed = false;
    std::thread replacement([&] {
        held = RegisterAs(port, {0, 1, "g", kControlProtocolVersion, "h:2", kToken}, &held_closed);
    });
    std::this_thread::sleep_for(milliseconds(500));  // the handshake is waiting for the re-form

    const auto start = SteadyClock::now();
    registry->reset();
    const auto took = SteadyClock::now() - start;
    replacement.join();
    EXPECT_LT(took, milliseconds(5'000)) << "the destructor waited for the held registration";
    EXPECT_FALSE(held.accepted);
    // Refused with the reason (sent before the connection closes), or at worst closed.
    if (!held_closed) {
        EXPECT_NE(held.error.find("worker registry is shutting down"), std::string::npos)
            << held.error;
    }
}

}  // namespace
}  // namespace kvshard
