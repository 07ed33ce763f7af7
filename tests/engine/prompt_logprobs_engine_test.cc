// Prompt logprobs through the engine of one instance (real CPU worker, stories260K): the request
// gets its prompt's scores once, before any token, under chunked prefill and with a warm prefix
// cache alike; max_tokens 0 answers with the prompt only; and the logprob of a generated token
// equals the prompt logprob of the same token when prompt + generation is sent back.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "coordinator/engine.h"
#include "tests/engine/collecting_sink.h"
#include "tests/test_util.h"
#include "worker/local_model.h"
#include "worker/step_runner.h"

namespace kvshard {
namespace {

class PromptLogprobsEngine : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string path = testing::SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(path, "stories260K.bin");
        LocalModelOptions o;
        o.runner.num_kv_blocks = 64;
        o.runner.block_size = 16;
        Result<LocalModel> m = LoadLocalModel(path, o);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        model_ = std::make_unique<LocalModel>(std::move(*m));
        executor_ = std::make_unique<StepRunner>(*model_->runner);
        InstanceEngineConfig c;
        c.scheduler.max_num_seqs = 8;
        c.scheduler.max_num_batched_tokens = 16;  // a 40-token prompt runs in 3 chunks
        c.blocks.num_blocks = 64;
        c.blocks.block_size = 16;
        c.max_context = 256;
        c.stop_token_ids = model_->StopTokenIds();
        engine_ = std::make_unique<InstanceEngine>(c, *model_->tokenizer, *executor_);
        engine_->Start();
    }
    void TearDown() override {
        if (engine_) engine_->Stop();
    }
    std::shared_ptr<CollectingSink> Run(std::vector<int32_t> prompt, int64_t max_tokens,
                                        int32_t prompt_logprobs, int32_t logprobs = -1, int n = 1) {
        GenerationRequest r;
        r.request_id = "r" + std::to_string(next_id_++);
        r.prompt_token_ids = std::move(prompt);
        r.max_tokens = max_tokens;
        r.num_prompt_logprobs = prompt_logprobs;
        r.num_top_logprobs = logprobs;
        r.ignore_eos = true;
        r.n = n;
        auto sink = std::make_shared<CollectingSink>(n);
        const Status st = engine_->Submit(std::move(r), sink);
        EXPECT_TRUE(st.ok()) << st.ToString();
        if (st.ok()) sink->Wait();
        return sink;
    }
    std::vector<int32_t> Prompt() {
        return model_->EncodePrompt(
            "Once upon a time, there was a little girl named Lily. She liked to play in the park "
            "with her dog and her red ball");
    }

    std::unique_ptr<LocalModel> model_;
    std::unique_ptr<StepRunner> executor_;
    std::unique_ptr<InstanceEngine> engine_;
    int next_id_ = 0;
};

TEST_F(PromptLogprobsEngine, MaxTokensZeroAnswersWithThePromptsScoresOnly) {
    if (!engine_) return;
    const std::vector<int32_t> prompt = Prompt();
    ASSERT_GT(prompt.size(), 32u);  // more than two chunks
    auto sink = Run(prompt, 0, 2);
    ASSERT_TRUE(sink->status_.ok()) << sink->status_.ToString();
    EXPECT_EQ(sink->prompt_deltas_, 1);
    ASSERT_EQ(sink->prompt_logprobs_.size(), prompt.size() - 1);
    for (size_t i = 0; i < sink->prompt_logprobs_.size(); ++i) {
        const PromptTokenLogprob& s = sink->prompt_logprobs_[i];
        EXPECT_EQ(s.token_id, prompt[i + 1]);
        EXPECT_LE(s.logprob, 0.0f);
        EXPECT_GE(s.rank, 1);
        EXPECT_EQ(s.top.size(), 2u);
    }
    EXPECT_TRUE(sink->ids_[0].empty());
    EXPECT_EQ(sink->finish_[0], FinishReason::kLength);
    EXPECT_EQ(sink->usage_.completion_tokens, 0);
    EXPECT_EQ(sink->usage_.prompt_tokens, static_cast<int64_t>(prompt.size()));

    // Warm cache: the same prompt again is computed whole and scored alike.
    auto again = Run(prompt, 0, 2);
    EXPECT_EQ(again->usage_.cached_tokens, 0);
    ASSERT_EQ(again->prompt_logprobs_.size(), sink->prompt_logprobs_.size());
    for (size_t i = 0; i < again->prompt_logprobs_.size(); ++i) {
        EXPECT_NEAR(again->prompt_logprobs_[i].logprob, sink->prompt_logprobs_[i].logprob, 1e-5);
    }
    // Without prompt logprobs the cache serves it, and no scores come.
    auto plain = Run(prompt, 1, -1);
    EXPECT_GT(plain->usage_.cached_tokens, 0);
    EXPECT_EQ(plain->prompt_deltas_, 0);
    engine_->Stop();  // its last publish follows the last request's end
    const kv::BlockManagerStats b = engine_->BlockStats();
    EXPECT_EQ(b.num_used_blocks, 0);
    EXPECT_EQ(b.num_free_blocks + b.num_cached_blocks, b.num_blocks);
}

TEST_F(PromptLogprobsEngine, GeneratedLogprobsEqualThePromptLogprobsOfTheSameTokens) {
    if (!engine_) return;
    std::vector<int32_t> prompt = Prompt();
    // n = 2 greedy choices: the scores come once, before any token of either.
    auto gen = Run(prompt, 8, 0, /*logprobs=*/0, /*n=*/2);
    ASSERT_TRUE(gen->status_.ok()) << gen->status_.ToString();
    EXPECT_EQ(gen->prompt_deltas_, 1);
    EXPECT_EQ(gen->tokens_before_prompt_logprobs_, 0);
    ASSERT_EQ(gen->ids_[0].size(), 8u);
    EXPECT_EQ(gen->ids_[1], gen->ids_[0]);
    std::vector<float> generated;
    for (const GeneratedTokenLogprob& t : gen->logprobs_) {
        if (generated.size() < 8 && t.token_id == gen->ids_[0][generated.size()])
            generated.push_back(t.logprob);
    }
    const size_t prompt_len = prompt.size();
    prompt.insert(prompt.end(), gen->ids_[0].begin(), gen->ids_[0].end());
    auto echo = Run(prompt, 0, 0);
    ASSERT_EQ(echo->prompt_logprobs_.size(), prompt.size() - 1);
    for (size_t i = 0; i < 8; ++i) {
        const PromptTokenLogprob& s = echo->prompt_logprobs_[prompt_len - 1 + i];
        EXPECT_EQ(s.token_id, gen->ids_[0][i]);
        EXPECT_EQ(s.rank, 1) << "greedy token " << i;
        EXPECT_NEAR(s.logprob, generated[i], 1e-4) << "token " << i;
    }
}

}  // namespace
}  // namespace kvshard
