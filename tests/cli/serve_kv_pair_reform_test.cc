// The KV pair path's plan across re-forms (cli/kv_pair_replan.h): re-planning an instance gives
// every pair with it a fresh id and leaves the others' ids alone; the re-planned settings carry
// the router's next transfer id; the executors of the re-formed instance and of its peers get
// the new lists (a registration after the re-plan is acked with them), those of unrelated
// instances nothing; after Detach a re-plan changes no executor.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <variant>

#include "cli/kv_pair_replan.h"
#include "comm/frame_channel.h"
#include "comm/socket_kv_pair_channel.h"
#include "tests/worker/kv_pair_test_pools.h"

namespace kvshard::cli {
namespace {

// Instance -> rank -> (peer instance, peer rank) -> id, from a plan's rank settings.
using Ids = std::map<std::pair<std::string, int>, std::string>;
Ids IdsOf(const KvPairPlan& plan, size_t instance, int rank) {
    Result<std::optional<KvPairHandoffSettings>> s =
        KvPairHandoffSettingsOf(plan.RankSettings(instance).at(static_cast<size_t>(rank)));
    KV_CHECK(s.ok() && s->has_value()) << s.status().ToString();
    Ids ids;
    for (const KvNcclPairAssignment& p : (*s)->pairs)
        ids[{p.peer_instance, p.peer_rank}] = p.nccl_unique_id;
    return ids;
}

TEST(KvPairPlan, FreshIdsForThePairsOfTheReformedInstanceOnly) {
    std::vector<KvNcclPair> pairs = {{"p", 0, "d", 0, {0, 4}, "a"},
                                     {"p", 0, "e", 0, {0, 4}, "b"},
                                     {"q", 0, "d", 0, {0, 4}, "c"}};
    int n = 0;
    Result<std::vector<KvNcclPair>> made = ReplanKvNcclPairs(
        pairs, "d", [&]() -> Result<std::string> { return "new" + std::to_string(n++); });
    ASSERT_TRUE(made.ok());
    EXPECT_EQ((*made)[0].nccl_unique_id, "new0");
    EXPECT_EQ((*made)[1].nccl_unique_id, "b");
    EXPECT_EQ((*made)[2].nccl_unique_id, "new1");
    Result<std::vector<KvNcclPair>> failed = ReplanKvNcclPairs(
        pairs, "p", []() -> Result<std::string> { return Unavailable("no port"); });
    EXPECT_EQ(failed.status().code(), StatusCode::kUnavailable);
}

// Registers as rank `rank` of `instance` and returns its ack.
RegisterAckMessage Register(uint16_t port, const std::string& token, const std::string& instance,
                            int rank, std::unique_ptr<FrameChannel>* keep) {
    Result<std::unique_ptr<FrameChannel>> c =
        ConnectFrameChannel("127.0.0.1", port, std::chrono::milliseconds(5'000));
    KV_CHECK(c.ok()) << c.status().ToString();
    RegisterMessage reg;
    reg.worker_rank = rank;
    reg.tp = 1;
    reg.instance_id = instance;
    reg.token = token;
    KV_CHECK((*c)->Send(reg).ok());
    Result<Message> answer =
        (*c)->Receive(std::chrono::steady_clock::now() + std::chrono::milliseconds(10'000));
    KV_CHECK(answer.ok()) << answer.status().ToString();
    *keep = std::move(*c);
    return std::get<RegisterAckMessage>(*answer);
}

TEST(KvPairPlan, ThePlanHandsTheNewPairsToTheReformedInstanceAndItsPeers) {
    Result<std::unique_ptr<KvPairPlan>> plan =
        KvPairPlan::Create(testing::PairSpec(),
                           {{"p", 1, PoolRole::kPrefill},
                            {"d", 1, PoolRole::kDecode},
                            {"e", 1, PoolRole::kDecode},
                            {"m", 1, PoolRole::kMixed}},
                           KvPairLink::kSocket, "127.0.0.1", 500);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_TRUE((*plan)->RankSettings(3).empty());
    const Ids p_before = IdsOf(**plan, 0, 0), e_before = IdsOf(**plan, 2, 0);

    WorkerRegistryOptions ro;
    ro.token = "t";
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(ro);
    ASSERT_TRUE(registry.ok());
    std::vector<std::unique_ptr<RemoteStepExecutor>> executors;
    for (size_t i = 0; i < 4; ++i) {
        RemoteInstanceOptions o;
        o.instance_id = std::string(1, "pdem"[i]);
        o.rank_settings = (*plan)->RankSettings(i);
        Result<std::unique_ptr<RemoteStepExecutor>> e = (*registry)->AddInstance(o);
        ASSERT_TRUE(e.ok()) << e.status().ToString();
        (*plan)->SetExecutor(i, e->get());
        executors.push_back(std::move(*e));
    }
    (*plan)->SetNextTransferId([] { return uint64_t{77}; });
    ASSERT_TRUE((*plan)->Replan("d").ok());
    EXPECT_EQ((*plan)->replans(), 1);

    const Ids p_after = IdsOf(**plan, 0, 0), d_after = IdsOf(**plan, 1, 0);
    EXPECT_NE(p_after.at({"d", 0}), p_before.at({"d", 0}));
    EXPECT_TRUE(IsSocketKvPairId(p_after.at({"d", 0})));
    EXPECT_EQ(p_after.at({"e", 0}), p_before.at({"e", 0}));
    EXPECT_EQ(d_after.at({"p", 0}), p_after.at({"d", 0}));
    EXPECT_EQ(IdsOf(**plan, 2, 0), e_before);

    // p and d (not yet formed) register with the new lists and the first transfer; e with its
    // list as it was (its executor was not told).
    for (const auto& [instance, want] : std::vector<std::pair<std::string, std::string>>{
             {"p", p_after.at({"d", 0})}, {"d", d_after.at({"p", 0})}}) {
        std::unique_ptr<FrameChannel> keep;
        const RegisterAckMessage ack = Register((*registry)->port(), "t", instance, 0, &keep);
        ASSERT_TRUE(ack.accepted) << ack.error;
        Result<std::optional<KvPairHandoffSettings>> s = KvPairHandoffSettingsOf(ack.settings);
        ASSERT_TRUE(s.ok() && s->has_value()) << s.status().ToString();
        EXPECT_EQ((*s)->first_transfer_id, 77u) << instance;
        bool found = false;
        for (const KvNcclPairAssignment& p : (*s)->pairs) found |= p.nccl_unique_id == want;
        EXPECT_TRUE(found) << instance;
    }
    std::unique_ptr<FrameChannel> keep;
    const RegisterAckMessage e_ack = Register((*registry)->port(), "t", "e", 0, &keep);
    ASSERT_TRUE(e_ack.accepted) << e_ack.error;
    Result<std::optional<KvPairHandoffSettings>> e_settings =
        KvPairHandoffSettingsOf(e_ack.settings);
    ASSERT_TRUE(e_settings.ok() && e_settings->has_value());
    EXPECT_EQ((*e_settings)->first_transfer_id, 0u);

    // Detached: a re-plan still makes new ids but tells no executor.
    (*plan)->Detach();
    ASSERT_TRUE((*plan)->Replan("e").ok());
    executors[2]->BeginReform("test");
    const RegisterAckMessage again = Register((*registry)->port(), "t", "e", 0, &keep);
    ASSERT_TRUE(again.accepted) << again.error;
    Result<std::optional<KvPairHandoffSettings>> old = KvPairHandoffSettingsOf(again.settings);
    ASSERT_TRUE(old.ok() && old->has_value());
    EXPECT_EQ((*old)->pairs, (*e_settings)->pairs);
}

}  // namespace
}  // namespace kvshard::cli
