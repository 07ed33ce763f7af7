// The serving policies the simulator runs through the engine's own code (sim/cluster/simulator.h):
// the waiting-queue cap refuses requests (they are counted, never served), the request timeout
// aborts what still runs, and prompt-cache pins keep a marked prefix through traffic that evicts
// everything else, until their TTL.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "loadgen/bench_report.h"
#include "sim/cluster/simulator.h"
#include "tests/sim/sim_test_util.h"

namespace kvshard::sim {
namespace {

SimulationResult RunSim(const SimulationOptions& o, const std::vector<SimRequest>& requests) {
    Result<SimulationResult> r = Simulate(o, requests);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : SimulationResult{};
}

// 20 requests at once on an instance that runs 4 and queues 2 more: 14 are refused at arrival.
TEST(SimulatorPoliciesTest, AFullQueueRefusesRequestsInsteadOfServingThem) {
    std::vector<SimRequest> requests(20, SimRequest{0.0, 200, 16, -1, 0});
    SimulationOptions o = OneH200Instance(8192);
    o.scheduler.max_waiting_requests = 2;
    const SimulationResult capped = RunSim(o, requests);
    EXPECT_EQ(capped.num_refused, 14);
    int served = 0;
    for (const loadgen::RequestOutcome& oc : capped.run.outcomes) {
        if (oc.ok) {
            ++served;
            EXPECT_EQ(oc.output_tokens, 16);
        } else {
            EXPECT_NE(oc.error.find("429"), std::string::npos) << oc.error;
            EXPECT_EQ(oc.output_tokens, 0);
        }
    }
    EXPECT_EQ(served, 6);
    const loadgen::BenchReport report = loadgen::MakeReport(capped.run, {});
    EXPECT_EQ(report.completed, 6);
    EXPECT_EQ(report.failed, 14);

    // The default queues everything: the same traffic is all served.
    const SimulationResult open = RunSim(OneH200Instance(8192), requests);
    EXPECT_EQ(open.num_refused, 0);
    EXPECT_EQ(loadgen::MakeReport(open.run, {}).completed, 20);
}

// 40 requests at once, 4 at a time, ~2.5 s each: with a 3 s timeout the first 4 finish and the
// other 36 are aborted at 3 s (the second batch mid-decode, the rest while waiting).
TEST(SimulatorPoliciesTest, RequestsStillRunningAtTheTimeoutAreAborted) {
    const std::vector<SimRequest> requests(40, SimRequest{0.0, 200, 400, -1, 0});
    SimulationOptions o = OneH200Instance(8192);
    o.request_timeout_s = 3.0;
    const SimulationResult r = RunSim(o, requests);
    const loadgen::BenchReport report = loadgen::MakeReport(r.run, {});
    EXPECT_EQ(r.num_timed_out, report.failed);
    EXPECT_EQ(report.completed + report.failed, 40);
    EXPECT_GE(report.completed, 4);
    EXPECT_GE(r.num_timed_out, 32);
    for (const loadgen::RequestOutcome& oc : r.run.outcomes) {
        if (oc.ok) {
            EXPECT_EQ(oc.output_tokens, 400);
            EXPECT_LT(oc.e2e_s, 3.0);
        } else {
            EXPECT_NE(oc.error.find("504"), std::string::npos) << oc.error;
            EXPECT_LT(oc.output_tokens, 400);
            EXPECT_GE(oc.e2e_s, 3.0);
            EXPECT_LT(oc.e2e_s, 3.1);  // aborted at the next step, not at the end of its output
        }
    }
    // The aborts freed the KV: the run ends soon after the timeout, not when 40 would be done.
    EXPECT_LT(r.simulated_seconds, 3.1);

    // A timeout no request reaches changes nothing, not even the end of the run.
    o.request_timeout_s = 600;
    const SimulationResult quick =
        RunSim(o, std::vector<SimRequest>(8, SimRequest{0.0, 200, 40, -1, 0}));
    const SimulationResult none =
        RunSim(OneH200Instance(8192), std::vector<SimRequest>(8, SimRequest{0.0, 200, 40, -1, 0}));
    EXPECT_EQ(quick.num_timed_out, 0);
    EXPECT_DOUBLE_EQ(quick.simulated_seconds, none.simulated_seconds);
}

TEST(SimulatorPoliciesTest, OutOfRangeSettingsAreRefusedByName) {
    const std::vector<SimRequest> one{SimRequest{0.0, 10, 2, -1, 0}};
    SimulationOptions o = OneH200Instance(8192);
    o.cache_ttl_ms = int64_t{25} * 3600 * 1000;  // beyond the engine's 24 h
    Result<SimulationResult> r = Simulate(o, one);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("ttl_ms"), std::string::npos) << r.status().message();
    o = OneH200Instance(8192);
    o.blocks.max_pinned_fraction = 1.5;
    r = Simulate(o, one);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("max_pinned_fraction"), std::string::npos)
        << r.status().message();
    o = OneH200Instance(8192);
    o.scheduler.max_waiting_requests = -1;
    r = Simulate(o, one);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("max_waiting_requests"), std::string::npos);
    o = OneH200Instance(8192);
    o.request_timeout_s = -1;
    r = Simulate(o, one);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("request_timeout_s"), std::string::npos);
}

// A request of group 0 with a 2,048-token shared prefix at t = 0, then 20 unrelated 1,000-token
// prompts (1,260 blocks through a 400-block pool, so the LRU cache keeps none of the first),
// then a second request of group 0 at t = 20 s.
std::vector<SimRequest> PrefixThenFlood() {
    std::vector<SimRequest> r;
    r.push_back({0.0, 2080, 4, 0, 2048});
    for (int i = 0; i < 20; ++i) r.push_back({1.0 + 0.5 * i, 1000, 8, -1, 0});
    r.push_back({20.0, 2080, 4, 0, 2048});
    return r;
}

SimulationOptions SmallPool(int64_t cache_ttl_ms) {
    SimulationOptions o = OneH200Instance(8192);
    o.blocks.num_blocks = 400;  // 16-token blocks; pins may hold 200
    o.cache_ttl_ms = cache_ttl_ms;
    return o;
}

TEST(SimulatorPoliciesTest, APinnedPrefixOutlivesTrafficThatEvictsTheLruCache) {
    const SimulationResult pinned = RunSim(SmallPool(600'000), PrefixThenFlood());
    const auto& first = pinned.run.outcomes.front();
    const auto& again = pinned.run.outcomes.back();
    ASSERT_TRUE(first.ok && again.ok);
    EXPECT_EQ(first.cache_creation_tokens, 2048);
    EXPECT_EQ(again.cached_tokens, 2048);
    EXPECT_EQ(pinned.pin_hits, 1);
    EXPECT_EQ(pinned.pins_expired, 0);
    EXPECT_EQ(pinned.pinned_blocks_max, 128);

    // Without a breakpoint the flood evicts the prefix: the second request computes it again.
    const SimulationResult lru = RunSim(SmallPool(0), PrefixThenFlood());
    EXPECT_EQ(lru.run.outcomes.front().cache_creation_tokens, 0);
    EXPECT_EQ(lru.run.outcomes.back().cached_tokens, 0);
    EXPECT_EQ(lru.pinned_blocks_max, 0);
    // And the cost shows: the pinned run's second request reaches its first token sooner.
    EXPECT_LT(again.ttft_s, lru.run.outcomes.back().ttft_s);
}

TEST(SimulatorPoliciesTest, APinLapsesAtItsTtlOnTheVirtualClock) {
    // 5 s: the pin lapses during the flood (which runs to t = 10.5 s), and its blocks are evicted.
    const SimulationResult r = RunSim(SmallPool(5'000), PrefixThenFlood());
    EXPECT_EQ(r.run.outcomes.front().cache_creation_tokens, 2048);
    EXPECT_EQ(r.pins_expired, 1);
    EXPECT_EQ(r.pin_hits, 0);
    EXPECT_EQ(r.run.outcomes.back().cached_tokens, 0);
}

TEST(SimulatorPoliciesTest, PinsBeyondTheirShareAreRefused) {
    // A pool of 400 blocks with a 10% share (40 blocks) cannot pin a 128-block prefix.
    SimulationOptions o = SmallPool(600'000);
    o.blocks.max_pinned_fraction = 0.1;
    const SimulationResult r = RunSim(o, PrefixThenFlood());
    EXPECT_EQ(r.run.outcomes.front().cache_creation_tokens, 0);
    EXPECT_GE(r.pins_refused, 1);
    EXPECT_EQ(r.pinned_blocks_max, 0);
    EXPECT_EQ(r.run.outcomes.back().cached_tokens, 0);
}

}  // namespace
}  // namespace kvshard::sim
