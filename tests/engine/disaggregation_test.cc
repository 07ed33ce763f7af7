// Disaggregated prefill/decode with the real CPU workers, in one process: a prefill instance and
// a decode instance (TpGroups with in-process KV transports) behind the Router. Greedy outputs
// equal the colocated tp 1 output for every tp pairing, alone and under 32 concurrent requests,
// in both send modes; failed transfers fall back to decoding on the prefill instance; no block
// leaks and nothing stays staged.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "coordinator/router.h"
#include "model/synthetic_gguf.h"
#include "tests/engine/disaggregation_fixture.h"
#include "tests/test_util.h"

namespace kvshard::disagg_test {
namespace {

class Disaggregation : public DisaggregationFixture {
  protected:
    // The tokens of `prompts` (16 each, one by one) on a mixed tp 1 instance without prefix
    // caching; the same again with it on must give them and read at least `min_cached_tokens`
    // from the cache. Leaves prefix caching on.
    std::vector<std::vector<int32_t>> UncachedThenCached(
        const std::vector<std::vector<int32_t>>& prompts, int64_t min_cached_tokens,
        const SamplingParams& sampling = {}) {
        prefix_caching_ = false;
        std::vector<std::vector<int32_t>> expected;
        {
            Instance mixed = Make("mixed", PoolRole::kMixed, 1);
            expected = Run(*mixed.engine, prompts, 16, /*concurrent=*/false, sampling);
        }
        prefix_caching_ = true;
        {
            Instance mixed = Make("mixed", PoolRole::kMixed, 1);
            EXPECT_EQ(Run(*mixed.engine, prompts, 16, /*concurrent=*/false, sampling), expected)
                << "prefix cache on";
            ExpectClean(mixed);
            EXPECT_GE(mixed.engine->BlockStats().prompt_tokens_from_cache, min_cached_tokens);
        }
        return expected;
    }

    // Every handoff pairing the invariance tests cover (prefill tp 1 -> decode tp 1 layerwise,
    // 2 -> 1, 1 -> 2): `prompts`, 16 tokens each and all at once, give `expected`. Callers wrap it
    // in ASSERT_NO_FATAL_FAILURE.
    void ExpectEveryPairingGives(const std::vector<std::vector<int32_t>>& prompts,
                                 const std::vector<std::vector<int32_t>>& expected,
                                 const SamplingParams& sampling = {}) {
        for (auto [prefill_tp, decode_tp, layerwise] :
             {std::tuple{1, 1, true}, std::tuple{2, 1, false}, std::tuple{1, 2, false}}) {
            Instance decode = Make("decode", PoolRole::kDecode, decode_tp);
            Instance prefill = Make("prefill", PoolRole::kPrefill, prefill_tp, 10'000, layerwise);
            Result<std::unique_ptr<Router>> router =
                Router::Create({prefill.engine.get(), decode.engine.get()});
            ASSERT_TRUE(router.ok()) << router.status().ToString();
            EXPECT_EQ(Run(**router, prompts, 16, /*concurrent=*/true, sampling), expected)
                << "prefill tp " << prefill_tp << " -> decode tp " << decode_tp;
            ExpectClean(prefill);
            ExpectClean(decode);
        }
    }
};

struct PairCase {
    const char* name;
    int prefill_tp;
    int decode_tp;
    bool layerwise;
};

class DisaggregationPairs : public Disaggregation,
                            public ::testing::WithParamInterface<PairCase> {};

TEST_P(DisaggregationPairs, GreedyEqualsColocatedAloneAndConcurrent) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    const PairCase& pc = GetParam();
    const auto prompts = Prompts(32);
    const auto expected = Colocated(prompts, 24);
    Instance decode = Make("decode", PoolRole::kDecode, pc.decode_tp);
    Instance prefill = Make("prefill", PoolRole::kPrefill, pc.prefill_tp, 10'000, pc.layerwise);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok()) << router.status().ToString();
    for (bool concurrent : {false, true}) {
        const auto got = Run(**router, prompts, 24, concurrent);
        for (size_t i = 0; i < prompts.size(); ++i)
            EXPECT_EQ(got[i], expected[i]) << "prompt " << i << " concurrent " << concurrent;
    }
    EXPECT_EQ(observer_.transfers.load(), 64);
    EXPECT_EQ(observer_.failures.load(), 0);
    EXPECT_EQ(observer_.ttft_prefill.load(), 64);
    ExpectClean(prefill);
    ExpectClean(decode);
}

INSTANTIATE_TEST_SUITE_P(
    Pairs, DisaggregationPairs,
    ::testing::Values(PairCase{"Tp1ToTp1", 1, 1, false}, PairCase{"Tp1ToTp1Layerwise", 1, 1, true},
                      PairCase{"Tp2ToTp1", 2, 1, false}, PairCase{"Tp2ToTp1Layerwise", 2, 1, true},
                      PairCase{"Tp1ToTp2", 1, 2, false}, PairCase{"Tp2ToTp2", 2, 2, true}),
    [](const auto& info) { return std::string(info.param.name); });

// The bytes of one transfer are blocks × layers × 2 × KV heads × block_size × head_dim × 4 (fp32),
// however the heads are split on either side.
TEST_F(Disaggregation, TransferBytesFollowTheGeometry) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    const ModelSpec& spec = file_->spec();
    Instance decode = Make("decode", PoolRole::kDecode, 2);
    Instance prefill = Make("prefill", PoolRole::kPrefill, 1);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok());
    const std::vector<int32_t> prompt = Prompts(15).back();  // longer than one block
    ASSERT_GT(prompt.size(), 16u);
    Run(**router, {prompt}, 4, false);
    const int64_t blocks = (static_cast<int64_t>(prompt.size()) + 15) / 16;
    EXPECT_EQ(observer_.bytes_total.load(),
              blocks * spec.num_layers * 2 * spec.num_kv_heads * 16 * spec.head_dim * 4);
    ExpectClean(prefill);
    ExpectClean(decode);
}

// bf16 KV (pools of 2-byte elements): a handoff moves half of fp32's bytes (the wire's dtype byte
// says bf16, the transports copy the pool's bytes), and prompts sharing a 3-block prefix give the
// tokens of a colocated bf16 instance without prefix caching with it on and handed off from a
// prefill instance to a decode instance (tp 1 -> 1 layerwise, 2 -> 1, 1 -> 2).
TEST_F(Disaggregation, Bf16KvKeepsTheColocatedTokensWithPrefixCacheAndHandoff) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    kv_storage_ = KvDtype::kBf16;
    const ModelSpec& spec = file_->spec();
    std::vector<int32_t> prefix;
    for (int i = 0; i < 48; ++i) prefix.push_back(3 + (i * 37 + 11) % 250);
    std::vector<std::vector<int32_t>> prompts;
    for (int p = 0; p < 8; ++p) {
        prompts.push_back(prefix);
        for (int i = 0; i <= p; ++i) prompts.back().push_back(3 + (i * 17 + p * 31) % 250);
    }
    {
        Instance decode = Make("decode", PoolRole::kDecode, 1);
        Instance prefill = Make("prefill", PoolRole::kPrefill, 1);
        Result<std::unique_ptr<Router>> router =
            Router::Create({prefill.engine.get(), decode.engine.get()});
        ASSERT_TRUE(router.ok());
        Run(**router, {prompts[0]}, 4, false);  // 49 tokens: 4 blocks
        EXPECT_EQ(observer_.bytes_total.load(),
                  4 * spec.num_layers * 2 * spec.num_kv_heads * 16 * spec.head_dim * 2);
        ExpectClean(prefill);
        ExpectClean(decode);
    }
    const std::vector<std::vector<int32_t>> expected = UncachedThenCached(prompts, 7 * 48);
    ASSERT_NO_FATAL_FAILURE(ExpectEveryPairingGives(prompts, expected));
    EXPECT_EQ(observer_.transfers.load(), 1 + 3 * 8);
    EXPECT_EQ(observer_.failures.load(), 0);
}

// A decode instance whose transport cannot be reached: the prefill instance's send fails and it
// decodes the request itself — same tokens, no error for the client.
TEST_F(Disaggregation, UnreachableDecodeFallsBackToThePrefillInstance) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    const auto prompts = Prompts(8);
    const auto expected = Colocated(prompts, 16);
    Instance decode =
        Make("decode", PoolRole::kDecode, 1, 10'000, false, {"local:nobody-listens/0"});
    Instance prefill = Make("prefill", PoolRole::kPrefill, 1);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok());
    EXPECT_EQ(Run(**router, prompts, 16, true), expected);
    EXPECT_EQ(observer_.failures.load(), 8);
    // The worker's Status reaches the engine with its code: the receiver is not there.
    EXPECT_EQ(observer_.FailuresWith(StatusCode::kUnavailable), 8);
    EXPECT_EQ(observer_.transfers.load(), 0);
    ExpectClean(prefill);
    ExpectClean(decode);
}

// A decode instance whose workers are down is not given handoffs (no request pays a failed KV
// connect): the prefill instance decodes alone, and metrics say which instance is down. With the
// prefill instance down too, nothing can serve: Submit and Health say Unavailable.
TEST_F(Disaggregation, DownInstancesAreSkippedAndShownDown) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    const auto prompts = Prompts(4);
    const auto expected = Colocated(prompts, 8);
    Instance decode = Make("decode", PoolRole::kDecode, 1, 10'000, false, {}, "", true);
    Instance prefill = Make("prefill", PoolRole::kPrefill, 1, 10'000, false, {}, "", true);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok());
    auto up = [&](const std::string& name) {
        for (const InstanceUp& i : (*router)->Stats().instances) {
            if (i.instance == name) return i.up;
        }
        ADD_FAILURE() << name;
        return false;
    };

    decode.gate->down = true;
    EXPECT_FALSE(up("decode"));
    EXPECT_TRUE(up("prefill"));
    EXPECT_TRUE((*router)->Health().ok());
    EXPECT_EQ(Run(**router, prompts, 8, true), expected);
    EXPECT_EQ(observer_.failures.load(), 0);
    EXPECT_EQ(observer_.transfers.load(), 0);

    prefill.gate->down = true;
    EXPECT_EQ((*router)->Health().code(), StatusCode::kUnavailable);
    GenerationRequest r;
    r.request_id = "nowhere";
    r.prompt_token_ids = prompts[0];
    r.max_tokens = 4;
    EXPECT_EQ((*router)->Submit(r, std::make_shared<CollectingSink>(1)).code(),
              StatusCode::kUnavailable);

    decode.gate->down = false;
    prefill.gate->down = false;
    EXPECT_EQ(Run(**router, prompts, 8, true), expected);
    EXPECT_EQ(observer_.transfers.load(), 4);
    ExpectClean(prefill);
    ExpectClean(decode);
}

// The KV goes to a transport the decode instance does not read (a misrouted transfer): the decode
// step times out waiting, the request returns to the prefill instance, which still holds its KV.
TEST_F(Disaggregation, ReceiveTimeoutReturnsTheRequestToThePrefillInstance) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    const auto prompts = Prompts(4);
    const auto expected = Colocated(prompts, 12);
    Instance elsewhere = Make("elsewhere", PoolRole::kMixed, 1);
    Instance decode = Make("decode", PoolRole::kDecode, 1, /*timeout_ms=*/300, false,
                           elsewhere.group->kv_endpoints());
    Instance prefill = Make("prefill", PoolRole::kPrefill, 1);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok());
    EXPECT_EQ(Run(**router, prompts, 12, true), expected);
    EXPECT_EQ(observer_.failures.load(), 4);
    // The decode workers' Status reaches the engine with its code: the pieces never came.
    EXPECT_EQ(observer_.FailuresWith(StatusCode::kDeadlineExceeded), 4);
    ExpectClean(prefill);
    ExpectClean(decode);
}

// The default model has 9 query heads and 3 KV heads: at tp 2 the middle KV head is held by both
// ranks (worker/shard.h), so re-sharding must send it once and place it on the right rank. Every
// pairing of the example configs (1 -> 1, 2 -> 1) and the reverse and odd ones (1 -> 2, 2 -> 3)
// gives the colocated tp 1 tokens, alone and under 32 concurrent requests.
TEST_F(Disaggregation, DefaultModelEqualsColocatedForEveryPairing) {
    const std::string path = testing::DefaultModel();
    KV_REQUIRE_FIXTURE(path, "the default model");
    Load(path);
    const auto prompts = Prompts(32);
    const auto expected = Colocated(prompts, 8);
    for (auto [prefill_tp, decode_tp] :
         {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}, std::pair{2, 3}}) {
        Instance decode = Make("decode", PoolRole::kDecode, decode_tp);
        Instance prefill = Make("prefill", PoolRole::kPrefill, prefill_tp, 10'000,
                                /*layerwise=*/prefill_tp == 2);
        Result<std::unique_ptr<Router>> router =
            Router::Create({prefill.engine.get(), decode.engine.get()});
        ASSERT_TRUE(router.ok());
        const std::vector<std::vector<int32_t>> few(prompts.begin(), prompts.begin() + 4);
        EXPECT_EQ(Run(**router, few, 8, /*concurrent=*/false),
                  std::vector(expected.begin(), expected.begin() + 4))
            << "alone, prefill tp " << prefill_tp << " -> decode tp " << decode_tp;
        EXPECT_EQ(Run(**router, prompts, 8, /*concurrent=*/true), expected)
            << "32 concurrent, prefill tp " << prefill_tp << " -> decode tp " << decode_tp;
        ExpectClean(prefill);
        ExpectClean(decode);
    }
    EXPECT_EQ(observer_.failures.load(), 0);
}

// The router prefers the prefill instance whose prefix cache holds the longest prefix of the
// prompt (both idle: without the cache the first instance would win the tie).
TEST_F(Disaggregation, RouterPrefersThePrefillInstanceWithTheCachedPrefix) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    Instance decode = Make("decode", PoolRole::kDecode, 1);
    Instance p0 = Make("p0", PoolRole::kPrefill, 1, 10'000, false, {}, "p0");
    Instance p1 = Make("p1", PoolRole::kPrefill, 1, 10'000, false, {}, "p1");
    Result<std::unique_ptr<Router>> router =
        Router::Create({p0.engine.get(), p1.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok());
    const std::vector<int32_t> prompt = Prompts(22).back();  // a few blocks long
    ASSERT_GT(prompt.size(), 32u);
    // Warm p1's prefix cache directly.
    GenerationRequest warm;
    warm.request_id = "warm";
    warm.prompt_token_ids = prompt;
    warm.max_tokens = 2;
    auto sink = std::make_shared<CollectingSink>(1);
    ASSERT_TRUE(p1.engine->SubmitWithHandoff(warm, sink, decode.engine.get(), 1'000'000).ok());
    sink->Wait();
    // The sink hears the last token before the step that produced it publishes its snapshot:
    // wait (bounded) for the snapshot of that step.
    for (int i = 0; i < 2000 && p1.engine->snapshot()->prefix.CachedPrefixTokens(prompt) == 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_GT(p1.engine->snapshot()->prefix.CachedPrefixTokens(prompt), 0);
    EXPECT_EQ(p0.engine->snapshot()->prefix.CachedPrefixTokens(prompt), 0);
    Run(**router, {prompt}, 2, false);
    const std::vector<int32_t> other = Prompts(3).back();
    Run(**router, {other}, 2, false);
    std::lock_guard<std::mutex> lock(observer_.mu);
    EXPECT_EQ(observer_.first_token_pools, (std::vector<std::string>{"p1", "p1", "p0"}));
}

// A seeded, sampled request continues on the decode instance with the prefill instance's random
// stream (StepResult carries the sampler state), so it equals the same request colocated.
TEST_F(Disaggregation, SeededSamplingEqualsColocated) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    const auto prompts = Prompts(8);
    SamplingParams sampling;
    sampling.temperature = 1.0f;
    sampling.top_p = 0.9f;
    sampling.seed = 42;
    std::vector<std::vector<int32_t>> expected;
    {
        Instance mixed = Make("mixed", PoolRole::kMixed, 1);
        expected = Run(*mixed.engine, prompts, 20, /*concurrent=*/false, sampling);
    }
    Instance decode = Make("decode", PoolRole::kDecode, 2);
    Instance prefill = Make("prefill", PoolRole::kPrefill, 1);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok());
    EXPECT_EQ(Run(**router, prompts, 20, /*concurrent=*/true, sampling), expected);
    ExpectClean(prefill);
    ExpectClean(decode);
}

// The logit controls (penalties, logit_bias, min_tokens) read the sequence's tokens sent with each
// step, so a request samples the same tokens at tp 1 and tp 2, colocated and handed off — and not
// the tokens it would without them.
TEST_F(Disaggregation, LogitControlsEqualAcrossTpAndHandoff) {
    const std::string path = testing::SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    Load(path);
    const auto prompts = Prompts(6);
    SamplingParams controls;
    controls.repetition_penalty = 1.3f;
    controls.frequency_penalty = 0.4f;
    controls.presence_penalty = 0.6f;
    controls.logit_bias = {{5, 2.0f}, {17, -3.0f}};
    std::vector<std::vector<int32_t>> expected, plain;
    {
        Instance mixed = Make("mixed", PoolRole::kMixed, 1);
        expected = Run(*mixed.engine, prompts, 24, /*concurrent=*/false, controls);
        plain = Run(*mixed.engine, prompts, 24, /*concurrent=*/false);
        ExpectClean(mixed);
    }
    EXPECT_NE(expected, plain);
    {
        Instance mixed2 = Make("mixed2", PoolRole::kMixed, 2);
        EXPECT_EQ(Run(*mixed2.engine, prompts, 24, /*concurrent=*/true, controls), expected);
        ExpectClean(mixed2);
    }
    Instance decode = Make("decode", PoolRole::kDecode, 2);
    Instance prefill = Make("prefill", PoolRole::kPrefill, 1);
    Result<std::unique_ptr<Router>> router =
        Router::Create({prefill.engine.get(), decode.engine.get()});
    ASSERT_TRUE(router.ok());
    EXPECT_EQ(Run(**router, prompts, 24, /*concurrent=*/true, controls), expected);
    ExpectClean(prefill);
    ExpectClean(decode);
}

// The architectures past Llama, on their synthetic models (model/synthetic_gguf.h: qwen2's Q/K/V
// biases, qwen3's q/k norms, mistral's window of 8 over every layer, gemma3's local layers with a
// window of 6, MQA and post norms) keep the engine's invariances: with prefix caching on, prompts
// that read an earlier prompt's blocks give the tokens of caching off, and every disaggregated
// pairing (tp 1 -> 1 layerwise, 2 -> 1, 1 -> 2) gives the colocated tokens. The prompts share a
// 40-token prefix (two and a half blocks, longer than both windows) and generation runs past the
// windows, so the windowed layers' KV is read from cached and from handed-over blocks. The engine
// keeps a block table per KV cache group (kv/kv_cache_groups.h): mistral's one windowed group and
// gemma3's full and windowed groups release the blocks their windows left, and a handoff sends and
// allocates only the blocks the windows still read.
class DisaggregationArchs : public Disaggregation,
                            public ::testing::WithParamInterface<const char*> {
  protected:
    static std::vector<std::vector<int32_t>> SharedPrefixPrompts(int count) {
        std::vector<int32_t> prefix;
        for (int i = 0; i < 40; ++i) prefix.push_back(3 + (i * 41 + 7) % 250);
        std::vector<std::vector<int32_t>> out;
        for (int p = 0; p < count; ++p) {
            std::vector<int32_t> prompt = prefix;
            for (int i = 0; i <= p; ++i) prompt.push_back(3 + (i * 13 + p * 29) % 250);
            out.push_back(prompt);
        }
        return out;
    }
    testing::TempDir dir_;
};

TEST_P(DisaggregationArchs, PrefixCacheAndHandoffKeepTheColocatedTokens) {
    const std::string path = dir_.File(std::string(GetParam()) + ".gguf");
    ASSERT_TRUE(SyntheticArchGguf(GetParam()).WriteFile(path).ok());
    Load(path);
    const auto prompts = SharedPrefixPrompts(8);
    // Sampled with a seed rather than greedy: on these random weights greedy decoding repeats one
    // token, which a wrong KV could give too; a sampled sequence follows every step's logits.
    SamplingParams sampling;
    sampling.temperature = 1.0f;
    sampling.seed = 7;
    // Each prompt after the first reads the two full blocks of the shared prefix.
    const std::vector<std::vector<int32_t>> expected =
        UncachedThenCached(prompts, 7 * 32, sampling);
    ASSERT_NO_FATAL_FAILURE(ExpectEveryPairingGives(prompts, expected, sampling));
    EXPECT_EQ(observer_.transfers.load(), 3 * 8);
    EXPECT_EQ(observer_.failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Archs, DisaggregationArchs,
                         ::testing::Values("qwen2", "qwen3", "mistral", "gemma3"),
                         [](const auto& info) { return std::string(info.param); });

TEST(RouterCreate, RefusesAnEmptyCluster) { EXPECT_FALSE(Router::Create({}).ok()); }

}  // namespace
}  // namespace kvshard::disagg_test
