// The KV pair path's plan across re-forms (cli/kv_pair_replan.h): re-planning an instance gives
// every pair with it a fresh id and leaves the others' ids alone; the re-planned settings carry
// the router's next transfer id; the executors of the re-formed instance and of its peers get
// the new lists (a registration after the re-plan is acked with them), those of unrelated
// instances nothing; after Detach a re-plan changes no executor. A pair set reported down
// (KvPairHealth) is re-planned alone, on the plan's thread, and its two instances are told; a
// stale report changes nothing; a set re-planned without a transfer through it since waits
// RepairDelay (1 s doubling to 60 s) before the next re-plan.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
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

// A registry (token "t") with an executor for each of `plan`'s instances, named by the letters
// of `names` in the plan's order, each handed to the plan.
struct Executors {
    std::unique_ptr<WorkerRegistry> registry;
    std::vector<std::unique_ptr<RemoteStepExecutor>> executors;
};
Executors AddExecutors(KvPairPlan& plan, const std::string& names) {
    WorkerRegistryOptions ro;
    ro.token = "t";
    Result<std::unique_ptr<WorkerRegistry>> registry = WorkerRegistry::Start(ro);
    KV_CHECK(registry.ok()) << registry.status().ToString();
    Executors out{std::move(*registry), {}};
    for (size_t i = 0; i < names.size(); ++i) {
        RemoteInstanceOptions o;
        o.instance_id = std::string(1, names[i]);
        o.rank_settings = plan.RankSettings(i);
        Result<std::unique_ptr<RemoteStepExecutor>> e = out.registry->AddInstance(o);
        KV_CHECK(e.ok()) << e.status().ToString();
        plan.SetExecutor(i, e->get());
        out.executors.push_back(std::move(*e));
    }
    return out;
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

    Executors e = AddExecutors(**plan, "pdem");
    WorkerRegistry* registry = e.registry.get();
    (*plan)->SetTransferFence([](const auto& tell) { tell(77); });
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
        const RegisterAckMessage ack = Register(registry->port(), "t", instance, 0, &keep);
        ASSERT_TRUE(ack.accepted) << ack.error;
        Result<std::optional<KvPairHandoffSettings>> s = KvPairHandoffSettingsOf(ack.settings);
        ASSERT_TRUE(s.ok() && s->has_value()) << s.status().ToString();
        EXPECT_EQ((*s)->first_transfer_id, 77u) << instance;
        bool found = false;
        for (const KvNcclPairAssignment& p : (*s)->pairs) found |= p.nccl_unique_id == want;
        EXPECT_TRUE(found) << instance;
    }
    std::unique_ptr<FrameChannel> keep;
    const RegisterAckMessage e_ack = Register(registry->port(), "t", "e", 0, &keep);
    ASSERT_TRUE(e_ack.accepted) << e_ack.error;
    Result<std::optional<KvPairHandoffSettings>> e_settings =
        KvPairHandoffSettingsOf(e_ack.settings);
    ASSERT_TRUE(e_settings.ok() && e_settings->has_value());
    EXPECT_EQ((*e_settings)->first_transfer_id, 0u);

    // Detached: a re-plan still makes new ids but tells no executor.
    (*plan)->Detach();
    ASSERT_TRUE((*plan)->Replan("e").ok());
    e.executors[2]->BeginReform("test");
    const RegisterAckMessage again = Register(registry->port(), "t", "e", 0, &keep);
    ASSERT_TRUE(again.accepted) << again.error;
    Result<std::optional<KvPairHandoffSettings>> old = KvPairHandoffSettingsOf(again.settings);
    ASSERT_TRUE(old.ok() && old->has_value());
    EXPECT_EQ((*old)->pairs, (*e_settings)->pairs);
}

TEST(KvPairPlan, RepairDelayDoublesFromASecondToAMinute) {
    using std::chrono::milliseconds;
    EXPECT_EQ(KvPairPlan::RepairDelay(0), milliseconds(0));
    EXPECT_EQ(KvPairPlan::RepairDelay(1), milliseconds(1'000));
    EXPECT_EQ(KvPairPlan::RepairDelay(2), milliseconds(2'000));
    EXPECT_EQ(KvPairPlan::RepairDelay(4), milliseconds(8'000));
    EXPECT_EQ(KvPairPlan::RepairDelay(6), milliseconds(32'000));
    EXPECT_EQ(KvPairPlan::RepairDelay(7), milliseconds(60'000));
    EXPECT_EQ(KvPairPlan::RepairDelay(1'000), milliseconds(60'000));
}

TEST(KvPairPlan, APairSetReportedDownIsReplannedAloneAndItsInstancesTold) {
    Result<std::unique_ptr<KvPairPlan>> plan =
        KvPairPlan::Create(testing::PairSpec(),
                           {{"p", 1, PoolRole::kPrefill},
                            {"q", 1, PoolRole::kPrefill},
                            {"d", 1, PoolRole::kDecode},
                            {"e", 1, PoolRole::kDecode}},
                           KvPairLink::kSocket, "127.0.0.1", 500);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    Executors e = AddExecutors(**plan, "pqde");
    WorkerRegistry* registry = e.registry.get();
    int replanned = 0;
    (*plan)->SetOnReplanned([&] { replanned++; });
    std::atomic<uint64_t> next{5};
    (*plan)->SetTransferFence([&](const auto& tell) { tell(next.load()); });
    const Ids p_before = IdsOf(**plan, 0, 0), q_before = IdsOf(**plan, 1, 0);

    (*plan)->OnPairsDown("p", "d", 0, Status(StatusCode::kDeadlineExceeded, "receive timed out"));
    (*plan)->WaitRepairsIdle();
    EXPECT_EQ((*plan)->repairs(), 1);
    EXPECT_EQ((*plan)->replans(), 0);
    EXPECT_EQ(replanned, 1);
    const Ids p_after = IdsOf(**plan, 0, 0);
    EXPECT_NE(p_after.at({"d", 0}), p_before.at({"d", 0}));
    EXPECT_EQ(p_after.at({"e", 0}), p_before.at({"e", 0}));
    EXPECT_EQ(IdsOf(**plan, 1, 0), q_before);
    EXPECT_EQ(IdsOf(**plan, 2, 0).at({"p", 0}), p_after.at({"d", 0}));
    // p and d register with the new pairs and the first transfer; q with its list as it was.
    for (const char* instance : {"p", "d", "q"}) {
        std::unique_ptr<FrameChannel> keep;
        const RegisterAckMessage ack = Register(registry->port(), "t", instance, 0, &keep);
        ASSERT_TRUE(ack.accepted) << ack.error;
        Result<std::optional<KvPairHandoffSettings>> st = KvPairHandoffSettingsOf(ack.settings);
        ASSERT_TRUE(st.ok() && st->has_value()) << st.status().ToString();
        EXPECT_EQ((*st)->first_transfer_id, std::string(instance) == "q" ? 0u : 5u) << instance;
    }

    // A report about the pairs it replaced is stale; one about the new pairs within RepairDelay(1)
    // waits; a set without pairs (d -> p, d -> e) is nobody's.
    next = 9;
    (*plan)->OnPairsDown("p", "d", 0, Aborted("the old pairs"));
    (*plan)->OnPairsDown("p", "d", 5, Aborted("again, at once"));
    (*plan)->OnPairsDown("d", "p", 5, Aborted("no such set"));
    (*plan)->WaitRepairsIdle();
    EXPECT_EQ((*plan)->repairs(), 1);
    // After the wait, the next report re-plans.
    std::this_thread::sleep_for(KvPairPlan::RepairDelay(1) + std::chrono::milliseconds(50));
    (*plan)->OnPairsDown("p", "d", 5, Aborted("after the wait"));
    (*plan)->WaitRepairsIdle();
    EXPECT_EQ((*plan)->repairs(), 2);
    // Two re-plans without a transfer: the next waits 2 s; a transfer through the set lifts it.
    (*plan)->OnPairsDown("p", "d", 9, Aborted("within 2 s"));
    (*plan)->WaitRepairsIdle();
    EXPECT_EQ((*plan)->repairs(), 2);
    (*plan)->OnPairsTransferred("p", "d");
    (*plan)->OnPairsDown("p", "d", 9, Aborted("after a transfer"));
    (*plan)->WaitRepairsIdle();
    EXPECT_EQ((*plan)->repairs(), 3);
    // Another set is re-planned on its own schedule.
    (*plan)->OnPairsDown("q", "e", 0, Aborted("q -> e"));
    (*plan)->WaitRepairsIdle();
    EXPECT_EQ((*plan)->repairs(), 4);
    EXPECT_NE(IdsOf(**plan, 1, 0).at({"e", 0}), q_before.at({"e", 0}));

    // Detached: reports change nothing.
    (*plan)->Detach();
    const Ids p_detached = IdsOf(**plan, 0, 0);
    (*plan)->OnPairsTransferred("p", "e");
    (*plan)->OnPairsDown("p", "e", 0, Aborted("after Detach"));
    (*plan)->WaitRepairsIdle();
    EXPECT_EQ((*plan)->repairs(), 4);
    EXPECT_EQ(IdsOf(**plan, 0, 0), p_detached);
}

}  // namespace
}  // namespace kvshard::cli
