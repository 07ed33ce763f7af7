// The MPI communicator across processes. Not a plain gtest binary: ctest runs it under
// `mpirun -np 2` and `-np 4` (tests/CMakeLists.txt, label "mpi"); every rank runs the same tests
// in the same order, and the job fails when any rank fails.
//
//   mpirun --allow-run-as-root --oversubscribe -np 4 build/tests/kvshard_comm_mpi_tests
#include <gtest/gtest.h>
#include <mpi.h>

#include <climits>
#include <cstdio>
#include <cstring>

#include "comm/collective.h"
#include "comm/mpi_runtime.h"
#include "tests/comm/collective_test_util.h"

namespace kvshard {
namespace {

int WorldRank() {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return rank;
}

int WorldSize() {
    int size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    return size;
}

std::unique_ptr<Collective> MakeMpi(int64_t timeout_ms = 60'000, int color = -1,
                                    int64_t two_phase_min_bytes = 64 * 1024) {
    CollectiveConfig config;
    config.kind = CollectiveConfig::Kind::kMpi;
    config.timeout_ms = timeout_ms;
    config.mpi_color = color;
    config.mpi_two_phase_min_bytes = two_phase_min_bytes;
    Result<std::unique_ptr<Collective>> made = MakeCollective(config);
    KV_CHECK(made.ok()) << made.status().ToString();
    return std::move(*made);
}

// The same data reduced by a LocalGroup of the same size in this process: the bits of a thread
// group and of an MPI job must agree.
std::vector<float> LocalGroupSum(int size, int64_t count, uint64_t seed) {
    std::vector<std::vector<float>> data(size);
    testing::RunLocalRanks(LocalGroup::Create(size), [&](int rank, Collective& c) {
        data[rank] = testing::RankInput(rank, count, seed);
        return c.AllReduceSum(data[rank].data(), count);
    });
    return data[0];
}

TEST(MpiCollective, AllReduceSumMatchesTheRankOrderSumAndTheThreadGroup) {
    const int rank = WorldRank();
    const int size = WorldSize();
    struct Case {
        const char* algorithm;
        int64_t two_phase_min_bytes;
    };
    for (const Case& algo :
         {Case{"all-gather", INT64_MAX}, Case{"two-phase", 0}, Case{"default", 64 * 1024}}) {
        std::unique_ptr<Collective> c = MakeMpi(60'000, -1, algo.two_phase_min_bytes);
        EXPECT_EQ(c->rank(), rank);
        EXPECT_EQ(c->size(), size);
        int64_t expected_bytes = 0;
        for (int64_t count :
             {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{7}, int64_t{1000}, int64_t{100'003}}) {
            const uint64_t seed = static_cast<uint64_t>(count) + 11;
            std::vector<float> data = testing::RankInput(rank, count, seed);
            ASSERT_TRUE(c->AllReduceSum(data.data(), count).ok());
            expected_bytes += count * 4;
            EXPECT_TRUE(testing::SameBits(data, testing::RankOrderSum(size, count, seed)))
                << algo.algorithm << " count " << count;
            EXPECT_TRUE(testing::SameBits(data, LocalGroupSum(size, count, seed)))
                << algo.algorithm << " count " << count;
            // Every rank holds the same bits: gather them all and compare.
            std::vector<float> everyone(data.size() * size);
            ASSERT_TRUE(c->AllGather(data.data(), count, everyone.data()).ok());
            for (int r = 0; r < size && count > 0; ++r) {
                EXPECT_EQ(std::memcmp(everyone.data() + r * count, data.data(),
                                      data.size() * sizeof(float)),
                          0)
                    << algo.algorithm << " rank " << r << " count " << count;
            }
        }
        EXPECT_EQ(c->bytes_all_reduced(), expected_bytes);
    }
}

TEST(MpiCollective, AddsInRankOrder) {
    std::unique_ptr<Collective> c = MakeMpi();
    // (1e8 + 1) - 1e8 + 0 + ... is 0; any order that adds -1e8 before 1 would give 1.
    const float inputs[3] = {1e8f, 1.0f, -1e8f};
    float x = c->rank() < 3 ? inputs[c->rank()] : 0.0f;
    ASSERT_TRUE(c->AllReduceSum(&x, 1).ok());
    EXPECT_EQ(x, c->size() == 2 ? 1e8f + 1.0f : 0.0f);
}

TEST(MpiCollective, AllGatherIsRankMajor) {
    std::unique_ptr<Collective> c = MakeMpi();
    const float send[2] = {static_cast<float>(c->rank()), static_cast<float>(c->rank() * 10)};
    std::vector<float> recv(2 * c->size(), -1.0f);
    ASSERT_TRUE(c->AllGather(send, 2, recv.data()).ok());
    for (int r = 0; r < c->size(); ++r) {
        EXPECT_EQ(recv[2 * r], static_cast<float>(r));
        EXPECT_EQ(recv[2 * r + 1], static_cast<float>(r * 10));
    }
}

TEST(MpiCollective, BroadcastFromEveryRootAndBarrier) {
    std::unique_ptr<Collective> c = MakeMpi();
    for (int root = 0; root < c->size(); ++root) {
        std::string text = c->rank() == root ? "root " + std::to_string(root) : "????????";
        text.resize(8, '.');
        ASSERT_TRUE(c->Broadcast(text.data(), 8, root).ok());
        std::string expected = "root " + std::to_string(root);
        expected.resize(8, '.');
        EXPECT_EQ(text, expected);
        ASSERT_TRUE(c->Barrier().ok());
    }
}

TEST(MpiCollective, ColorsSplitTheWorld) {
    const int rank = WorldRank();
    std::unique_ptr<Collective> c = MakeMpi(60'000, rank % 2);
    const int size = WorldSize();
    EXPECT_EQ(c->size(), (size + 1 - rank % 2) / 2);
    EXPECT_EQ(c->rank(), rank / 2);
    float x = static_cast<float>(rank);
    ASSERT_TRUE(c->AllReduceSum(&x, 1).ok());
    float expected = 0;
    for (int r = rank % 2; r < size; r += 2) expected += static_cast<float>(r);
    EXPECT_EQ(x, expected);
}

TEST(MpiCollective, AbortFailsLaterCalls) {
    std::unique_ptr<Collective> c = MakeMpi();
    c->Abort("test");
    float x = 0;
    const Status status = c->AllReduceSum(&x, 1);
    EXPECT_EQ(status.code(), StatusCode::kAborted) << status.ToString();
    EXPECT_EQ(c->Barrier().code(), StatusCode::kAborted);
}

// Rank 0 enters an all-reduce nobody else joins in time: it gets DeadlineExceeded instead of
// hanging, and the communicator stays broken. The others join late (after rank 0 gave up), which
// lets the abandoned operation complete, so the job can still finalize cleanly.
TEST(MpiCollective, TimeoutReturnsAnErrorInsteadOfHanging) {
    std::unique_ptr<Collective> late = MakeMpi(/*timeout_ms=*/500);
    std::unique_ptr<Collective> control = MakeMpi();
    float x = 1.0f;
    if (late->rank() == 0) {
        const Status status = late->AllReduceSum(&x, 1);
        EXPECT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.ToString();
        EXPECT_EQ(late->Barrier().code(), StatusCode::kDeadlineExceeded);
        EXPECT_EQ(x, 1.0f);  // the caller's buffer is left alone
        ASSERT_TRUE(control->Barrier().ok());
        ASSERT_TRUE(control->Barrier().ok());
    } else {
        ASSERT_TRUE(control->Barrier().ok());
        const Status status = late->AllReduceSum(&x, 1);
        ASSERT_TRUE(status.ok()) << status.ToString();
        EXPECT_EQ(x, static_cast<float>(late->size()));
        ASSERT_TRUE(control->Barrier().ok());
    }
}

}  // namespace
}  // namespace kvshard

int main(int argc, char** argv) {
    auto runtime = kvshard::MpiRuntime::Init();
    if (!runtime.ok()) {
        std::fprintf(stderr, "%s\n", runtime.status().ToString().c_str());
        return 1;
    }
    // Ranks other than 0 print failures only (read by InitGoogleTest, so set before it).
    if ((*runtime)->world_rank() != 0) GTEST_FLAG_SET(brief, true);
    ::testing::InitGoogleTest(&argc, argv);
    int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
    int any_failed = failed;
    MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if ((*runtime)->world_rank() == 0) {
        std::printf("[mpi] %d ranks: %s\n", (*runtime)->world_size(),
                    any_failed ? "FAILED on at least one rank" : "all passed");
    }
    return any_failed;
}
