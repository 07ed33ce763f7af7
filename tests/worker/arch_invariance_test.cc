// The forward-pass invariances of model_runner_test.cc for the architectures past Llama, on their
// synthetic models (model/synthetic_gguf.h: qwen2's biases, qwen3's q/k norms, mistral's window
// of 8, gemma3's local layers with a window of 6 and MQA): the paged KV cache gives the tokens of
// recomputing everything (no cache), several sequences in one step give the logits each gets
// alone, and a prompt in chunks gives the logits of one pass. The prompts are longer than the
// windows, so the windowed layers mask in both the cached and the recomputed passes.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "model/synthetic_gguf.h"
#include "tests/test_util.h"
#include "worker/generator.h"
#include "worker/local_model.h"
#include "worker/sequence_slots.h"

namespace kvshard {
namespace {

float MaxAbsDiff(const float* a, const float* b, int64_t n) {
    float m = 0;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
    return m;
}

std::vector<int32_t> Prompt(int length, int salt) {
    std::vector<int32_t> p;
    for (int i = 0; i < length; ++i) p.push_back(3 + (i * 41 + salt * 17) % 250);
    return p;
}

class ArchRunnerInvariance : public ::testing::TestWithParam<const char*> {
  protected:
    void SetUp() override {
        const std::string path = dir_.File(std::string(GetParam()) + ".gguf");
        ASSERT_TRUE(SyntheticArchGguf(GetParam()).WriteFile(path).ok());
        LocalModelOptions lo;
        lo.runner.max_context = 128;
        Result<LocalModel> m = LoadLocalModel(path, lo);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        model_ = std::make_unique<LocalModel>(std::move(*m));
    }
    testing::TempDir dir_;
    std::unique_ptr<LocalModel> model_;
};

TEST_P(ArchRunnerInvariance, CachedAndUncachedAgree) {
    ASSERT_NE(model_, nullptr);
    const std::vector<int32_t> prompt = Prompt(10, 1);
    GenerateOptions o;
    o.max_tokens = 20;  // no stop tokens: exactly 20 tokens, past both windows
    Result<GenerateResult> cached = Generate(*model_->runner, *model_->tokenizer, prompt, o);
    o.use_kv_cache = false;
    Result<GenerateResult> uncached = Generate(*model_->runner, *model_->tokenizer, prompt, o);
    ASSERT_TRUE(cached.ok()) << cached.status().ToString();
    ASSERT_TRUE(uncached.ok()) << uncached.status().ToString();
    EXPECT_EQ(cached->token_ids.size(), 20u);
    EXPECT_EQ(cached->token_ids, uncached->token_ids);
    EXPECT_EQ(cached->tokens_processed, 20 + 9);
}

TEST_P(ArchRunnerInvariance, BatchedAndChunkedEqualAlone) {
    ASSERT_NE(model_, nullptr);
    ModelRunner& runner = *model_->runner;
    const int64_t vocab = runner.spec().vocab_size;
    const std::vector<std::vector<int32_t>> prompts = {Prompt(9, 2), Prompt(1, 3), Prompt(23, 4)};
    FixedBlockTables tables(4, 32, runner.pool()->config().block_size,
                            runner.kv_groups().num_groups());
    ASSERT_LE(tables.num_blocks(), runner.pool()->config().num_blocks);
    std::vector<std::vector<float>> alone;
    for (size_t i = 0; i < prompts.size(); ++i) {
        SequenceChunk c{.seq_id = 100 + int64_t(i), .tokens = prompts[i], .start_pos = 0};
        tables.Place(int64_t(i), &c);
        std::vector<float> logits;
        ASSERT_TRUE(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).ok());
        alone.push_back(logits);
    }
    std::vector<SequenceChunk> batch;
    for (size_t i = 0; i < prompts.size(); ++i) {
        batch.push_back({.seq_id = int64_t(i), .tokens = prompts[i], .start_pos = 0});
        tables.Place(int64_t(i), &batch.back());
    }
    std::vector<float> batched;
    ASSERT_TRUE(runner.Forward(batch, &batched).ok());
    for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_LT(MaxAbsDiff(&batched[i * vocab], alone[i].data(), vocab), 1e-3f)
            << "sequence " << i;
    }
    // The longest prompt in chunks of 5, each crossing a window's edge.
    const std::vector<int32_t>& p = prompts[2];
    std::vector<float> logits;
    for (size_t pos = 0; pos < p.size(); pos += 5) {
        const size_t n = std::min<size_t>(5, p.size() - pos);
        SequenceChunk c{.seq_id = 9,
                        .tokens = std::span<const int32_t>(p).subspan(pos, n),
                        .start_pos = int64_t(pos)};
        tables.Place(3, &c);
        ASSERT_TRUE(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).ok());
    }
    EXPECT_LT(MaxAbsDiff(logits.data(), alone[2].data(), vocab), 1e-3f);
}

INSTANTIATE_TEST_SUITE_P(Architectures, ArchRunnerInvariance,
                         ::testing::Values("qwen2", "qwen3", "mistral", "gemma3"));

}  // namespace
}  // namespace kvshard
