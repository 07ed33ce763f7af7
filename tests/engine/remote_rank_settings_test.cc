// RemoteStepExecutor::UpdateRankSettings with hand-made workers (a FrameChannel each): a rank
// that reported Ready gets its new per-rank list in a RankSettingsMessage; a rank that
// registered with the old list but is not Ready yet gets it only after its Ready; a rank that
// registers later (a re-form) gets the new list in its RegisterAck; a list not of tp ranks is
// refused.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "tests/engine/process_mode_fixture.h"

namespace kvshard::process_mode {
namespace {

using RankList = std::vector<std::pair<std::string, std::string>>;

// The rank's own entries of a RegisterAck (those after the instance's common settings).
RankList OwnSettings(const RegisterAckMessage& ack) {
    RankList own;
    for (const auto& kv : ack.settings) {
        if (kv.first == "pairs") own.push_back(kv);
    }
    return own;
}

// The next message on `c` within `ms`: a RankSettingsMessage's list, or an error.
Result<RankList> NextRankSettings(FrameChannel& c, int64_t ms) {
    Result<Message> m = c.Receive(SteadyClock::now() + milliseconds(ms));
    if (!m.ok()) return m.status();
    const auto* update = std::get_if<RankSettingsMessage>(&*m);
    if (update == nullptr) {
        return Internal("expected RankSettings, got " + std::string(MessageTypeName(TypeOf(*m))));
    }
    return update->settings;
}

TEST(RemoteRankSettings, ReadyRanksAreToldAtOnceOthersAtTheirReadyLaterOnesAtRegistration) {
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(RegistryOptions());
    ASSERT_TRUE(registry.ok());
    const uint16_t port = (*registry)->port();
    RemoteInstanceOptions o;
    o.instance_id = "d";
    o.tp = 2;
    o.model_path = "/models/m.gguf";
    o.rank_settings = {{{"pairs", "old-0"}}, {{"pairs", "old-1"}}};
    Result<std::unique_ptr<RemoteStepExecutor>> executor = (*registry)->AddInstance(o);
    ASSERT_TRUE(executor.ok());
    std::unique_ptr<FrameChannel> ranks[2];
    for (int r = 0; r < 2; ++r) {
        const RegisterAckMessage ack =
            RegisterAs(port, {r, 2, "d", kControlProtocolVersion, "", kToken}, &ranks[r]);
        ASSERT_TRUE(ack.accepted) << ack.error;
        EXPECT_EQ(OwnSettings(ack), o.rank_settings[static_cast<size_t>(r)]);
    }
    Status ready = Internal("not done");
    std::thread waiter([&] { ready = (*executor)->WaitReady(milliseconds(20'000)); });

    // Rank 0 Ready (whether WaitReady took it before or after the update, it is told once);
    // rank 1 not yet: told after its Ready, not before.
    ASSERT_TRUE(ranks[0]->Send(ReadyMessage{true, "", 8}).ok());
    const std::vector<RankList> fresh = {{{"pairs", "new-0"}}, {{"pairs", "new-1"}}};
    EXPECT_EQ((*executor)->UpdateRankSettings({{{"pairs", "x"}}}).code(),
              StatusCode::kInvalidArgument);
    ASSERT_TRUE((*executor)->UpdateRankSettings(fresh).ok());
    Result<RankList> zero = NextRankSettings(*ranks[0], 10'000);
    ASSERT_TRUE(zero.ok()) << zero.status().ToString();
    EXPECT_EQ(*zero, fresh[0]);
    EXPECT_EQ(NextRankSettings(*ranks[1], 200).status().code(), StatusCode::kDeadlineExceeded);
    ASSERT_TRUE(ranks[1]->Send(ReadyMessage{true, "", 8}).ok());
    Result<RankList> one = NextRankSettings(*ranks[1], 10'000);
    ASSERT_TRUE(one.ok()) << one.status().ToString();
    EXPECT_EQ(*one, fresh[1]);
    waiter.join();
    ASSERT_TRUE(ready.ok()) << ready.ToString();
    // Told once each: nothing more follows.
    EXPECT_EQ(NextRankSettings(*ranks[0], 200).status().code(), StatusCode::kDeadlineExceeded);

    // A re-form: the replacements register with the new lists.
    (*executor)->BeginReform("test");
    std::unique_ptr<FrameChannel> again;
    const RegisterAckMessage ack =
        RegisterAs(port, {1, 2, "d", kControlProtocolVersion, "", kToken}, &again);
    ASSERT_TRUE(ack.accepted) << ack.error;
    EXPECT_EQ(OwnSettings(ack), fresh[1]);
}

}  // namespace
}  // namespace kvshard::process_mode
