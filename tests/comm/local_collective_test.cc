#include "comm/local_collective.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "tests/comm/collective_test_util.h"

namespace kvshard {
namespace {

using testing::RankInput;
using testing::RankOrderSum;
using testing::RunLocalRanks;
using testing::SameBits;

void ExpectAllOk(const std::vector<Status>& statuses) {
    for (size_t r = 0; r < statuses.size(); ++r) {
        EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
    }
}

class LocalCollectiveTest : public ::testing::TestWithParam<int> {};

TEST_P(LocalCollectiveTest, AllReduceSumIsTheRankOrderSumOnEveryRank) {
    const int size = GetParam();
    auto group = LocalGroup::Create(size);
    // Small counts go through the staging buffers, large ones split the additions among ranks.
    constexpr int64_t kStaged = LocalGroup::kMaxStagedFloats;
    const std::vector<int64_t> counts = {0,    1,       7,           1000,
                                         4099, kStaged, kStaged + 1, 3 * kStaged + 5};
    std::vector<std::vector<std::vector<float>>> results(  // [rank][case]
        size, std::vector<std::vector<float>>(counts.size()));
    std::vector<int64_t> bytes(size, 0);
    ExpectAllOk(RunLocalRanks(group, [&](int rank, Collective& c) -> Status {
        EXPECT_EQ(c.rank(), rank);
        EXPECT_EQ(c.size(), size);
        for (size_t k = 0; k < counts.size(); ++k) {
            results[rank][k] = RankInput(rank, counts[k], k);
            KV_RETURN_IF_ERROR(c.AllReduceSum(results[rank][k].data(), counts[k]));
        }
        bytes[rank] = c.bytes_all_reduced();
        return Status::Ok();
    }));
    int64_t total = 0;
    for (int64_t n : counts) total += n * 4;
    for (size_t k = 0; k < counts.size(); ++k) {
        const std::vector<float> expected = RankOrderSum(size, counts[k], k);
        for (int r = 0; r < size; ++r) {
            EXPECT_TRUE(SameBits(results[r][k], expected))
                << "rank " << r << " count " << counts[k];
        }
    }
    for (int r = 0; r < size; ++r) EXPECT_EQ(bytes[r], total) << "rank " << r;
}

// Thread timing varies from run to run; the bits must not.
TEST_P(LocalCollectiveTest, AllReduceSumIsDeterministicAcrossRuns) {
    const int size = GetParam();
    auto group = LocalGroup::Create(size);
    constexpr int kRuns = 50;
    constexpr int64_t kCount = 333;
    const std::vector<float> expected = RankOrderSum(size, kCount, 99);
    std::atomic<int> mismatches{0};
    ExpectAllOk(RunLocalRanks(group, [&](int rank, Collective& c) -> Status {
        for (int run = 0; run < kRuns; ++run) {
            std::vector<float> data = RankInput(rank, kCount, 99);
            KV_RETURN_IF_ERROR(c.AllReduceSum(data.data(), kCount));
            if (!SameBits(data, expected)) ++mismatches;
        }
        return Status::Ok();
    }));
    EXPECT_EQ(mismatches.load(), 0);
}

TEST_P(LocalCollectiveTest, AllGatherIsRankMajor) {
    const int size = GetParam();
    for (const int64_t count : {int64_t{5}, LocalGroup::kMaxStagedFloats + 3}) {
        auto group = LocalGroup::Create(size);
        std::vector<std::vector<float>> received(size);
        ExpectAllOk(RunLocalRanks(group, [&](int rank, Collective& c) -> Status {
            std::vector<float> send(count);
            for (int64_t i = 0; i < count; ++i) send[i] = static_cast<float>(rank * 100 + i);
            received[rank].assign(count * size, -1.0f);
            return c.AllGather(send.data(), count, received[rank].data());
        }));
        int64_t wrong = 0;
        for (int r = 0; r < size; ++r) {
            for (int from = 0; from < size; ++from) {
                for (int64_t i = 0; i < count; ++i) {
                    wrong += received[r][from * count + i] != static_cast<float>(from * 100 + i);
                }
            }
        }
        EXPECT_EQ(wrong, 0) << "count " << count;
    }
}

TEST_P(LocalCollectiveTest, BroadcastFromEveryRoot) {
    const int size = GetParam();
    auto group = LocalGroup::Create(size);
    std::vector<std::vector<std::string>> seen(size, std::vector<std::string>(size));
    ExpectAllOk(RunLocalRanks(group, [&](int rank, Collective& c) -> Status {
        for (int root = 0; root < size; ++root) {
            std::string text =
                rank == root ? "root " + std::to_string(root) + " says hi" : std::string(16, '?');
            text.resize(16, '.');
            KV_RETURN_IF_ERROR(c.Broadcast(text.data(), 16, root));
            seen[rank][root] = text;
        }
        return Status::Ok();
    }));
    for (int r = 0; r < size; ++r) {
        for (int root = 0; root < size; ++root) {
            std::string expected = "root " + std::to_string(root) + " says hi";
            expected.resize(16, '.');
            EXPECT_EQ(seen[r][root], expected) << "rank " << r;
        }
    }
}

TEST_P(LocalCollectiveTest, LargeBroadcastFromEveryRoot) {
    const int size = GetParam();
    const int64_t bytes = LocalGroup::kMaxStagedFloats * 4 + 1;
    auto group = LocalGroup::Create(size);
    std::vector<int64_t> wrong(size, 0);
    ExpectAllOk(RunLocalRanks(group, [&](int rank, Collective& c) -> Status {
        for (int root = 0; root < size; ++root) {
            std::vector<uint8_t> data(bytes, rank == root ? 0 : 0xff);
            if (rank == root) {
                for (int64_t i = 0; i < bytes; ++i) data[i] = static_cast<uint8_t>(i * 7 + root);
            }
            KV_RETURN_IF_ERROR(c.Broadcast(data.data(), bytes, root));
            for (int64_t i = 0; i < bytes; ++i) {
                wrong[rank] += data[i] != static_cast<uint8_t>(i * 7 + root);
            }
        }
        return Status::Ok();
    }));
    for (int r = 0; r < size; ++r) EXPECT_EQ(wrong[r], 0) << "rank " << r;
}

// Small and large all-reduces and the other operations interleaved, as a decode step mixes them:
// the staging buffers of one operation must not be overwritten while a peer still reads them.
TEST_P(LocalCollectiveTest, MixedOperationsKeepTheirBits) {
    const int size = GetParam();
    auto group = LocalGroup::Create(size);
    const std::vector<int64_t> counts = {576, 1, LocalGroup::kMaxStagedFloats + 1, 3, 576 * 4};
    std::vector<std::vector<float>> expected;
    for (size_t k = 0; k < counts.size(); ++k) expected.push_back(RankOrderSum(size, counts[k], k));
    std::atomic<int> mismatches{0};
    ExpectAllOk(RunLocalRanks(group, [&](int rank, Collective& c) -> Status {
        for (int round = 0; round < 200; ++round) {
            const size_t k = round % counts.size();
            std::vector<float> data = RankInput(rank, counts[k], k);
            KV_RETURN_IF_ERROR(c.AllReduceSum(data.data(), counts[k]));
            if (!SameBits(data, expected[k])) ++mismatches;
            if (round % 7 == 0) KV_RETURN_IF_ERROR(c.Barrier());
            if (round % 11 == 0) {
                int value = rank == 0 ? round : -1;
                KV_RETURN_IF_ERROR(c.Broadcast(&value, sizeof(value), 0));
                if (value != round) ++mismatches;
            }
        }
        return Status::Ok();
    }));
    EXPECT_EQ(mismatches.load(), 0);
}

TEST_P(LocalCollectiveTest, BarrierWaitsForEveryRank) {
    const int size = GetParam();
    auto group = LocalGroup::Create(size);
    std::atomic<int> arrived{0};
    std::atomic<int> early{0};
    ExpectAllOk(RunLocalRanks(group, [&](int, Collective& c) -> Status {
        for (int round = 1; round <= 20; ++round) {
            ++arrived;
            KV_RETURN_IF_ERROR(c.Barrier());
            if (arrived.load() < round * size) ++early;
            KV_RETURN_IF_ERROR(c.Barrier());  // nobody starts the next round before all checked
        }
        return Status::Ok();
    }));
    EXPECT_EQ(early.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Sizes, LocalCollectiveTest, ::testing::Values(1, 2, 3, 4, 8),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// Floats do not associate: (1e8 + 1) - 1e8 is 0, 1e8 + (1 - 1e8) is 0 too, but (1e8 - 1e8) + 1
// is 1. Only the rank order 0, 1, 2 is right.
TEST(LocalCollective, AddsInRankOrder) {
    auto group = LocalGroup::Create(3);
    const float inputs[3] = {1e8f, 1.0f, -1e8f};
    std::vector<float> out(3);
    ExpectAllOk(RunLocalRanks(group, [&](int rank, Collective& c) -> Status {
        float x = inputs[rank];
        KV_RETURN_IF_ERROR(c.AllReduceSum(&x, 1));
        out[rank] = x;
        return Status::Ok();
    }));
    for (int r = 0; r < 3; ++r) EXPECT_EQ(out[r], (1e8f + 1.0f) + -1e8f) << "rank " << r;
}

// Bigger groups than cores (tests run tp 4 on 2 cores): a waiting rank must give its core to the
// peer it waits for within microseconds, not spin through the peer's time slice (milliseconds
// per barrier, minutes for this test).
// User + system CPU seconds of this process so far.
double ProcessCpuSeconds() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

TEST(LocalCollective, OversubscribedRanksMakeProgress) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
    std::vector<int> cpus;
    for (int cpu = 0; cpu < CPU_SETSIZE && cpus.size() < 2; ++cpu) {
        if (CPU_ISSET(cpu, &allowed)) cpus.push_back(cpu);
    }
    ASSERT_FALSE(cpus.empty());
    struct Case {
        int ranks;
        int num_cpus;
    };
    for (const Case& test : {Case{4, 2}, Case{4, 1}, Case{8, 2}}) {
        if (test.num_cpus > static_cast<int>(cpus.size())) continue;
        constexpr int kIterations = 5000;
        constexpr int64_t kCount = 576;
        auto group = LocalGroup::Create(test.ranks, /*timeout_ms=*/30'000);
        const std::vector<float> expected = RankOrderSum(test.ranks, kCount, 5);
        std::atomic<int> mismatches{0};
        const double cpu_start = ProcessCpuSeconds();
        ExpectAllOk(RunLocalRanks(group, [&](int rank, Collective& c) -> Status {
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(cpus[rank % test.num_cpus], &one);
            EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(one), &one), 0);
            const std::vector<float> input = RankInput(rank, kCount, 5);
            std::vector<float> data;
            for (int i = 0; i < kIterations; ++i) {
                data = input;
                KV_RETURN_IF_ERROR(c.AllReduceSum(data.data(), kCount));
            }
            if (!SameBits(data, expected)) ++mismatches;
            return Status::Ok();
        }));
        const double cpu_seconds = ProcessCpuSeconds() - cpu_start;
        EXPECT_EQ(mismatches.load(), 0);
        // The CPU time this process burnt, not the wall time, so that other load on the machine
        // cannot fail the test: well under a second when waiters yield to the peer they wait
        // for; spinning through time slices burns minutes.
        EXPECT_LT(cpu_seconds, 10.0) << test.ranks << " ranks on " << test.num_cpus << " cpu(s)";
    }
}

TEST(LocalCollective, TimeoutFailsEveryWaitingRankAndLaterCalls) {
    auto group = LocalGroup::Create(3, /*timeout_ms=*/100);
    const std::vector<Status> statuses = RunLocalRanks(group, [&](int rank, Collective& c) {
        if (rank == 2) return Status::Ok();  // never joins
        float x = 1.0f;
        return c.AllReduceSum(&x, 1);
    });
    EXPECT_EQ(statuses[0].code(), StatusCode::kDeadlineExceeded) << statuses[0].ToString();
    EXPECT_EQ(statuses[1].code(), StatusCode::kDeadlineExceeded) << statuses[1].ToString();
    EXPECT_NE(statuses[0].message().find("rank(s) 2"), std::string::npos) << statuses[0].ToString();
    // The late rank and any later call get the same error at once.
    auto late = group->Collective(2);
    EXPECT_EQ(late->Barrier().code(), StatusCode::kDeadlineExceeded);
    EXPECT_EQ(group->status().code(), StatusCode::kDeadlineExceeded);
}

TEST(LocalCollective, AbortReleasesEveryRank) {
    auto group = LocalGroup::Create(4, /*timeout_ms=*/30'000);
    const std::vector<Status> statuses = RunLocalRanks(group, [&](int rank, Collective& c) {
        if (rank == 3) {
            c.Abort("worker 3 lost its device");
            return Status::Ok();
        }
        std::vector<float> data(100, 1.0f);
        return c.AllReduceSum(data.data(), 100);
    });
    for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << statuses[r].ToString();
        EXPECT_NE(statuses[r].message().find("lost its device"), std::string::npos);
    }
    EXPECT_EQ(group->Collective(0)->Barrier().code(), StatusCode::kAborted);
}

TEST(LocalCollective, AbortFromAnotherThreadReleasesWaitingRanks) {
    auto group = LocalGroup::Create(2, /*timeout_ms=*/30'000);
    std::thread watchdog([&] { group->Abort("watchdog"); });
    const std::vector<Status> statuses = RunLocalRanks(group, [&](int rank, Collective& c) {
        Status status;
        while (status.ok()) status = c.Barrier();  // until the watchdog's abort lands
        return status;
    });
    watchdog.join();
    EXPECT_EQ(statuses[0].code(), StatusCode::kAborted);
    EXPECT_EQ(statuses[1].code(), StatusCode::kAborted);
}

TEST(LocalCollective, RanksThatDisagreeFailTogether) {
    struct Case {
        const char* name;
        std::function<Status(Collective&, int)> call;
    };
    const std::vector<Case> cases = {
        {"different counts",
         [](Collective& c, int rank) {
             std::vector<float> data(6);
             return c.AllReduceSum(data.data(), rank == 0 ? 5 : 6);
         }},
        {"a staged and a split all-reduce",
         [](Collective& c, int rank) {
             const int64_t count = LocalGroup::kMaxStagedFloats + rank;
             std::vector<float> data(count);
             return c.AllReduceSum(data.data(), count);
         }},
        {"different operations",
         [](Collective& c, int rank) {
             float x = 0;
             return rank == 0 ? c.Barrier() : c.AllReduceSum(&x, 1);
         }},
        {"different roots",
         [](Collective& c, int rank) {
             char byte = 0;
             return c.Broadcast(&byte, 1, rank);
         }},
    };
    for (const Case& test : cases) {
        auto group = LocalGroup::Create(2, 30'000);
        const std::vector<Status> statuses =
            RunLocalRanks(group, [&](int rank, Collective& c) { return test.call(c, rank); });
        for (int r = 0; r < 2; ++r) {
            EXPECT_EQ(statuses[r].code(), StatusCode::kAborted) << test.name;
            EXPECT_NE(statuses[r].message().find("disagree"), std::string::npos)
                << test.name << ": " << statuses[r].ToString();
        }
    }
}

TEST(LocalCollective, RejectsBadArguments) {
    auto group = LocalGroup::Create(1);
    auto c = group->Collective(0);
    float x = 0;
    EXPECT_EQ(c->AllReduceSum(&x, -1).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(c->AllGather(&x, -1, &x).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(c->Broadcast(&x, 4, 1).code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(group->status().ok());  // argument errors do not break the group
}

TEST(MakeCollective, BuildsLocalCommunicators) {
    CollectiveConfig config;
    config.kind = CollectiveConfig::Kind::kLocal;
    EXPECT_EQ(MakeCollective(config).status().code(), StatusCode::kInvalidArgument);
    config.local_group = LocalGroup::Create(2);
    config.rank = 2;
    EXPECT_EQ(MakeCollective(config).status().code(), StatusCode::kInvalidArgument);
    config.rank = 1;
    Result<std::unique_ptr<Collective>> made = MakeCollective(config);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    EXPECT_EQ((*made)->rank(), 1);
    EXPECT_EQ((*made)->size(), 2);
}

TEST(MakeCollective, MpiNeedsARuntime) {
    CollectiveConfig config;
    config.kind = CollectiveConfig::Kind::kMpi;
    const Status status = MakeCollective(config).status();
    // InvalidArgument (no MpiRuntime in this process) or Unimplemented (built without MPI).
    EXPECT_TRUE(status.code() == StatusCode::kInvalidArgument ||
                status.code() == StatusCode::kUnimplemented)
        << status.ToString();
}

}  // namespace
}  // namespace kvshard
