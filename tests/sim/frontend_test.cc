// The serving front end's latency (SimulationOptions::frontend_s): every served request's TTFT and
// E2E grow by exactly it, its inter-token gaps and the engine's schedule do not move, a refused
// request is not charged, and a negative value is refused by name.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "sim/cluster/simulator.h"
#include "tests/sim/sim_test_util.h"

namespace kvshard::sim {
namespace {

// Staggered arrivals and more requests than the batch holds, so that queueing, chunked prefill
// and batched decodes are all in the schedule the front end must not move.
std::vector<SimRequest> Requests() {
    std::vector<SimRequest> r;
    for (int i = 0; i < 8; ++i) r.push_back(SimRequest{0.01 * i, 300 + 50 * i, 12, -1, 0});
    return r;
}

TEST(SimulatorFrontendTest, AddsToTtftAndE2eButNotToItl) {
    SimulationOptions base = OneH200Instance(512);
    SimulationOptions with = OneH200Instance(512);
    with.frontend_s = 0.035;
    Result<SimulationResult> a = Simulate(base, Requests());
    Result<SimulationResult> b = Simulate(with, Requests());
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    ASSERT_EQ(a->run.outcomes.size(), 8u);
    ASSERT_EQ(b->run.outcomes.size(), 8u);
    for (size_t i = 0; i < a->run.outcomes.size(); ++i) {
        const loadgen::RequestOutcome& x = a->run.outcomes[i];
        const loadgen::RequestOutcome& y = b->run.outcomes[i];
        ASSERT_TRUE(x.ok && y.ok) << i;
        EXPECT_GT(x.ttft_s, 0);
        EXPECT_NEAR(y.ttft_s - x.ttft_s, 0.035, 1e-9) << i;
        EXPECT_NEAR(y.e2e_s - x.e2e_s, 0.035, 1e-9) << i;
        EXPECT_DOUBLE_EQ(y.start_s, x.start_s);
        ASSERT_EQ(y.itl_s.size(), x.itl_s.size());
        for (size_t j = 0; j < x.itl_s.size(); ++j) EXPECT_DOUBLE_EQ(y.itl_s[j], x.itl_s[j]);
    }
    EXPECT_EQ(b->num_steps, a->num_steps);
    EXPECT_DOUBLE_EQ(b->simulated_seconds, a->simulated_seconds);
}

TEST(SimulatorFrontendTest, ARefusedRequestIsNotCharged) {
    SimulationOptions o = OneH200Instance(512);
    o.max_waiting_requests = 0;
    o.frontend_s = 0.05;
    const std::vector<SimRequest> burst(6, SimRequest{0.0, 100, 4, -1, 0});
    Result<SimulationResult> r = Simulate(o, burst);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->num_refused, 2);
    for (const loadgen::RequestOutcome& oc : r->run.outcomes) {
        if (oc.ok) {
            EXPECT_GT(oc.ttft_s, 0.05);
        } else {
            EXPECT_EQ(oc.ttft_s, 0);
            EXPECT_EQ(oc.output_tokens, 0);
        }
    }
}

TEST(SimulatorFrontendTest, ANegativeValueIsRefusedByName) {
    SimulationOptions o = OneH200Instance(512);
    o.frontend_s = -0.001;
    Result<SimulationResult> r = Simulate(o, Requests());
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("frontend_s"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace kvshard::sim
