// WorkerRegistry (coordinator/worker_registry.cc), two additions: its destruction while a
// registration is held for a re-form (a replacement worker that arrived in the restart backoff)
// wakes the held handshake and refuses it at once, naming the shutdown, instead of holding the
// destructor's join for the handshake's whole deadline; and each rank's own settings
// (RemoteInstanceOptions::rank_settings) reach that rank's RegisterAck only — how the NCCL KV
// handoff's pairs (worker/kv_handoff_nccl_pairs.h, fake ids here) are handed out at registration.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <variant>

#include "comm/control_messages.h"
#include "comm/frame_channel.h"
#include "comm/kv_nccl_pairs.h"
#include "config/model_spec.h"
#include "coordinator/remote_executor.h"
#include "worker/kv_handoff_nccl_pairs.h"

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
    ASSERT_TRUE(
        RegisterAs(port, {0, 1, "g", kControlProtocolVersion, "h:1", kToken}, &closed, &worker)
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

TEST(WorkerRegistryRankSettingsTest, EachRankGetsItsOwnNcclKvPairsAtRegistration) {
    ModelSpec spec;
    spec.num_heads = 8;
    spec.num_kv_heads = 4;
    spec.head_dim = 8;
    spec.hidden_size = 64;
    spec.ffn_size = 64;
    spec.vocab_size = 32;
    spec.num_layers = 2;
    int made = 0;
    Result<std::vector<KvNcclPair>> pairs =
        PlanKvNcclPairs(spec, {{"prefill", 2}}, {{"decode", 1}}, [&]() -> Result<std::string> {
            std::string id = "fake-id-" + std::to_string(made++);
            id.resize(kKvNcclUniqueIdBytes, '.');
            return id;
        });
    ASSERT_TRUE(pairs.ok()) << pairs.status().ToString();
    ASSERT_EQ(pairs->size(), 2u);  // both prefill ranks send to the one decode rank

    WorkerRegistryOptions options;
    options.token = kToken;
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(options);
    ASSERT_TRUE(registry.ok()) << registry.status().ToString();
    const uint16_t port = (*registry)->port();
    std::map<std::string, std::unique_ptr<RemoteStepExecutor>> executors;
    for (const auto& [name, tp] : {std::pair<std::string, int>{"prefill", 2}, {"decode", 1}}) {
        RemoteInstanceOptions o;
        o.instance_id = name;
        o.tp = tp;
        o.settings = {{"block_size", "16"}};
        for (int rank = 0; rank < tp; ++rank) {
            o.rank_settings.push_back({{std::string(kKvNcclPairsSetting),
                                        EncodeKvNcclPairs(KvNcclPairsOfRank(*pairs, name, rank))}});
        }
        Result<std::unique_ptr<RemoteStepExecutor>> ex = (*registry)->AddInstance(o);
        ASSERT_TRUE(ex.ok()) << ex.status().ToString();
        executors[name] = std::move(*ex);
    }
    // The ids each rank got, by (peer instance, peer rank, own nccl rank).
    std::map<std::string, std::string> ids;
    std::vector<std::unique_ptr<FrameChannel>> workers;
    for (const auto& [name, rank] :
         {std::pair<std::string, int>{"prefill", 1}, {"prefill", 0}, {"decode", 0}}) {
        bool closed = false;
        std::unique_ptr<FrameChannel> keep;
        const RegisterAckMessage ack = RegisterAs(
            port, {rank, kAnyTp, name, kControlProtocolVersion, "", kToken}, &closed, &keep);
        ASSERT_TRUE(ack.accepted) << ack.error;
        workers.push_back(std::move(keep));
        int found = 0;
        for (const auto& [key, value] : ack.settings) {
            if (key != kKvNcclPairsSetting) continue;
            ++found;
            Result<std::vector<KvNcclPairAssignment>> mine = DecodeKvNcclPairs(value);
            ASSERT_TRUE(mine.ok()) << mine.status().ToString();
            EXPECT_EQ(*mine, KvNcclPairsOfRank(*pairs, name, rank)) << name << " " << rank;
            for (const KvNcclPairAssignment& a : *mine) {
                const std::string src =
                    name == "prefill" ? std::to_string(rank) : std::to_string(a.peer_rank);
                ids[src + (a.nccl_rank == 0 ? "/send" : "/recv")] = a.nccl_unique_id;
            }
        }
        EXPECT_EQ(found, 1) << name << " rank " << rank;
        EXPECT_EQ(ack.settings.front(), (std::pair<std::string, std::string>{"block_size", "16"}));
    }
    // Both ranks of each pair hold the same id, and the two pairs' ids differ.
    ASSERT_EQ(ids.size(), 4u);
    EXPECT_EQ(ids["0/send"], ids["0/recv"]);
    EXPECT_EQ(ids["1/send"], ids["1/recv"]);
    EXPECT_NE(ids["0/send"], ids["1/send"]);

    RemoteInstanceOptions wrong;
    wrong.instance_id = "wrong";
    wrong.tp = 2;
    wrong.rank_settings = {{}};
    Result<std::unique_ptr<RemoteStepExecutor>> refused = (*registry)->AddInstance(wrong);
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("rank_settings for 1 ranks, tp 2"), std::string::npos)
        << refused.status().message();
}

}  // namespace
}  // namespace kvshard
