// KvPeerExchange (worker/kv_peer_exchange.h), the in-process KV handoff by peer copies: sources
// wait per receiving endpoint until taken whole, a take that is not covered by its deadline is
// DeadlineExceeded, discarded transfers refuse later posts, the per-endpoint bound holds, and a
// sending rank's registration going away marks its sources dead (so a receiver fails the copy
// instead of reading freed memory).
#include "worker/kv_peer_exchange.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

namespace kvshard {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

class KvPeerExchangeTest : public ::testing::Test {
  protected:
    void SetUp() override {
        Result<std::unique_ptr<Backend>> b = MakeBackend({.kind = BackendKind::kCpu});
        ASSERT_TRUE(b.ok());
        backend_ = std::move(*b);
        Result<std::unique_ptr<KvPool>> p = KvPool::Create({.num_blocks = 4,
                                                            .block_size = 4,
                                                            .num_layers = 2,
                                                            .num_kv_heads = 2,
                                                            .head_dim = 8,
                                                            .storage = KvDtype::kFp32},
                                                           *backend_);
        ASSERT_TRUE(p.ok());
        pool_ = std::move(*p);
        layout_.kv_heads = {0, 2};
        registration_ = KvPeerExchange::RegisterSource(*backend_, *pool_, layout_);
    }

    KvPeerSource Source(uint64_t id, int64_t head_begin, int64_t head_end) const {
        return {.transfer_id = id,
                .rank = registration_->rank(),
                .blocks = {{1, 2}},
                .heads = {head_begin, head_end},
                .cells = 2 * (head_end - head_begin)};
    }

    std::unique_ptr<Backend> backend_;
    std::unique_ptr<KvPool> pool_;
    ShardLayout layout_;
    std::unique_ptr<KvPeerExchange::Registration> registration_;
};

TEST_F(KvPeerExchangeTest, TakesTheSourcesOfOneTransferOnceCovered) {
    KvPeerExchange x;
    ASSERT_TRUE(x.Post("local:d/0", Source(7, 0, 1)).ok());
    ASSERT_TRUE(x.Post("local:d/0", Source(8, 0, 2)).ok());
    ASSERT_TRUE(x.Post("local:d/1", Source(7, 1, 2)).ok());
    // Half of transfer 7 for d/0 is there: not enough for 4 cells by the deadline.
    Result<std::vector<KvPeerSource>> early =
        x.Take("local:d/0", 7, 4, Clock::now() + milliseconds(20));
    EXPECT_EQ(early.status().code(), StatusCode::kDeadlineExceeded);
    EXPECT_EQ(x.num_waiting(), 3);
    // The rest arrives while Take waits.
    std::thread late([&] {
        std::this_thread::sleep_for(milliseconds(20));
        EXPECT_TRUE(x.Post("local:d/0", Source(7, 1, 2)).ok());
    });
    Result<std::vector<KvPeerSource>> got =
        x.Take("local:d/0", 7, 4, Clock::now() + milliseconds(5'000));
    late.join();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), 2u);
    EXPECT_EQ((*got)[0].heads, (IndexRange{0, 1}));
    EXPECT_EQ((*got)[1].heads, (IndexRange{1, 2}));
    EXPECT_EQ((*got)[0].blocks, (std::vector<std::vector<int32_t>>{{1, 2}}));
    EXPECT_EQ(x.num_waiting(), 2);  // transfer 8 for d/0 and 7 for d/1 stay
}

TEST_F(KvPeerExchangeTest, DiscardDropsAndRefusesLaterPosts) {
    KvPeerExchange x;
    ASSERT_TRUE(x.Post("local:d/0", Source(3, 0, 2)).ok());
    x.Discard("local:d/0", 3);
    EXPECT_EQ(x.num_waiting(), 0);
    EXPECT_EQ(x.Post("local:d/0", Source(3, 0, 2)).code(), StatusCode::kAborted);
    EXPECT_TRUE(x.Post("local:d/1", Source(3, 0, 2)).ok());  // another endpoint's transfer 3
}

TEST_F(KvPeerExchangeTest, BoundsTheSourcesWaitingPerEndpoint) {
    KvPeerExchange x({.max_sources = 2, .stale_after_ms = 120'000});
    EXPECT_TRUE(x.Post("local:d/0", Source(1, 0, 2)).ok());
    EXPECT_TRUE(x.Post("local:d/0", Source(2, 0, 2)).ok());
    EXPECT_EQ(x.Post("local:d/0", Source(3, 0, 2)).code(), StatusCode::kResourceExhausted);
    EXPECT_TRUE(x.Post("local:d/1", Source(3, 0, 2)).ok());
    EXPECT_EQ(x.Post("local:d/0", KvPeerSource{}).code(), StatusCode::kInvalidArgument);
}

TEST_F(KvPeerExchangeTest, StaleSourcesAreDropped) {
    KvPeerExchange x({.max_sources = 16, .stale_after_ms = 1});
    ASSERT_TRUE(x.Post("local:d/0", Source(1, 0, 2)).ok());
    std::this_thread::sleep_for(milliseconds(5));
    ASSERT_TRUE(x.Post("local:d/0", Source(2, 0, 2)).ok());  // drops transfer 1 first
    EXPECT_EQ(x.num_waiting(), 1);
}

TEST_F(KvPeerExchangeTest, ASourceWhoseRankWentAwayIsMarkedDead) {
    KvPeerExchange x;
    ASSERT_TRUE(x.Post("local:d/0", Source(5, 0, 2)).ok());
    registration_.reset();
    Result<std::vector<KvPeerSource>> got = x.Take("local:d/0", 5, 4, Clock::now());
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(got->size(), 1u);
    std::lock_guard<std::mutex> lock((*got)[0].rank->mu);
    EXPECT_FALSE((*got)[0].rank->alive);
}

}  // namespace
}  // namespace kvshard
