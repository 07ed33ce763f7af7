// The serving front end's latency (SimulationOptions::frontend_s): every served request's TTFT and
// E2E grow by exactly it (its per-prompt-token part by each request's own prompt), its
// inter-token gaps and the engine's schedule do not move, a refused request is not charged, and a
// negative value is refused by name.
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

TEST(SimulatorFrontendTest, APerPromptTokenPartGrowsWithEachRequestsPrompt) {
    SimulationOptions base = OneH200Instance(512);
    SimulationOptions with = OneH200Instance(512);
    with.frontend_s = 0.010;
    with.frontend_per_prompt_token_s = 2e-5;
    Result<SimulationResult> a = Simulate(base, Requests());
    Result<SimulationResult> b = Simulate(with, Requests());
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    const std::vector<SimRequest> requests = Requests();
    for (size_t i = 0; i < requests.size(); ++i) {
        const double want = 0.010 + 2e-5 * static_cast<double>(requests[i].prompt_len);
        EXPECT_NEAR(b->run.outcomes[i].ttft_s - a->run.outcomes[i].ttft_s, want, 1e-9) << i;
        EXPECT_NEAR(b->run.outcomes[i].e2e_s - a->run.outcomes[i].e2e_s, want, 1e-9) << i;
    }
    EXPECT_DOUBLE_EQ(b->simulated_seconds, a->simulated_seconds);
    with.frontend_per_prompt_token_s = -1e-6;
    Result<SimulationResult> bad = Simulate(with, Requests());
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("frontend_per_prompt_token_s"), std::string::npos)
        << bad.status().message();
}

TEST(SimulatorFrontendTest, AProfilesArrivalCostLengthensTheStepInFlight) {
    // One sequence at a time, every step 10 ms: request 0 runs 20 steps (0 to 0.2 s) while the
    // three others arrive in the middle of its steps and wait. Each arrival lengthens the step in
    // flight by f, so request 0 ends 3 f later; f = 0 changes nothing.
    SimulationOptions o = OneH200Instance(512);
    o.device = *FindAccelerator("cpu");
    o.blocks.num_blocks = 256;
    o.scheduler.max_num_seqs = 1;
    o.profile = CpuProfile{.a = 0.010};
    const std::vector<SimRequest> requests = {
        {0.0, 10, 20, -1, 0}, {0.055, 10, 2, -1, 0}, {0.085, 10, 2, -1, 0}, {0.115, 10, 2, -1, 0}};
    Result<SimulationResult> base = Simulate(o, requests);
    o.profile->f = 0.004;
    Result<SimulationResult> with = Simulate(o, requests);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    ASSERT_TRUE(with.ok()) << with.status().ToString();
    EXPECT_NEAR(base->run.outcomes[0].e2e_s, 0.20, 1e-9);  // a prefill step and 19 decodes
    EXPECT_NEAR(with->run.outcomes[0].e2e_s - base->run.outcomes[0].e2e_s, 3 * 0.004, 1e-9);
    EXPECT_EQ(with->num_steps, base->num_steps);
    // The arrivals themselves do not move: each waiting request's TTFT counts from it.
    for (size_t i = 1; i < requests.size(); ++i)
        EXPECT_DOUBLE_EQ(with->run.outcomes[i].start_s, base->run.outcomes[i].start_s) << i;
}

TEST(SimulatorFrontendTest, ARefusedRequestIsNotCharged) {
    SimulationOptions o = OneH200Instance(512);
    o.scheduler.max_waiting_requests = 0;
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
