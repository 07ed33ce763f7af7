// kvshard serve and the KV pair path's test link (KVSHARD_KV_PAIR_LINK=socket): kv_transfer.path:
// nccl is accepted only for CPU worker processes this coordinator launches, with the knob, and
// refused by name elsewhere (without the knob, embedded pools, external workers, GPUs with the
// knob);
// the knob itself is parsed strictly; the rank settings serve hands out carry each rank's pairs
// (re-sharded when the tps differ, one socket id shared by both ranks of a pair), the link and
// the timeout.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <tuple>

#include "cli/serve_devices.h"
#include "comm/socket_kv_pair_channel.h"
#include "common/build_config.h"
#include "worker/kv_handoff_pairs.h"
#include "tests/worker/kv_pair_test_pools.h"

namespace kvshard::cli {
namespace {

constexpr const char* kPools = R"(model: /models/none.gguf
pools:
  - name: prefill
    role: prefill
    instances:
      - tp: 1
  - name: decode
    role: decode
    instances:
      - tp: 1
kv_transfer:
  path: nccl
)";

Result<std::optional<KvHandoffPath>> PathFor(const std::string& extra, const DevicePlan& plan,
                                             bool knob) {
    Result<ServerConfig> c = ParseServerConfig(std::string(kPools) + extra, "test.yaml");
    KV_CHECK(c.ok()) << c.status().ToString();
    return ServeKvHandoffPath(
        *c, c->EffectivePools(), plan, [](int, int) { return true; }, knob);
}

DevicePlan CudaPlan() {
    DevicePlan plan;
    plan.cuda = true;
    plan.ranks.push_back({.pool = 0, .instance = 0, .rank = 0, .gpu = 0});
    plan.ranks.push_back({.pool = 1, .instance = 0, .rank = 0, .gpu = 1});
    return plan;
}

TEST(ServeKvPairLink, AcceptedOnlyForCpuWorkerProcessesLaunchedHereWithTheKnob) {
    const std::string direct = "workers:\n  mode: processes\n  launcher: direct\n";
    const std::string external =
        "workers:\n  mode: processes\n  launcher: external\n  port: 9000\n  token: t\n";
    auto accepted = PathFor(direct, DevicePlan{}, true);
    ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
    EXPECT_EQ(accepted->value(), KvHandoffPath::kNccl);

    for (const auto& [extra, plan, knob] :
         {std::tuple{direct, DevicePlan{}, false}, std::tuple{std::string(), DevicePlan{}, true},
          std::tuple{external, DevicePlan{}, true}, std::tuple{direct, CudaPlan(), true}}) {
        auto refused = PathFor(extra, plan, knob);
        ASSERT_FALSE(refused.ok()) << extra << " knob " << knob;
        EXPECT_NE(refused.status().message().find("kv_transfer.path: nccl: "), std::string::npos)
            << refused.status().message();
    }
    const std::string gpus = PathFor(direct, CudaPlan(), true).status().message();
    EXPECT_NE(gpus.find(KVSHARD_WITH_CUDA ? "KVSHARD_KV_PAIR_LINK=socket" : "built without CUDA"),
              std::string::npos)
        << gpus;
}

TEST(ServeKvPairLink, TheKnobIsSocketOrNothing) {
    unsetenv("KVSHARD_KV_PAIR_LINK");
    EXPECT_FALSE(*SocketPairLinkFromEnvironment());
    setenv("KVSHARD_KV_PAIR_LINK", "socket", 1);
    EXPECT_TRUE(*SocketPairLinkFromEnvironment());
    setenv("KVSHARD_KV_PAIR_LINK", "nccl", 1);
    Result<bool> bad = SocketPairLinkFromEnvironment();
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("KVSHARD_KV_PAIR_LINK: 'nccl'"), std::string::npos);
    unsetenv("KVSHARD_KV_PAIR_LINK");
}

TEST(ServeKvPairLink, RankSettingsCarryEachRanksPairs) {
    const ModelSpec spec = testing::PairSpec();
    auto settings = KvPairRankSettings(
        spec,
        {{"p", 1, PoolRole::kPrefill}, {"d", 2, PoolRole::kDecode}, {"m", 1, PoolRole::kMixed}},
        KvPairLink::kSocket, "127.0.0.1", 1'234);
    ASSERT_TRUE(settings.ok()) << settings.status().ToString();
    ASSERT_EQ(settings->size(), 3u);
    ASSERT_EQ((*settings)[0].size(), 1u);
    ASSERT_EQ((*settings)[1].size(), 2u);
    EXPECT_TRUE((*settings)[2].empty());
    auto of = [&](size_t instance, size_t rank) {
        Result<std::optional<KvPairHandoffSettings>> s =
            KvPairHandoffSettingsOf((*settings)[instance][rank]);
        KV_CHECK(s.ok() && s->has_value()) << s.status().ToString();
        return **s;
    };
    const KvPairHandoffSettings p0 = of(0, 0), d0 = of(1, 0), d1 = of(1, 1);
    EXPECT_EQ(p0.link, KvPairLink::kSocket);
    EXPECT_EQ(p0.timeout_ms, 1'234);
    ASSERT_EQ(p0.pairs.size(), 2u);
    ASSERT_EQ(d0.pairs.size(), 1u);
    ASSERT_EQ(d1.pairs.size(), 1u);
    // The prefill rank sends heads [0, 2) to decode rank 0 and [2, 4) to decode rank 1.
    for (int d = 0; d < 2; ++d) {
        const KvNcclPairAssignment& send = p0.pairs[static_cast<size_t>(d)];
        const KvNcclPairAssignment& recv = (d == 0 ? d0 : d1).pairs[0];
        EXPECT_EQ(send.peer_instance, "d");
        EXPECT_EQ(send.peer_rank, d);
        EXPECT_EQ(send.nccl_rank, 0);
        EXPECT_EQ(recv.peer_instance, "p");
        EXPECT_EQ(recv.nccl_rank, 1);
        EXPECT_EQ(send.head_begin, 2 * d);
        EXPECT_EQ(send.head_end, 2 * d + 2);
        EXPECT_EQ(recv.head_begin, send.head_begin);
        EXPECT_EQ(send.nccl_unique_id, recv.nccl_unique_id);
        EXPECT_TRUE(IsSocketKvPairId(send.nccl_unique_id));
    }
    EXPECT_NE(p0.pairs[0].nccl_unique_id, p0.pairs[1].nccl_unique_id);
}

// The nccl link: each pair's id is an NCCL unique id (NewNcclUniqueId, as the registry makes a tp
// group's): NCCL_UNIQUE_ID_BYTES (128) bytes, not a socket id, the same for both ranks of a pair
// and fresh for every pair; the link setting says nccl. A build without CUDA has no ids to give.
TEST(ServeKvPairLink, NcclLinkHandsOutNcclUniqueIds) {
    auto settings = KvPairRankSettings(testing::PairSpec(),
                                       {{"p", 2, PoolRole::kPrefill}, {"d", 1, PoolRole::kDecode}},
                                       KvPairLink::kNccl, "127.0.0.1", 500);
    if (!KVSHARD_WITH_CUDA) {
        EXPECT_EQ(settings.status().code(), StatusCode::kUnimplemented)
            << settings.status().ToString();
        return;
    }
    ASSERT_TRUE(settings.ok()) << settings.status().ToString();
    std::vector<KvPairHandoffSettings> ranks;
    for (size_t i = 0; i < 2; ++i) {
        for (const auto& rank : (*settings)[i]) {
            Result<std::optional<KvPairHandoffSettings>> s = KvPairHandoffSettingsOf(rank);
            ASSERT_TRUE(s.ok() && s->has_value()) << s.status().ToString();
            EXPECT_EQ((*s)->link, KvPairLink::kNccl);
            ranks.push_back(**s);
        }
    }
    ASSERT_EQ(ranks.size(), 3u);  // p0, p1, d0
    const KvPairHandoffSettings& d0 = ranks[2];
    ASSERT_EQ(d0.pairs.size(), 2u);  // one pair with each prefill rank
    for (int p = 0; p < 2; ++p) {
        ASSERT_EQ(ranks[size_t(p)].pairs.size(), 1u);
        const std::string& id = ranks[size_t(p)].pairs[0].nccl_unique_id;
        EXPECT_EQ(id.size(), 128u);
        EXPECT_FALSE(IsSocketKvPairId(id));
        EXPECT_EQ(d0.pairs[size_t(p)].peer_rank, p);
        EXPECT_EQ(d0.pairs[size_t(p)].nccl_unique_id, id);
    }
    EXPECT_NE(d0.pairs[0].nccl_unique_id, d0.pairs[1].nccl_unique_id);
}

TEST(ServeKvPairLink, StartupNoteSaysTheNcclPathNeverRanOnAGpu) {
    EXPECT_NE(KvPairLinkNote(KvPairLink::kNccl).find("never run on a GPU"), std::string::npos);
    EXPECT_NE(KvPairLinkNote(KvPairLink::kSocket).find("tests only"), std::string::npos);
}

}  // namespace
}  // namespace kvshard::cli
