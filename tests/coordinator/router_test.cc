// The router places requests from what each instance's engine published (its snapshot), never
// from the instance's block manager: here the engines are not started and the test steps them
// itself (PlanStep, a fake executor, CompleteStep) on a VirtualClock, so every routing decision
// is made between two publishes and nothing sleeps.
//   - a prompt goes to the instance whose published prefix cache holds its prefix;
//   - a snapshot once read never changes while the engine goes on;
//   - an eviction on one instance is seen by the router after the step that made it;
//   - a request with cache breakpoints goes to the instance that pins its prefix, even when busier,
//     until the pin lapses on the engine's clock (seen after that instance's next PlanStep);
//   - instances on different clocks are refused;
//   - time to first token is measured from the front end's arrival time, on the engine's clock,
//     by the front end's sink and the engine's observer alike.
#include "coordinator/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "coordinator/engine.h"
#include "coordinator/metrics.h"
#include "coordinator/stream_sink.h"
#include "model/bpe_tokenizer.h"
#include "model/tokenizer.h"

namespace kvshard {
namespace {

constexpr int64_t kBlockSize = 4;
constexpr int32_t kSampled = 'a';

// One token for every sequence that samples, as the workers would return it.
class FakeExecutor final : public StepExecutor {
  public:
    Result<StepResult> Execute(const StepPlan& plan) override {
        StepResult r;
        r.step_id = plan.step_id;
        for (const ScheduledSequence& s : plan.sequences) {
            if (!s.sample) continue;
            SampledToken token;
            token.seq_id = s.seq_id;
            token.token_id = kSampled;
            r.tokens.push_back(token);
        }
        if (fail_transfers) fail_transfers(plan, &r);
        return r;
    }
    // Adds failed transfers to a step's result (the KV pair path's tests).
    std::function<void(const StepPlan&, StepResult*)> fail_transfers;
};

// What the engines tell the KV pair path's health (serve's KvPairPlan), in order.
class PairHealthLog final : public KvPairHealth {
  public:
    void OnPairsDown(const std::string& prefill, const std::string& decode, uint64_t first,
                     const Status& why) override {
        events.push_back("down " + prefill + "->" + decode + " from " + std::to_string(first) +
                         ": " + why.message());
    }
    void OnPairsTransferred(const std::string& prefill, const std::string& decode) override {
        events.push_back("through " + prefill + "->" + decode);
    }
    std::vector<std::string> events;
};

class NullSink final : public RequestSink {
  public:
    void OnDelta(const GenerationDelta&) override {}
    void OnFinish(const GenerationUsage&, const Status& status) override {
        finished = true;
        ok = status.ok();
    }
    bool finished = false;
    bool ok = false;
};

std::unique_ptr<Tokenizer> ByteTokenizer() {
    TokenizerData d;
    d.kind = TokenizerKind::kByteLevelBpe;
    for (const std::string& s : ByteLevelEncodeTable()) d.tokens.push_back(s);
    for (int i = 256; i < 1024; ++i) d.tokens.push_back("t" + std::to_string(i));
    d.types.assign(d.tokens.size(), TokenType::kNormal);
    d.source = "router test vocabulary";
    Result<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(std::move(d));
    KV_CHECK(t.ok()) << t.status().ToString();
    return std::move(*t);
}

class RouterTest : public ::testing::Test {
  protected:
    RouterTest() : tokenizer_(ByteTokenizer()) {}

    InstanceEngine* Add(const std::string& name, int64_t num_blocks = 32,
                        EngineObserver* observer = nullptr, const Clock* clock = nullptr,
                        PoolRole role = PoolRole::kMixed) {
        InstanceEngineConfig c;
        c.role = role;
        c.handoff.path = handoff_path_;
        c.pair_health = pair_health_;
        if (role == PoolRole::kDecode) c.kv_endpoints = {"127.0.0.1:1"};  // never reached here
        c.observer = observer;
        c.name = name;
        c.scheduler.max_num_seqs = 8;
        c.scheduler.max_num_batched_tokens = 256;
        c.blocks.num_blocks = num_blocks;
        c.blocks.block_size = kBlockSize;
        c.blocks.watermark = 0.0;
        c.blocks.min_pinned_tokens = 8;
        c.max_context = std::min<int64_t>(64, num_blocks * kBlockSize);
        c.clock = clock != nullptr ? clock : &clock_;
        engines_.push_back(std::make_unique<InstanceEngine>(c, *tokenizer_, executor_));
        return engines_.back().get();
    }

    std::unique_ptr<Router> MakeRouter(const RouterConfig& config = {}) {
        std::vector<InstanceEngine*> all;
        for (auto& e : engines_) all.push_back(e.get());
        Result<std::unique_ptr<Router>> r = Router::Create(all, config);
        KV_CHECK(r.ok()) << r.status().ToString();
        return std::move(*r);
    }

    GenerationRequest Request(std::vector<int32_t> prompt, int64_t pin_tokens = 0) {
        GenerationRequest r;
        r.request_id = "req-" + std::to_string(++counter_);
        r.prompt_token_ids = std::move(prompt);
        r.max_tokens = 1;
        r.ignore_eos = true;
        if (pin_tokens > 0) r.cache_breakpoints.push_back({pin_tokens, /*ttl_ms=*/10'000});
        return r;
    }

    // Submits through `router` and returns the instance that took the request (its load grew).
    InstanceEngine* Route(Router& router, GenerationRequest request) {
        std::vector<int64_t> before;
        for (auto& e : engines_) before.push_back(e->NumRequests());
        auto sink = std::make_shared<NullSink>();
        sinks_.push_back(sink);
        const Status st = router.Submit(std::move(request), sink);
        KV_CHECK(st.ok()) << st.ToString();
        for (size_t i = 0; i < engines_.size(); ++i) {
            if (engines_[i]->NumRequests() > before[i]) return engines_[i].get();
        }
        return nullptr;
    }

    // One step of `e` on the fake executor; false when it had none to run.
    bool Step(InstanceEngine* e) {
        std::optional<StepPlan> plan = e->PlanStep();
        if (!plan) return false;
        e->CompleteStep(*plan, executor_.Execute(*plan));
        return true;
    }
    void Drain(InstanceEngine* e) {
        for (int guard = 0; guard < 1000 && e->HasWork(); ++guard) Step(e);
        ASSERT_FALSE(e->HasWork());
    }

    // `n` tokens starting at `first`.
    static std::vector<int32_t> Tokens(int32_t first, int n) {
        std::vector<int32_t> t;
        for (int i = 0; i < n; ++i) t.push_back(first + i);
        return t;
    }
    static std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
        a.insert(a.end(), b.begin(), b.end());
        return a;
    }

    VirtualClock clock_;
    std::unique_ptr<Tokenizer> tokenizer_;
    FakeExecutor executor_;
    std::optional<KvHandoffPath> handoff_path_;  // of the engines Add makes from then on
    KvPairHealth* pair_health_ = nullptr;        // "
    std::vector<std::unique_ptr<InstanceEngine>> engines_;
    std::vector<std::shared_ptr<NullSink>> sinks_;
    int counter_ = 0;
};

// The KV pair path's fence (cli/kv_pair_replan.h): while WithTransferNumberingPaused runs, a
// handoff submitted from another thread waits for its transfer id, and then gets the id the
// fence was given.
TEST_F(RouterTest, PausedTransferNumberingHoldsHandoffsUntilTheFenceReturns) {
    Add("prefill", 32, nullptr, nullptr, PoolRole::kPrefill);
    Add("decode", 32, nullptr, nullptr, PoolRole::kDecode);
    std::unique_ptr<Router> router = MakeRouter();
    uint64_t fence = 0;
    std::atomic<bool> submitted{false};
    std::thread submitter;
    router->WithTransferNumberingPaused([&](uint64_t next) {
        fence = next;
        submitter = std::thread([&] {
            Route(*router, Request({1, 2, 3, 4, 5}));
            submitted = true;
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        EXPECT_FALSE(submitted.load()) << "a handoff was numbered inside the fence";
        EXPECT_EQ(router->next_transfer_id(), next);
    });
    submitter.join();
    EXPECT_TRUE(submitted.load());
    EXPECT_EQ(router->next_transfer_id(), fence + 1);
}

// The KV pair path: a failed transfer whose worker says the pairs are down reaches the pair
// health from either side (the decode instance's receive, the prefill instance's offer), with
// the pairs' first transfer; a failure that leaves them up, and nothing else, does not; a
// transfer through the pairs is told too. Every request still ends.
TEST_F(RouterTest, PairFailuresAndTransfersReachThePairHealth) {
    PairHealthLog health;
    handoff_path_ = KvHandoffPath::kNccl;
    pair_health_ = &health;
    InstanceEngine* prefill = Add("p", 32, nullptr, nullptr, PoolRole::kPrefill);
    InstanceEngine* decode = Add("d", 32, nullptr, nullptr, PoolRole::kDecode);
    std::unique_ptr<Router> router = MakeRouter();
    // (A TransferFailure member in the table draws GCC 12's -Wmaybe-uninitialized false
    // positive on its string: the failure is made from plain fields.)
    struct Case {
        const char* name;
        bool on_receive;  // else on the prefill instance's send
        StatusCode code;  // kOk: nothing fails
        const char* message;
        bool pairs_down;
        uint64_t pairs_first_transfer;
        std::vector<std::string> events;
    };
    const Case cases[] = {
        {"through", true, StatusCode::kOk, "", false, 0, {"through p->d"}},
        {"receive, pairs down", true, StatusCode::kDeadlineExceeded, "timed out", true, 0,
         {"down p->d from 0: timed out"}},
        {"offer, pairs down", false, StatusCode::kAborted, "failed earlier", true, 7,
         {"down p->d from 7: failed earlier"}},
        {"receive, pairs up", true, StatusCode::kUnavailable, "being joined", false, 0, {}},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.name);
        health.events.clear();
        executor_.fail_transfers = [&](const StepPlan& plan, StepResult* r) {
            if (c.code == StatusCode::kOk) return;
            std::vector<uint64_t> ids;
            if (c.on_receive) {
                for (const KvRecvOp& op : plan.kv_recvs) ids.push_back(op.transfer_id);
            } else {
                for (const KvSendOp& op : plan.kv_sends) ids.push_back(op.transfer_id);
            }
            for (uint64_t id : ids) {
                r->failed_transfers.push_back(
                    {id, c.code, c.message, c.pairs_down, c.pairs_first_transfer});
            }
        };
        GenerationRequest request = Request(Tokens(300, 9));
        request.max_tokens = 4;
        ASSERT_EQ(Route(*router, std::move(request)), prefill);
        for (int guard = 0; guard < 100 && (prefill->HasWork() || decode->HasWork()); ++guard) {
            Step(prefill);
            Step(decode);
        }
        EXPECT_TRUE(sinks_.back()->finished);
        EXPECT_TRUE(sinks_.back()->ok);
        EXPECT_EQ(health.events, c.events);
    }
}

TEST_F(RouterTest, PlacesByThePublishedPrefixCache) {
    InstanceEngine* a = Add("a");
    InstanceEngine* b = Add("b");
    std::unique_ptr<Router> router = MakeRouter();
    const std::vector<int32_t> system = Tokens(300, 16);  // 4 full blocks

    ASSERT_TRUE(
        b->Submit(Request(Concat(system, Tokens(700, 3))), std::make_shared<NullSink>()).ok());
    const std::shared_ptr<const EngineSnapshot> before = b->snapshot();
    EXPECT_EQ(before->prefix.CachedPrefixTokens(Concat(system, {1})), 0);
    // b has a request queued (its load, counted on arrival) and nothing cached: a.
    EXPECT_EQ(Route(*router, Request(Concat(Tokens(500, 16), {1}))), a);
    Drain(a);
    Drain(b);
    EXPECT_EQ(b->snapshot()->prefix.CachedPrefixTokens(Concat(system, {1})), 16);
    EXPECT_EQ(before->prefix.CachedPrefixTokens(Concat(system, {1})), 0)
        << "a snapshot never changes";
    EXPECT_GT(b->snapshot()->version, before->version);
    // Equal loads: each prompt goes where its prefix is cached.
    EXPECT_EQ(Route(*router, Request(Concat(system, Tokens(800, 3)))), b);
    EXPECT_EQ(Route(*router, Request(Concat(Tokens(500, 16), {2}))), a);
    Drain(a);
    Drain(b);
    for (auto& s : sinks_) EXPECT_TRUE(s->finished && s->ok);
}

TEST_F(RouterTest, SeesAnEvictionAfterTheStepThatMadeIt) {
    // 8 blocks of 4: a 17-token prompt takes 5, so a second one evicts the first's cached blocks.
    InstanceEngine* a = Add("a", /*num_blocks=*/8);
    InstanceEngine* b = Add("b", /*num_blocks=*/8);
    std::unique_ptr<Router> router = MakeRouter();
    const std::vector<int32_t> system = Tokens(300, 16);
    ASSERT_TRUE(b->Submit(Request(Concat(system, {1})), std::make_shared<NullSink>()).ok());
    Drain(b);
    EXPECT_EQ(Route(*router, Request(Concat(system, {2}))), b);
    Drain(b);
    // b computes other prompts: the system prompt's blocks are evicted.
    for (int32_t k = 0; k < 3; ++k) {
        ASSERT_TRUE(
            b->Submit(Request(Tokens(400 + 40 * k, 17)), std::make_shared<NullSink>()).ok());
        Drain(b);
    }
    EXPECT_GT(b->BlockStats().num_evictions, 0);
    EXPECT_EQ(b->snapshot()->prefix.CachedPrefixTokens(Concat(system, {3})), 0);
    EXPECT_EQ(Route(*router, Request(Concat(system, {3}))), a);
    Drain(a);
}

TEST_F(RouterTest, FollowsPinsUntilTheyLapseOnTheEngineClock) {
    InstanceEngine* a = Add("a");
    InstanceEngine* b = Add("b");
    RouterConfig rc;
    rc.prefix_load_slack = 0;  // without pins, the least loaded instance
    std::unique_ptr<Router> router = MakeRouter(rc);
    const std::vector<int32_t> system = Tokens(300, 16);

    EXPECT_EQ(Route(*router, Request(Concat(system, {1}), /*pin_tokens=*/16)), a);
    Drain(a);
    ASSERT_EQ(a->snapshot()->prefix.PinnedPrefixTokens(Concat(system, {2})), 16);
    // a is busier (two queued requests) but holds the pin.
    ASSERT_TRUE(a->Submit(Request(Tokens(500, 5)), std::make_shared<NullSink>()).ok());
    ASSERT_TRUE(a->Submit(Request(Tokens(600, 5)), std::make_shared<NullSink>()).ok());
    EXPECT_EQ(Route(*router, Request(Concat(system, {2}), 16)), a);
    Drain(a);  // the read refreshed the pin at the time of that step

    // Past the TTL the pin lapses when a next plans (its block manager's time is set then); the
    // router sees it after that PlanStep, not before.
    clock_.AdvanceSeconds(11);
    ASSERT_TRUE(a->Submit(Request(Tokens(700, 5)), std::make_shared<NullSink>()).ok());
    EXPECT_EQ(a->snapshot()->prefix.PinnedPrefixTokens(Concat(system, {3})), 16);
    ASSERT_TRUE(Step(a));
    EXPECT_EQ(a->snapshot()->prefix.PinnedPrefixTokens(Concat(system, {4})), 0);
    EXPECT_EQ(a->snapshot()->prefix.CachedPrefixTokens(Concat(system, {4})), 16)
        << "a lapsed pin leaves its blocks cached";
    // No pin anywhere: the least loaded instance (a has two queued), though a caches the prefix.
    ASSERT_TRUE(a->Submit(Request(Tokens(500, 5)), std::make_shared<NullSink>()).ok());
    ASSERT_TRUE(a->Submit(Request(Tokens(600, 5)), std::make_shared<NullSink>()).ok());
    EXPECT_EQ(Route(*router, Request(Concat(system, {4}), 16)), b);
    Drain(a);
    Drain(b);
    for (auto& s : sinks_) EXPECT_TRUE(s->finished && s->ok);
}

TEST_F(RouterTest, RefusesInstancesOnDifferentClocks) {
    VirtualClock other;
    Add("a");
    Add("b", 32, nullptr, &other);
    std::vector<InstanceEngine*> all = {engines_[0].get(), engines_[1].get()};
    Result<std::unique_ptr<Router>> r = Router::Create(all);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("instance b reads another clock than a"), std::string::npos)
        << r.status().ToString();
}

// The value of one sample of `metrics`' exposition, -1 when absent.
double Sample(ServerMetrics& metrics, const std::string& name) {
    std::istringstream lines(metrics.Render(EngineStats{}));
    for (std::string line; std::getline(lines, line);) {
        if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
    }
    return -1;
}

TEST_F(RouterTest, LatenciesAreMeasuredFromTheFrontEndsArrival) {
    auto metrics = std::make_shared<ServerMetrics>("m");
    InstanceEngine* e = Add("a", 32, metrics.get());
    // The front end read the request at 10 s and submitted it at 11 s (tokenizing, say); the
    // first token is sampled at 11.5 s.
    clock_.AdvanceSeconds(10);
    GenerationRequest request = Request(Tokens(300, 9));
    request.arrival = e->clock().Now();
    auto sink = std::make_shared<StreamSink>([] {});
    clock_.AdvanceSeconds(1);
    ASSERT_TRUE(e->Submit(std::move(request), sink).ok());
    clock_.AdvanceSeconds(0.5);
    Drain(e);
    const std::string model = "{model_name=\"m\"}";
    const std::string pool = "{model_name=\"m\",pool=\"default\"}";
    EXPECT_DOUBLE_EQ(Sample(*metrics, "kvshard:time_to_first_token_seconds_sum" + model), 1.5);
    EXPECT_DOUBLE_EQ(Sample(*metrics, "kvshard:pool_time_to_first_token_seconds_sum" + pool), 1.5);
    EXPECT_DOUBLE_EQ(Sample(*metrics, "kvshard:e2e_request_latency_seconds_sum" + model), 1.5);
}

}  // namespace
}  // namespace kvshard
