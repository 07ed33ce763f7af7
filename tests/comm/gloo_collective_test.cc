// The Gloo communicator (comm/gloo_collective.cc): one thread per rank, each with a
// communicator of its own over real TCP pairs on loopback, meeting in an in-test
// MemoryCollectiveStore. Skipped in builds without Gloo.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/collective_store.h"
#include "comm/local_collective.h"
#include "common/build_config.h"
#include "tests/comm/collective_test_util.h"

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;
using testing::RankInput;
using testing::RankOrderSum;
using testing::RunLocalRanks;
using testing::SameBits;

CollectiveConfig GlooConfig(int rank, int size, std::shared_ptr<CollectiveStore> store,
                            int64_t timeout_ms = 20'000) {
    CollectiveConfig c;
    c.kind = CollectiveConfig::Kind::kGloo;
    c.rank = rank;
    c.size = size;
    c.gloo_store = std::move(store);
    c.timeout_ms = timeout_ms;
    return c;
}

// Runs fn(rank, collective) on one thread per rank of a fresh Gloo group (every rank's
// communicator built on its own thread, as separate processes would).
std::vector<Status> RunGlooRanks(int size, const std::function<Status(int, Collective&)>& fn,
                                 int64_t timeout_ms = 20'000,
                                 const std::function<void(CollectiveConfig&)>& tweak = {}) {
    auto store = std::make_shared<MemoryCollectiveStore>();
    std::vector<Status> statuses(static_cast<size_t>(size));
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
        threads.emplace_back([&, r] {
            CollectiveConfig config = GlooConfig(r, size, store, timeout_ms);
            if (tweak) tweak(config);
            Result<std::unique_ptr<Collective>> c = MakeCollective(config);
            if (!c.ok()) {
                statuses[r] = c.status();
                return;
            }
            statuses[r] = fn(r, **c);
        });
    }
    for (std::thread& t : threads) t.join();
    return statuses;
}

void ExpectAllOk(const std::vector<Status>& statuses) {
    for (size_t r = 0; r < statuses.size(); ++r) {
        EXPECT_TRUE(statuses[r].ok()) << "rank " << r << ": " << statuses[r].ToString();
    }
}

#if KVSHARD_WITH_GLOO

class GlooCollectiveTest : public ::testing::TestWithParam<int> {};

// The contract of comm/collective.h: rank-order sums, the same bits on every rank, and the
// bits of the in-process group of the same size (so tp over Gloo = tp over threads = tp over MPI).
TEST_P(GlooCollectiveTest, AllReduceSumIsTheRankOrderSumAndMatchesLocalGroupBits) {
    const int size = GetParam();
    // Below and above the two-phase threshold (64 KiB = 16384 floats), and fewer than size.
    const std::vector<int64_t> counts = {0, 1, 3, 7, 1000, 16383, 16384, 3 * 16384 + 5};
    std::vector<std::vector<std::vector<float>>> results(
        size, std::vector<std::vector<float>>(counts.size()));
    std::vector<int64_t> bytes(size, 0);
    ExpectAllOk(RunGlooRanks(size, [&](int rank, Collective& c) -> Status {
        EXPECT_EQ(c.rank(), rank);
        EXPECT_EQ(c.size(), size);
        for (size_t k = 0; k < counts.size(); ++k) {
            results[rank][k] = RankInput(rank, counts[k], k);
            KV_RETURN_IF_ERROR(c.AllReduceSum(results[rank][k].data(), counts[k]));
        }
        bytes[rank] = c.bytes_all_reduced();
        return Status::Ok();
    }));
    std::vector<std::vector<std::vector<float>>> local(
        size, std::vector<std::vector<float>>(counts.size()));
    ExpectAllOk(RunLocalRanks(LocalGroup::Create(size), [&](int rank, Collective& c) -> Status {
        for (size_t k = 0; k < counts.size(); ++k) {
            local[rank][k] = RankInput(rank, counts[k], k);
            KV_RETURN_IF_ERROR(c.AllReduceSum(local[rank][k].data(), counts[k]));
        }
        return Status::Ok();
    }));
    int64_t total = 0;
    for (int64_t n : counts) total += n * 4;
    for (size_t k = 0; k < counts.size(); ++k) {
        const std::vector<float> expected = RankOrderSum(size, counts[k], k);
        for (int r = 0; r < size; ++r) {
            EXPECT_TRUE(SameBits(results[r][k], expected))
                << "rank " << r << " count " << counts[k];
            EXPECT_TRUE(SameBits(results[r][k], local[r][k]))
                << "rank " << r << " count " << counts[k] << ": Gloo and LocalGroup bits differ";
        }
    }
    for (int r = 0; r < size; ++r) EXPECT_EQ(bytes[r], total) << "rank " << r;
}

// The two algorithms add alike: forcing the two-phase path for every size gives the same bits.
TEST_P(GlooCollectiveTest, TwoPhaseAndGatheredSumsAgree) {
    const int size = GetParam();
    const std::vector<int64_t> counts = {1, 2, 5, 577, 4099};
    std::vector<std::vector<std::vector<float>>> results(
        size, std::vector<std::vector<float>>(counts.size()));
    ExpectAllOk(RunGlooRanks(
        size,
        [&](int rank, Collective& c) -> Status {
            for (size_t k = 0; k < counts.size(); ++k) {
                results[rank][k] = RankInput(rank, counts[k], 100 + k);
                KV_RETURN_IF_ERROR(c.AllReduceSum(results[rank][k].data(), counts[k]));
            }
            return Status::Ok();
        },
        20'000, [](CollectiveConfig& c) { c.gloo_two_phase_min_bytes = 0; }));
    for (size_t k = 0; k < counts.size(); ++k) {
        const std::vector<float> expected = RankOrderSum(size, counts[k], 100 + k);
        for (int r = 0; r < size; ++r) {
            EXPECT_TRUE(SameBits(results[r][k], expected))
                << "rank " << r << " count " << counts[k];
        }
    }
}

TEST_P(GlooCollectiveTest, AllGatherBroadcastAndBarrier) {
    const int size = GetParam();
    constexpr int64_t kCount = 37;
    std::vector<std::vector<float>> gathered(size);
    std::vector<std::vector<char>> broadcast(size);
    ExpectAllOk(RunGlooRanks(size, [&](int rank, Collective& c) -> Status {
        const std::vector<float> mine = RankInput(rank, kCount, 5);
        gathered[rank].assign(kCount * size, -1.0f);
        KV_RETURN_IF_ERROR(c.AllGather(mine.data(), kCount, gathered[rank].data()));
        const int root = size - 1;
        broadcast[rank].assign(1000, static_cast<char>(rank));
        if (rank == root) {
            for (size_t i = 0; i < broadcast[rank].size(); ++i) {
                broadcast[rank][i] = static_cast<char>(i * 7 + 3);
            }
        }
        KV_RETURN_IF_ERROR(c.Broadcast(broadcast[rank].data(), 1000, root));
        KV_RETURN_IF_ERROR(c.Barrier());
        return c.Barrier();
    }));
    std::vector<float> expected;
    for (int r = 0; r < size; ++r) {
        const std::vector<float> part = RankInput(r, kCount, 5);
        expected.insert(expected.end(), part.begin(), part.end());
    }
    for (int r = 0; r < size; ++r) {
        EXPECT_TRUE(SameBits(gathered[r], expected)) << "rank " << r;
        for (size_t i = 0; i < broadcast[r].size(); ++i) {
            ASSERT_EQ(broadcast[r][i], static_cast<char>(i * 7 + 3)) << "rank " << r << " @" << i;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Sizes, GlooCollectiveTest, ::testing::Values(1, 2, 3, 4));

// A rank that stops calling: its peer's call ends at the deadline with DeadlineExceeded, and
// the communicator stays broken: the next call returns the error at once.
TEST(GlooCollectiveFailureTest, TimeoutBreaksTheCommunicator) {
    std::atomic<bool> rank0_done{false};
    Status first, second;
    Clock::duration waited{}, second_took{};
    ExpectAllOk(RunGlooRanks(
        2,
        [&](int rank, Collective& c) -> Status {
            std::vector<float> data(16, 1.0f);
            KV_RETURN_IF_ERROR(c.AllReduceSum(data.data(), 16));  // both: works
            if (rank == 1) {
                // Rank 1 skips the next all-reduce: it waits until rank 0 has given up.
                while (!rank0_done.load()) std::this_thread::yield();
                return Status::Ok();
            }
            const auto start = Clock::now();
            first = c.AllReduceSum(data.data(), 16);
            waited = Clock::now() - start;
            const auto again = Clock::now();
            second = c.Barrier();
            second_took = Clock::now() - again;
            rank0_done.store(true);
            return Status::Ok();
        },
        500));
    EXPECT_EQ(first.code(), StatusCode::kDeadlineExceeded) << first.ToString();
    EXPECT_NE(first.message().find("Gloo rank 0"), std::string::npos) << first.ToString();
    EXPECT_GE(waited, std::chrono::milliseconds(400));
    EXPECT_LT(waited, std::chrono::seconds(10));
    EXPECT_EQ(second.code(), StatusCode::kDeadlineExceeded) << second.ToString();
    EXPECT_LT(second_took, std::chrono::milliseconds(100));
}

// Abort from another thread ends the wait in progress at once and every later call.
TEST(GlooCollectiveFailureTest, AbortEndsAPendingCall) {
    std::atomic<bool> rank0_done{false};
    Status pending, later;
    Clock::duration took{};
    ExpectAllOk(RunGlooRanks(
        2,
        [&](int rank, Collective& c) -> Status {
            if (rank == 1) {
                while (!rank0_done.load()) std::this_thread::yield();
                return Status::Ok();
            }
            std::thread aborter([&] {
                std::this_thread::sleep_for(std::chrono::milliseconds(200));
                c.Abort("test abort");
            });
            std::vector<float> data(1000, 2.0f);
            const auto start = Clock::now();
            pending = c.AllReduceSum(data.data(), 1000);
            took = Clock::now() - start;
            aborter.join();
            later = c.AllGather(data.data(), 1, data.data() + 10);
            rank0_done.store(true);
            return Status::Ok();
        },
        30'000));
    EXPECT_EQ(pending.code(), StatusCode::kAborted) << pending.ToString();
    EXPECT_NE(pending.message().find("test abort"), std::string::npos) << pending.ToString();
    EXPECT_LT(took, std::chrono::seconds(5));  // not the 30 s deadline
    EXPECT_EQ(later.code(), StatusCode::kAborted) << later.ToString();
}

// A group whose other rank never arrives does not form: DeadlineExceeded naming the rank's key.
TEST(GlooCollectiveFailureTest, RendezvousWithoutThePeerTimesOut) {
    auto store = std::make_shared<MemoryCollectiveStore>();
    const auto start = Clock::now();
    Result<std::unique_ptr<Collective>> c = MakeCollective(GlooConfig(0, 2, store, 300));
    EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded) << c.status().ToString();
    EXPECT_NE(c.status().message().find("rendezvous"), std::string::npos) << c.status().ToString();
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
}

TEST(GlooCollectiveFailureTest, BadConfigurationsAreRefused) {
    auto store = std::make_shared<MemoryCollectiveStore>();
    CollectiveConfig no_store = GlooConfig(0, 2, nullptr);
    EXPECT_EQ(MakeCollective(no_store).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(MakeCollective(GlooConfig(2, 2, store)).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(MakeCollective(GlooConfig(0, 0, store)).status().code(),
              StatusCode::kInvalidArgument);
    CollectiveConfig no_timeout = GlooConfig(0, 1, store, 0);
    EXPECT_EQ(MakeCollective(no_timeout).status().code(), StatusCode::kInvalidArgument);
    CollectiveConfig bad_host = GlooConfig(0, 1, store);
    bad_host.gloo_host = "no-such-host.invalid";
    Result<std::unique_ptr<Collective>> c = MakeCollective(bad_host);
    EXPECT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("no-such-host.invalid"), std::string::npos)
        << c.status().ToString();
}

#else

TEST(GlooCollectiveTest, UnimplementedWithoutGloo) {
    auto store = std::make_shared<MemoryCollectiveStore>();
    EXPECT_EQ(MakeCollective(GlooConfig(0, 1, store)).status().code(), StatusCode::kUnimplemented);
}

#endif

TEST(MemoryCollectiveStoreTest, GetWaitsForTheSetAndBoundsAreEnforced) {
    MemoryCollectiveStore store;
    std::thread setter([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        EXPECT_TRUE(store.Set("k", "v").ok());
    });
    Result<std::string> got = store.Get("k", Clock::now() + std::chrono::seconds(10));
    setter.join();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, "v");
    Result<std::string> missing = store.Get("nope", Clock::now() + std::chrono::milliseconds(20));
    EXPECT_EQ(missing.status().code(), StatusCode::kDeadlineExceeded);
    EXPECT_NE(missing.status().message().find("'nope'"), std::string::npos);

    EXPECT_EQ(store.Set(std::string(kMaxCollectiveStoreKeyBytes + 1, 'x'), "v").code(),
              StatusCode::kResourceExhausted);
    EXPECT_EQ(store.Set("big", std::string(kMaxCollectiveStoreValueBytes + 1, 'x')).code(),
              StatusCode::kResourceExhausted);
    EXPECT_EQ(store.Set("", "v").code(), StatusCode::kInvalidArgument);
    for (size_t i = store.size(); i < kMaxCollectiveStoreKeys; ++i) {
        ASSERT_TRUE(store.Set("key" + std::to_string(i), "").ok());
    }
    EXPECT_EQ(store.Set("one-more", "").code(), StatusCode::kResourceExhausted);
    EXPECT_TRUE(store.Set("k", "replaced").ok());  // an existing key may still change
    EXPECT_EQ(store.Find("k").value_or(""), "replaced");
}

}  // namespace
}  // namespace kvshard
