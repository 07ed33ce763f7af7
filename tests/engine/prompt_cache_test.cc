// Prompt caching with pins, end to end through the engine with the real CPU workers (the default
// model, tp 1 and tp 2, colocated and disaggregated), on a VirtualClock: the engines are stepped
// by the test (no engine thread, no sleeping), so TTLs pass exactly when the test says.
//   - usage adds up: uncached input + cache_creation_tokens + cached_tokens = prompt tokens, on
//     cold, warm and partly warm requests;
//   - a pinned system prompt survives an eviction storm that takes it without a pin, and lapses
//     after its TTL, which a read refreshes;
//   - the pinned share stays within kv_cache.max_pinned_fraction and admission still progresses;
//   - the router sends a request to the instance that holds its pins;
//   - no KV block leaks (every block free, cached or pinned when idle).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "coordinator/engine.h"
#include "coordinator/router.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "tests/engine/collecting_sink.h"
#include "tests/test_util.h"
#include "worker/tp_group.h"

namespace kvshard {
namespace {

constexpr int64_t kBlockSize = 16;
constexpr int64_t kTtlMs = 300'000;

struct Instance {
    std::unique_ptr<TpGroup> group;
    std::unique_ptr<InstanceEngine> engine;
};

struct InstanceOptions {
    PoolRole role = PoolRole::kMixed;
    int tp = 1;
    int64_t num_blocks = 64;
    double max_pinned_fraction = 0.5;
    std::string name = "mixed";
};

class PromptCache : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string path = testing::DefaultModel();
        KV_REQUIRE_FIXTURE(path, "the default model");
        Result<std::unique_ptr<ModelFile>> m = OpenModel(path);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        file_ = std::move(*m);
        Result<std::unique_ptr<Tokenizer>> t = Tokenizer::Create(file_->tokenizer_data());
        ASSERT_TRUE(t.ok());
        tokenizer_ = std::move(*t);
    }

    Instance Make(const InstanceOptions& o) {
        TpGroupConfig tc;
        tc.tp = o.tp;
        tc.threads_per_rank = 1;
        tc.runner.max_context = 512;
        tc.runner.block_size = kBlockSize;
        tc.runner.num_kv_blocks = o.num_blocks;
        tc.kv_transport_name = o.name + "-" + std::to_string(++counter_);
        Result<std::unique_ptr<TpGroup>> g = TpGroup::Create(*file_, tc);
        EXPECT_TRUE(g.ok()) << g.status().ToString();
        Instance out;
        out.group = std::move(*g);
        InstanceEngineConfig c;
        c.name = o.name;
        c.pool = std::string(PoolRoleName(o.role));
        c.role = o.role;
        c.tp = o.tp;
        c.kv_endpoints = out.group->kv_endpoints();
        c.scheduler.max_num_seqs = 16;
        c.scheduler.max_num_batched_tokens = 512;
        c.blocks.num_blocks = o.num_blocks;
        c.blocks.block_size = kBlockSize;
        c.blocks.max_pinned_fraction = o.max_pinned_fraction;
        c.blocks.min_pinned_tokens = 32;
        c.max_context = 512;
        c.clock = &clock_;
        out.engine = std::make_unique<InstanceEngine>(c, *tokenizer_, *out.group);
        return out;
    }

    // `n` token ids of the vocabulary, different for each `seed`.
    std::vector<int32_t> Tokens(int64_t n, int32_t seed) const {
        std::vector<int32_t> t;
        for (int64_t i = 0; i < n; ++i) {
            t.push_back(static_cast<int32_t>(1000 + (seed * 7919 + i * 31) % 20000));
        }
        return t;
    }
    static std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
        a.insert(a.end(), b.begin(), b.end());
        return a;
    }

    GenerationRequest Request(std::vector<int32_t> prompt, std::vector<int64_t> breakpoints = {}) {
        GenerationRequest r;
        r.request_id = "req-" + std::to_string(++request_counter_);
        r.prompt_token_ids = std::move(prompt);
        r.max_tokens = 2;
        r.ignore_eos = true;
        for (int64_t b : breakpoints) r.cache_breakpoints.push_back({b, kTtlMs});
        return r;
    }

    // Steps every engine until none has work.
    static void Drive(const std::vector<InstanceEngine*>& engines) {
        for (int guard = 0; guard < 100'000; ++guard) {
            bool any = false;
            for (InstanceEngine* e : engines) {
                if (e->HasWork()) {
                    e->RunStep();
                    any = true;
                }
            }
            if (!any) return;
        }
        FAIL() << "the engines never ran out of work";
    }

    // Submits through `front` and steps `engines` until the request is done; returns its usage.
    GenerationUsage Run(Engine& front, const std::vector<InstanceEngine*>& engines,
                        GenerationRequest request) {
        auto sink = std::make_shared<CollectingSink>(1);
        const Status s = front.Submit(std::move(request), sink);
        EXPECT_TRUE(s.ok()) << s.ToString();
        Drive(engines);
        EXPECT_TRUE(sink->done_);
        EXPECT_TRUE(sink->status_.ok()) << sink->status_.ToString();
        EXPECT_EQ(sink->usage_.completion_tokens, 2);
        return sink->usage_;
    }
    GenerationUsage Run(InstanceEngine& e, GenerationRequest request) {
        return Run(e, {&e}, std::move(request));
    }

    static int64_t Input(const GenerationUsage& u) {
        return u.prompt_tokens - u.cache_creation_tokens - u.cached_tokens;
    }

    // Idle: nothing referenced, every block free, cached or pinned.
    static void ExpectNoLeak(InstanceEngine& e) {
        const kv::BlockManagerStats s = e.BlockStats();
        EXPECT_EQ(s.num_used_blocks, 0) << e.config().name;
        EXPECT_EQ(s.num_sequences, 0) << e.config().name;
        EXPECT_EQ(s.num_free_blocks + s.num_cached_blocks + s.num_pinned_idle_blocks,
                  s.num_blocks)
            << e.config().name;
    }

    // Unrelated prompts that together take every block several times over.
    void Storm(Engine& front, const std::vector<InstanceEngine*>& engines, int count) {
        for (int i = 0; i < count; ++i) Run(front, engines, Request(Tokens(200, 5000 + i)));
    }

    VirtualClock clock_;
    std::unique_ptr<ModelFile> file_;
    std::unique_ptr<Tokenizer> tokenizer_;
    int counter_ = 0;
    int request_counter_ = 0;
};

class PromptCacheTp : public PromptCache, public ::testing::WithParamInterface<int> {};

// Cold: the system prompt is computed and pinned (cache creation). Warm: read from the cache.
// Partly warm: a second breakpoint further on pins the new part; only that part is created.
TEST_P(PromptCacheTp, UsageAddsUpColdWarmAndPartlyWarm) {
    if (!file_) return;
    Instance in = Make({.tp = GetParam()});
    const auto system = Tokens(96, 1);  // 6 blocks
    const auto cold_prompt = Concat(system, Tokens(20, 2));
    const GenerationUsage cold = Run(*in.engine, Request(cold_prompt, {96}));
    EXPECT_EQ(cold.prompt_tokens, 116);
    EXPECT_EQ(cold.cached_tokens, 0);
    EXPECT_EQ(cold.cache_creation_tokens, 96);
    EXPECT_EQ(Input(cold), 20);

    const GenerationUsage warm = Run(*in.engine, Request(Concat(system, Tokens(20, 3)), {96}));
    EXPECT_EQ(warm.cached_tokens, 96);
    EXPECT_EQ(warm.cache_creation_tokens, 0);
    EXPECT_EQ(Input(warm), 20);

    // Breakpoints at the system prompt (read) and after a 40-token conversation: 32 of those
    // tokens fill two more blocks and are written; the rest is ordinary input.
    const auto partly = Concat(Concat(system, Tokens(40, 4)), Tokens(10, 5));
    const GenerationUsage part = Run(*in.engine, Request(partly, {96, 136}));
    EXPECT_EQ(part.prompt_tokens, 146);
    EXPECT_EQ(part.cached_tokens, 96);
    EXPECT_EQ(part.cache_creation_tokens, 32);
    EXPECT_EQ(Input(part), 18);

    // A request without breakpoints creates nothing, whatever it reads.
    const GenerationUsage plain = Run(*in.engine, Request(Concat(system, Tokens(5, 6))));
    EXPECT_EQ(plain.cached_tokens, 96);
    EXPECT_EQ(plain.cache_creation_tokens, 0);
    // A breakpoint under min_pinned_tokens (32) pins nothing.
    const GenerationUsage shorty = Run(*in.engine, Request(Tokens(40, 7), {20}));
    EXPECT_EQ(shorty.cache_creation_tokens, 0);
    EXPECT_EQ(Input(shorty), 40);

    for (const GenerationUsage& u : {cold, warm, part, plain, shorty}) {
        EXPECT_EQ(Input(u) + u.cache_creation_tokens + u.cached_tokens, u.prompt_tokens);
        EXPECT_GE(Input(u), 0);
    }
    const EngineStats st = in.engine->Stats();
    EXPECT_EQ(st.pinned_blocks, 8);  // the system prompt's 6, and the conversation's 2 more
    EXPECT_EQ(st.pin_hits_total, 3);  // warm, partly warm and plain read pinned blocks
    in.engine->Stop();
    ExpectNoLeak(*in.engine);
}

// 64 blocks; each storm prompt takes 13. Without a pin the system prompt is evicted; with one it
// is read whole after the storm, until the TTL passes.
TEST_P(PromptCacheTp, PinSurvivesEvictionStormAndLapsesAfterTtl) {
    if (!file_) return;
    Instance in = Make({.tp = GetParam()});
    InstanceEngine& e = *in.engine;
    const auto system = Tokens(96, 11);

    Run(e, Request(Concat(system, Tokens(8, 1))));  // unpinned
    Storm(e, {&e}, 8);
    EXPECT_EQ(Run(e, Request(Concat(system, Tokens(8, 2)))).cached_tokens, 0) << "LRU kept it";

    // Computed again by the last request: this one reads it and pins it, writing nothing.
    const GenerationUsage pinning = Run(e, Request(Concat(system, Tokens(8, 3)), {96}));
    EXPECT_EQ(pinning.cached_tokens, 96);
    EXPECT_EQ(pinning.cache_creation_tokens, 0);
    EXPECT_EQ(e.Stats().pinned_blocks, 6);
    clock_.AdvanceSeconds(100);
    Storm(e, {&e}, 8);
    EXPECT_GT(e.BlockStats().num_evictions, 0);
    const GenerationUsage after = Run(e, Request(Concat(system, Tokens(8, 4)), {96}));
    EXPECT_EQ(after.cached_tokens, 96);
    EXPECT_EQ(after.cache_creation_tokens, 0);

    // That read at 100 s refreshed the pin: still there at 399 s, gone at 400 s.
    clock_.AdvanceSeconds(299);
    Run(e, Request(Tokens(20, 99)));
    EXPECT_EQ(e.Stats().pinned_blocks, 6);
    EXPECT_EQ(e.Stats().pins_expired_total, 0);
    clock_.AdvanceSeconds(1);
    Run(e, Request(Tokens(20, 98)));
    EXPECT_EQ(e.Stats().pinned_blocks, 0);
    EXPECT_EQ(e.Stats().pins_expired_total, 1);
    // Lapsed into the LRU list: still cached until a storm takes it.
    EXPECT_EQ(e.snapshot()->prefix.CachedPrefixTokens(Concat(system, Tokens(8, 5))), 96);
    Storm(e, {&e}, 8);
    EXPECT_EQ(e.snapshot()->prefix.CachedPrefixTokens(Concat(system, Tokens(8, 5))), 0);
    e.Stop();
    ExpectNoLeak(e);
}

INSTANTIATE_TEST_SUITE_P(Tp, PromptCacheTp, ::testing::Values(1, 2),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// 48 blocks, at most 24 pinned: distinct 10-block prefixes pinned one after another never hold
// more than 24 blocks (the oldest lapse, refused); a 31-block prompt that cannot fit beside the
// pins is still admitted (the pins give way), and every request finishes.
TEST_F(PromptCache, PinnedShareStaysBoundedAndAdmissionProgresses) {
    if (!file_) return;
    Instance in = Make({.num_blocks = 48, .max_pinned_fraction = 0.5});
    InstanceEngine& e = *in.engine;
    for (int i = 0; i < 5; ++i) {
        const GenerationUsage u = Run(e, Request(Tokens(170, 100 + i), {160}));
        EXPECT_EQ(u.cache_creation_tokens, 160) << i;
        EXPECT_LE(e.Stats().pinned_blocks, 24) << i;
    }
    EXPECT_EQ(e.Stats().pinned_blocks, 20);
    EXPECT_EQ(e.Stats().pins_refused_total, 3);
    // Longer than the whole share: not pinned, and the response says so.
    const GenerationUsage big = Run(e, Request(Tokens(420, 200), {416}));
    EXPECT_EQ(big.cache_creation_tokens, 0);
    EXPECT_EQ(Input(big), 420);
    EXPECT_EQ(e.Stats().pins_refused_total, 4);
    // 31 blocks; 20 are pinned, so only 28 could be taken: a pin lapses to admit it.
    const GenerationUsage huge = Run(e, Request(Tokens(490, 300)));
    EXPECT_EQ(huge.prompt_tokens, 490);
    EXPECT_EQ(e.Stats().pins_refused_total, 5);
    EXPECT_LE(e.Stats().pinned_blocks, 24);
    e.Stop();
    ExpectNoLeak(e);
}

// Pins live on the prefill instance; usage adds up the same way when the decode instance
// finishes the request; prefill tp 1 and tp 2.
TEST_F(PromptCache, DisaggregatedPinsLiveOnThePrefillInstance) {
    if (!file_) return;
    for (int prefill_tp : {1, 2}) {
        Instance decode = Make({.role = PoolRole::kDecode, .name = "decode"});
        Instance prefill = Make({.role = PoolRole::kPrefill, .tp = prefill_tp, .name = "prefill"});
        Result<std::unique_ptr<Router>> router =
            Router::Create({prefill.engine.get(), decode.engine.get()});
        ASSERT_TRUE(router.ok()) << router.status().ToString();
        const std::vector<InstanceEngine*> both = {prefill.engine.get(), decode.engine.get()};
        const auto system = Tokens(96, 21);
        const GenerationUsage cold = Run(**router, both, Request(Concat(system, Tokens(9, 1)), {96}));
        EXPECT_EQ(cold.cached_tokens, 0);
        EXPECT_EQ(cold.cache_creation_tokens, 96);
        Storm(**router, both, 8);
        const GenerationUsage warm = Run(**router, both, Request(Concat(system, Tokens(9, 2)), {96}));
        EXPECT_EQ(warm.cached_tokens, 96) << "prefill tp " << prefill_tp;
        EXPECT_EQ(warm.cache_creation_tokens, 0);
        const auto partly = Concat(Concat(system, Tokens(32, 3)), Tokens(4, 4));
        const GenerationUsage part = Run(**router, both, Request(partly, {96, 128}));
        EXPECT_EQ(part.cached_tokens, 96);
        EXPECT_EQ(part.cache_creation_tokens, 32);
        for (const GenerationUsage& u : {cold, warm, part}) {
            EXPECT_EQ(Input(u) + u.cache_creation_tokens + u.cached_tokens, u.prompt_tokens);
        }
        EXPECT_EQ(prefill.engine->Stats().pinned_blocks, 8);
        EXPECT_EQ(decode.engine->Stats().pinned_blocks, 0);
        EXPECT_EQ((*router)->Stats().pinned_blocks, 8);
        EXPECT_EQ((*router)->Stats().pin_hits_total, 2);
        prefill.engine->Stop();
        decode.engine->Stop();
        ExpectNoLeak(*prefill.engine);
        ExpectNoLeak(*decode.engine);
        EXPECT_EQ(prefill.group->kv_staged_bytes(), 0);
        EXPECT_EQ(decode.group->kv_staged_bytes(), 0);
    }
}

// The router sends a request with breakpoints to the instance holding its pins even when that
// instance is busier than the prefix-cache rule allows (prefix_load_slack 4), while the same
// prompt without breakpoints goes to the idle instance.
TEST_F(PromptCache, RouterSendsARequestToTheInstanceHoldingItsPins) {
    if (!file_) return;
    Instance a = Make({.name = "a"});
    Instance b = Make({.name = "b"});
    const auto system = Tokens(96, 31);
    Run(*b.engine, Request(Concat(system, Tokens(5, 1)), {96}));
    ASSERT_EQ(b.engine->snapshot()->prefix.PinnedPrefixTokens(Concat(system, Tokens(5, 2))), 96);
    Result<std::unique_ptr<Router>> router = Router::Create({a.engine.get(), b.engine.get()});
    ASSERT_TRUE(router.ok());
    // Six requests queued on b (not stepped yet): b is 6 busier than a.
    std::vector<std::shared_ptr<CollectingSink>> sinks;
    for (int i = 0; i < 6; ++i) {
        sinks.push_back(std::make_shared<CollectingSink>(1));
        ASSERT_TRUE(b.engine->Submit(Request(Tokens(20, 40 + i)), sinks.back()).ok());
    }
    auto pinned_sink = std::make_shared<CollectingSink>(1);
    ASSERT_TRUE((*router)->Submit(Request(Concat(system, Tokens(5, 3)), {96}), pinned_sink).ok());
    EXPECT_EQ(b.engine->NumRequests(), 7);
    auto plain_sink = std::make_shared<CollectingSink>(1);
    ASSERT_TRUE((*router)->Submit(Request(Concat(system, Tokens(5, 4))), plain_sink).ok());
    EXPECT_EQ(a.engine->NumRequests(), 1);
    Drive({a.engine.get(), b.engine.get()});
    EXPECT_EQ(pinned_sink->usage_.cached_tokens, 96);
    EXPECT_EQ(plain_sink->usage_.cached_tokens, 0);
    a.engine->Stop();
    b.engine->Stop();
    ExpectNoLeak(*a.engine);
    ExpectNoLeak(*b.engine);
}

// Bad breakpoints are refused at Submit, naming the field; nothing is queued.
TEST_F(PromptCache, SubmitRefusesBadBreakpoints) {
    if (!file_) return;
    Instance in = Make({});
    struct Case {
        std::vector<CacheBreakpoint> breakpoints;
        const char* error;
    };
    const Case cases[] = {
        {{{0, kTtlMs}}, "cache_breakpoints[0].prefix_tokens"},
        {{{41, kTtlMs}}, "cache_breakpoints[0].prefix_tokens"},
        {{{20, kTtlMs}, {10, kTtlMs}}, "cache_breakpoints[1].prefix_tokens must grow"},
        {{{20, 0}}, "cache_breakpoints[0].ttl_ms"},
        {{{20, int64_t{25} * 3'600'000}}, "cache_breakpoints[0].ttl_ms"},
        {{{1, kTtlMs}, {2, kTtlMs}, {3, kTtlMs}, {4, kTtlMs}, {5, kTtlMs}}, "at most 4"},
    };
    for (const Case& c : cases) {
        GenerationRequest r = Request(Tokens(40, 1));
        r.cache_breakpoints = c.breakpoints;
        const Status s = in.engine->Submit(r, std::make_shared<CollectingSink>(1));
        EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.error;
        EXPECT_NE(s.message().find(c.error), std::string::npos) << s.message();
    }
    EXPECT_EQ(in.engine->NumRequests(), 0);
}

}  // namespace
}  // namespace kvshard
