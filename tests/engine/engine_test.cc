// The engine of one instance with the real CPU worker on stories260K: continuous batching gives
// every request the tokens it gets alone, under chunked prefill, preemption, n > 1 and aborts,
// and every KV block is free or cached afterwards.
#include <gtest/gtest.h>

#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator/engine.h"
#include "tests/engine/collecting_sink.h"
#include "tests/test_util.h"
#include "worker/generator.h"
#include "worker/local_model.h"
#include "worker/step_runner.h"

namespace kvshard {
namespace {

class EngineTest : public ::testing::Test {
protected:
    void SetUp() override {
        const std::string path = testing::SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(path, "stories260K.bin");
        LocalModelOptions o;
        o.runner.num_kv_blocks = 512;
        o.runner.block_size = 16;
        Result<LocalModel> m = LoadLocalModel(path, o);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        model_ = std::make_unique<LocalModel>(std::move(*m));
        // A second runner for the "alone" references (contiguous cache).
        Result<LocalModel> ref = LoadLocalModel(path);
        ASSERT_TRUE(ref.ok());
        reference_ = std::make_unique<LocalModel>(std::move(*ref));
        executor_ = std::make_unique<StepRunner>(*model_->runner);
    }

    std::unique_ptr<InstanceEngine> MakeEngine(int64_t num_blocks, int64_t max_batched_tokens,
                                               int64_t max_num_seqs = 64) {
        InstanceEngineConfig c;
        c.scheduler.max_num_seqs = max_num_seqs;
        c.scheduler.max_num_batched_tokens = max_batched_tokens;
        c.blocks.num_blocks = num_blocks;
        c.blocks.block_size = 16;
        c.max_context = 512;
        c.stop_token_ids = model_->StopTokenIds();
        auto e = std::make_unique<InstanceEngine>(c, *model_->tokenizer, *executor_);
        e->Start();
        return e;
    }

    std::vector<int32_t> Alone(const std::vector<int32_t>& prompt, int64_t max_tokens) {
        GenerateOptions o;
        o.max_tokens = max_tokens;
        o.stop_token_ids = reference_->StopTokenIds();
        Result<GenerateResult> r = Generate(*reference_->runner, *reference_->tokenizer, prompt, o);
        EXPECT_TRUE(r.ok());
        std::vector<int32_t> ids = r->token_ids;
        // The engine reports generated tokens without the stop token.
        if (r->finish_reason == FinishReason::kStop && !ids.empty()) ids.pop_back();
        return ids;
    }

    GenerationRequest Request(const std::string& id, const std::vector<int32_t>& prompt, int64_t max_tokens) {
        GenerationRequest r;
        r.request_id = id;
        r.prompt_token_ids = prompt;
        r.max_tokens = max_tokens;
        return r;
    }

    std::vector<std::vector<int32_t>> Prompts(int count) {
        const std::vector<std::string> words = {"Once upon a time", "The little dog", "Lily and Tom went",
                                                "One day, a big bird", "The sun was hot and",
                                                "Sam had a red ball that", "In the park there was a"};
        std::vector<std::vector<int32_t>> out;
        for (int i = 0; i < count; ++i) {
            std::string text = words[i % words.size()];
            for (int k = 0; k < i / int(words.size()); ++k) text += " and then";
            out.push_back(model_->EncodePrompt(text));
        }
        return out;
    }

    std::unique_ptr<LocalModel> model_;
    std::unique_ptr<LocalModel> reference_;
    std::unique_ptr<StepRunner> executor_;
};

void ExpectAllBlocksFreeOrCached(const InstanceEngine& e) {
    const kv::BlockManagerStats s = e.BlockStats();
    EXPECT_EQ(s.num_used_blocks, 0);
    EXPECT_EQ(s.num_free_blocks + s.num_cached_blocks, s.num_blocks);
}

struct BatchCase {
    const char* name;
    int64_t num_blocks;
    int64_t max_batched_tokens;
    int64_t max_num_seqs;
};

void PrintTo(const BatchCase& c, std::ostream* os) { *os << c.name; }

class EngineBatching : public EngineTest, public ::testing::WithParamInterface<BatchCase> {};

// 32 concurrent greedy requests each produce exactly the tokens of the same request alone —
// with a roomy pool, with a small token budget (chunked prefill), and with a pool so small that
// sequences are preempted and recomputed.
TEST_P(EngineBatching, ConcurrentGreedyEqualsAlone) {
    if (!model_) return;
    const BatchCase& bc = GetParam();
    auto engine = MakeEngine(bc.num_blocks, bc.max_batched_tokens, bc.max_num_seqs);
    const auto prompts = Prompts(32);
    std::vector<std::shared_ptr<CollectingSink>> sinks;
    for (size_t i = 0; i < prompts.size(); ++i) {
        sinks.push_back(std::make_shared<CollectingSink>(1));
        ASSERT_TRUE(engine->Submit(Request("r" + std::to_string(i), prompts[i], 40 + int64_t(i) % 7), sinks.back()).ok());
    }
    for (auto& s : sinks) s->Wait();
    for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_TRUE(sinks[i]->status_.ok());
        EXPECT_EQ(sinks[i]->ids_[0], Alone(prompts[i], 40 + int64_t(i) % 7)) << "request " << i;
        EXPECT_EQ(sinks[i]->usage_.prompt_tokens, int64_t(prompts[i].size()));
    }
    engine->Stop();
    ExpectAllBlocksFreeOrCached(*engine);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, EngineBatching,
    ::testing::Values(BatchCase{"Roomy", 512, 512, 64}, BatchCase{"ChunkedPrefill", 512, 16, 8},
                      BatchCase{"Preemption", 40, 64, 32}),
    [](const auto& info) { return std::string(info.param.name); });

TEST_F(EngineTest, PrefixCacheServesARepeatedPrompt) {
    if (!model_) return;
    auto engine = MakeEngine(512, 512);
    std::vector<int32_t> prompt = model_->EncodePrompt(
        "Once upon a time there was a little girl named Lily who loved to play in the park with her dog");
    ASSERT_GT(prompt.size(), 17u);
    for (int round = 0; round < 2; ++round) {
        auto sink = std::make_shared<CollectingSink>(1);
        ASSERT_TRUE(engine->Submit(Request("p" + std::to_string(round), prompt, 8), sink).ok());
        sink->Wait();
        EXPECT_EQ(sink->usage_.cached_tokens, round == 0 ? 0 : int64_t((prompt.size() - 1) / 16 * 16));
        EXPECT_EQ(sink->ids_[0], Alone(prompt, 8));
    }
    EXPECT_GT(engine->Stats().prefix_cache_hits_tokens, 0);
}

TEST_F(EngineTest, SeveralChoicesShareThePrompt) {
    if (!model_) return;
    auto engine = MakeEngine(512, 512);
    const std::vector<int32_t> prompt = model_->EncodePrompt("The little dog");
    GenerationRequest r = Request("n3", prompt, 20);
    r.n = 3;
    r.sampling.temperature = 1.0f;
    r.sampling.seed = 7;
    auto sink = std::make_shared<CollectingSink>(3);
    ASSERT_TRUE(engine->Submit(r, sink).ok());
    sink->Wait();
    EXPECT_TRUE(sink->status_.ok());
    for (int i = 0; i < 3; ++i) EXPECT_FALSE(sink->ids_[i].empty());
    EXPECT_NE(sink->ids_[0], sink->ids_[1]);  // different seeds, different samples
    // Choice i is the sampled run with seed 7 + i alone.
    for (int i = 0; i < 3; ++i) {
        GenerateOptions o;
        o.max_tokens = 20;
        o.sampling.temperature = 1.0f;
        o.sampling.seed = 7 + i;
        o.stop_token_ids = reference_->StopTokenIds();
        Result<GenerateResult> alone = Generate(*reference_->runner, *reference_->tokenizer, prompt, o);
        std::vector<int32_t> ids = alone->token_ids;
        if (alone->finish_reason == FinishReason::kStop) ids.pop_back();
        EXPECT_EQ(sink->ids_[i], ids) << "choice " << i;
    }
    engine->Stop();
    ExpectAllBlocksFreeOrCached(*engine);
}

TEST_F(EngineTest, AbortFreesBlocks) {
    if (!model_) return;
    auto engine = MakeEngine(512, 512);
    auto sink = std::make_shared<CollectingSink>(1);
    ASSERT_TRUE(engine->Submit(Request("long", Prompts(1)[0], 400), sink).ok());
    engine->Abort("long");
    sink->Wait();
    EXPECT_EQ(sink->finish_[0], FinishReason::kAbort);
    EXPECT_LT(sink->ids_[0].size(), 400u);
    engine->Stop();
    ExpectAllBlocksFreeOrCached(*engine);
}

TEST_F(EngineTest, RejectsWhatCannotFit) {
    if (!model_) return;
    auto engine = MakeEngine(512, 512);
    auto sink = std::make_shared<CollectingSink>(1);
    EXPECT_EQ(engine->Submit(Request("big", Prompts(1)[0], 1000), sink).code(), StatusCode::kOutOfRange);
    EXPECT_EQ(engine->Submit(Request("empty", {}, 10), sink).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(engine->Submit(Request("bad", {1, 99999}, 10), sink).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvshard
