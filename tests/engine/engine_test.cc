// The engine of one instance with the real CPU worker on stories260K: continuous batching gives
// every request the tokens it gets alone, under chunked prefill, preemption, n > 1 and aborts,
// and every KV block is free or cached afterwards.
#include <gtest/gtest.h>

#include <atomic>
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

// An executor whose workers can die and be re-formed, as the process-mode executor's: dead,
// Health is Unavailable and every step fails at once; re-formed, the epoch moves on.
class RestartableExecutor : public StepExecutor {
  public:
    explicit RestartableExecutor(StepExecutor& inner) : inner_(inner) {}
    Result<StepResult> Execute(const StepPlan& plan) override {
        if (down_.load()) return Status(StatusCode::kUnavailable, "rank 0 (127.0.0.1:4711): gone");
        steps_++;
        if (kill_at_step_ > 0 && steps_ == kill_at_step_) {
            down_ = true;
            return Status(StatusCode::kUnavailable, "rank 0 (127.0.0.1:4711): connection reset");
        }
        return inner_.Execute(plan);
    }
    Status Health() const override {
        return down_.load() ? Status(StatusCode::kUnavailable, "rank 0 (127.0.0.1:4711): dead")
                            : Status::Ok();
    }
    uint64_t epoch() const override { return epoch_.load(); }
    void Kill() { down_ = true; }
    void Reform() {
        epoch_++;
        down_ = false;
    }
    std::atomic<bool> down_{false};
    std::atomic<uint64_t> epoch_{1};
    int steps_ = 0;         // engine thread
    int kill_at_step_ = 0;  // the step (1-based) at which the workers die; 0: never

  private:
    StepExecutor& inner_;
};

TEST_F(EngineTest, DeadWorkersShowAtOnceAndReformedOnesServeWithoutStaleCache) {
    if (!model_) return;
    RestartableExecutor executor(*executor_);
    InstanceEngineConfig c;
    c.name = "mixed";
    c.pool = "default";
    c.blocks.num_blocks = 512;
    c.blocks.block_size = 16;
    c.max_context = 512;
    c.stop_token_ids = model_->StopTokenIds();
    InstanceEngine engine(c, *model_->tokenizer, executor);
    engine.Start();
    const std::vector<int32_t> prompt = model_->EncodePrompt(
        "Once upon a time there was a little girl named Lily who loved to play in the park");
    ASSERT_GT(prompt.size(), 17u);
    auto run = [&](const std::string& id) {
        auto sink = std::make_shared<CollectingSink>(1);
        EXPECT_TRUE(engine.Submit(Request(id, prompt, 8), sink).ok());
        sink->Wait();
        return sink;
    };
    ASSERT_TRUE(run("warm")->status_.ok());
    ASSERT_TRUE(engine.Health().ok());
    ASSERT_EQ(engine.Stats().instances.size(), 1u);
    EXPECT_TRUE(engine.Stats().instances[0].up);

    // The workers die while the engine is idle: no request has to find out.
    executor.Kill();
    EXPECT_EQ(engine.Health().code(), StatusCode::kUnavailable);
    EXPECT_FALSE(engine.Stats().instances[0].up);
    auto refused = std::make_shared<CollectingSink>(1);
    const Status st = engine.Submit(Request("while-down", prompt, 8), refused);
    EXPECT_EQ(st.code(), StatusCode::kUnavailable);
    EXPECT_EQ(st.message().find("127.0.0.1"), std::string::npos) << st.message();

    // Re-formed workers hold no KV: the prompt is computed again, not read from the old cache.
    executor.Reform();
    EXPECT_TRUE(engine.Health().ok());
    auto again = run("after-reform");
    EXPECT_TRUE(again->status_.ok()) << again->status_.ToString();
    EXPECT_EQ(again->usage_.cached_tokens, 0);
    EXPECT_EQ(again->ids_[0], Alone(prompt, 8));
    // ... and the new workers' KV is cached again.
    EXPECT_GT(run("cached-again")->usage_.cached_tokens, 0);

    // Dying under a step: the request fails with a message in kvshard's words, blocks come back.
    executor.kill_at_step_ = executor.steps_ + 2;
    auto failed = run("dies-mid-request");
    EXPECT_EQ(failed->status_.code(), StatusCode::kUnavailable);
    EXPECT_EQ(failed->status_.message().find("127.0.0.1"), std::string::npos)
        << failed->status_.message();
    EXPECT_EQ(engine.Health().code(), StatusCode::kUnavailable);
    executor.Reform();
    EXPECT_TRUE(engine.Health().ok());
    EXPECT_TRUE(run("served-again")->status_.ok());
    engine.Stop();
    ExpectAllBlocksFreeOrCached(engine);
}

}  // namespace
}  // namespace kvshard
