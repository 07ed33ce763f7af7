// Invariance of the forward pass: cached vs recomputed, alone vs batched, one chunk vs several.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "worker/generator.h"
#include "worker/local_model.h"
#include "worker/sequence_slots.h"

namespace kvshard {
namespace {

using testing::DefaultModel;
using testing::SharedModel;

float MaxAbsDiff(const float* a, const float* b, int64_t n) {
    float m = 0;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(a[i] - b[i]));
    return m;
}

struct ModelCase {
    const char* name;
    bool is_default;
};

std::string PathOf(const ModelCase& c) {
    return c.is_default ? DefaultModel() : SharedModel(c.name);
}

class RunnerInvariance : public ::testing::TestWithParam<ModelCase> {
  protected:
    void SetUp() override {
        const std::string path = PathOf(GetParam());
        KV_REQUIRE_FIXTURE(path, GetParam().name);
        Result<LocalModel> m = LoadLocalModel(path);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        model_ = std::make_unique<LocalModel>(std::move(*m));
    }
    std::unique_ptr<LocalModel> model_;
};

// --no-kv-cache recomputes everything and must give the same tokens; for an 8-token prompt and L
// generated tokens it pushes 8L + L(L-1)/2 positions through the network against L + 7 cached.
TEST_P(RunnerInvariance, CachedAndUncachedAgree) {
    if (!model_) return;
    std::vector<int32_t> prompt = model_->EncodePrompt("One day a little fox found a shiny");
    prompt.resize(8, prompt.back());
    ASSERT_EQ(prompt.size(), 8u);
    GenerateOptions o;
    o.max_tokens = 24;  // no stop tokens: exactly L tokens
    Result<GenerateResult> cached = Generate(*model_->runner, *model_->tokenizer, prompt, o);
    o.use_kv_cache = false;
    Result<GenerateResult> uncached = Generate(*model_->runner, *model_->tokenizer, prompt, o);
    ASSERT_TRUE(cached.ok() && uncached.ok());
    const int64_t L = 24;
    EXPECT_EQ(cached->token_ids, uncached->token_ids);
    EXPECT_EQ(cached->tokens_processed, L + 7);
    EXPECT_EQ(uncached->tokens_processed, 8 * L + L * (L - 1) / 2);
}

// Several sequences of different lengths in one step give the logits each gets alone, and a
// prompt computed in chunks gives the logits of one pass.
TEST_P(RunnerInvariance, BatchedAndChunkedEqualAlone) {
    if (!model_) return;
    ModelRunner& runner = *model_->runner;
    const int64_t vocab = runner.spec().vocab_size;
    const std::vector<std::vector<int32_t>> prompts = {
        model_->EncodePrompt("The cat sat on the mat and looked"),
        model_->EncodePrompt("Tom"),
        model_->EncodePrompt("Once upon a time there was a big old tree in a quiet forest"),
    };
    // Each sequence in its own blocks of the runner's pool.
    FixedBlockTables tables(4, 32, runner.pool()->config().block_size);
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

    // Chunked prefill: the third prompt in pieces of 3 tokens.
    const std::vector<int32_t>& p = prompts[2];
    std::vector<float> logits;
    for (size_t pos = 0; pos < p.size(); pos += 3) {
        const size_t n = std::min<size_t>(3, p.size() - pos);
        SequenceChunk c{.seq_id = 9,
                        .tokens = std::span<const int32_t>(p).subspan(pos, n),
                        .start_pos = int64_t(pos)};
        tables.Place(3, &c);
        ASSERT_TRUE(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).ok());
    }
    EXPECT_LT(MaxAbsDiff(logits.data(), alone[2].data(), vocab), 1e-3f);
}

TEST_P(RunnerInvariance, RejectsBadChunksWithoutChangingState) {
    if (!model_) return;
    ModelRunner& runner = *model_->runner;
    std::vector<float> logits;
    const int64_t bs = runner.pool()->config().block_size;
    FixedBlockTables tables(1, 2 * bs, bs);
    const std::vector<int32_t> good = {1, 2, 3};
    const std::vector<int32_t> bad = {1, int32_t(runner.spec().vocab_size)};
    SequenceChunk c{.seq_id = 1, .tokens = bad, .start_pos = 0};
    tables.Place(0, &c);
    EXPECT_EQ(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).code(),
              StatusCode::kInvalidArgument);
    // A chunk without a block table, and one whose slots are not its positions' slots.
    c = {.seq_id = 1, .tokens = good, .start_pos = 0};
    EXPECT_EQ(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).code(),
              StatusCode::kInvalidArgument);
    tables.Place(0, &c);
    c.start_pos = 2;
    EXPECT_EQ(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).code(),
              StatusCode::kInvalidArgument);
    std::vector<int32_t> too_long(static_cast<size_t>(runner.max_context()) + 1, 1);
    c = {.seq_id = 1, .tokens = too_long, .start_pos = 0};
    EXPECT_EQ(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).code(),
              StatusCode::kOutOfRange);
    EXPECT_EQ(runner.tokens_processed(), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, RunnerInvariance,
                         ::testing::Values(ModelCase{"stories260K/stories260K.bin", false},
                                           ModelCase{"SmolLM2-135M-Instruct.Q4_1.gguf", true}),
                         [](const auto& info) {
                             return info.param.is_default ? "SmolLM2" : "Stories260K";
                         });

}  // namespace
}  // namespace kvshard
