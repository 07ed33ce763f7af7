// Prompt logprobs in the worker (worker/prompt_logprobs.h, ModelRunner's all_logits, StepRunner):
// a prompt token's score is a full log-softmax of the logits of the position before it (checked
// in double against the rows the runner classifies, which match a token-by-token decode's);
// chunked prefill, with the next chunk's first token scored from the last row, scores what one
// pass does; rows are classified in slices of max_step_seqs; tp 2 scores what tp 1 does.
#include "worker/prompt_logprobs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "worker/model_runner.h"
#include "worker/step_runner.h"
#include "worker/tp_group.h"

namespace kvshard {
namespace {

using testing::SharedModel;

constexpr int64_t kBlockSize = 16;
constexpr int kTopK = 5;

TEST(ScorePromptToken, RankLogprobAndTopKOfOneRow) {
    const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 0.0f, -2.0f};
    const double lse = std::log(std::exp(1.0) + 2 * std::exp(3.0) + 1.0 + std::exp(-2.0));
    std::vector<int32_t> ids;
    struct Case {
        int32_t target;
        int32_t top_k;
        int64_t rank;                  // 1 + the tokens strictly more likely
        std::vector<int32_t> top_ids;  // ties by lower id
    };
    for (const Case& c : {Case{0, 2, 3, {1, 2}}, Case{2, 0, 1, {}}, Case{4, 3, 5, {1, 2, 0}},
                          Case{3, 9, 4, {1, 2, 0, 3, 4}}}) {
        const PromptTokenLogprob s = ScorePromptToken(logits.data(), 5, c.target, c.top_k, &ids);
        EXPECT_EQ(s.token_id, c.target);
        EXPECT_NEAR(s.logprob, logits[c.target] - lse, 1e-6) << c.target;
        EXPECT_EQ(s.rank, c.rank) << c.target;
        std::vector<int32_t> top_ids;
        for (const TokenLogprob& t : s.top) {
            top_ids.push_back(t.token_id);
            EXPECT_NEAR(t.logprob, logits[t.token_id] - lse, 1e-6);
        }
        EXPECT_EQ(top_ids, c.top_ids) << c.target;
    }
}

std::vector<int32_t> Prompt() {
    std::vector<int32_t> p = {1};
    for (int i = 0; i < 37; ++i) p.push_back(static_cast<int32_t>((i * 37 + 11) % 500 + 3));
    return p;
}

// The plan of one chunk [begin, end) of `prompt` for sequence `seq_id`, in blocks 0..3.
ScheduledSequence PromptChunk(const std::vector<int32_t>& prompt, int64_t seq_id, int64_t begin,
                              int64_t end, int32_t top_k) {
    ScheduledSequence q;
    q.seq_id = seq_id;
    q.start_pos = begin;
    q.token_ids.assign(prompt.begin() + begin, prompt.begin() + end);
    q.block_table = {0, 1, 2, 3};
    for (int64_t p = begin; p < end; ++p) q.slot_mapping.push_back(p);
    q.sample = end == static_cast<int64_t>(prompt.size());
    q.num_prompt_logprobs = top_k;
    q.next_prompt_token = end < static_cast<int64_t>(prompt.size()) ? prompt[end] : -1;
    return q;
}

// Scores `prompt` through `executor` in chunks of `chunk` tokens; the positions come back whole
// and in order.
std::vector<PromptTokenLogprob> ScoreInChunks(StepExecutor& executor,
                                              const std::vector<int32_t>& prompt, int64_t chunk,
                                              int64_t seq_id) {
    std::vector<PromptTokenLogprob> out;
    const auto len = static_cast<int64_t>(prompt.size());
    for (int64_t begin = 0; begin < len; begin += chunk) {
        StepPlan plan;
        plan.sequences.push_back(
            PromptChunk(prompt, seq_id, begin, std::min(len, begin + chunk), kTopK));
        Result<StepResult> r = executor.Execute(plan);
        EXPECT_TRUE(r.ok()) << r.status().ToString();
        if (!r.ok()) return out;
        // A one-token last chunk predicts no prompt token: it reports nothing.
        const bool predicts = std::min(len, begin + chunk) - begin > 1 || begin + chunk < len;
        EXPECT_EQ(r->prompt_logprobs.size(), predicts ? 1u : 0u);
        for (const PromptLogprobs& p : r->prompt_logprobs) {
            EXPECT_EQ(p.seq_id, seq_id);
            EXPECT_EQ(p.first_pos, static_cast<int64_t>(out.size()) + 1);
            out.insert(out.end(), p.tokens.begin(), p.tokens.end());
        }
    }
    EXPECT_EQ(static_cast<int64_t>(out.size()), len - 1);
    return out;
}

void ExpectSameScores(const std::vector<PromptTokenLogprob>& got,
                      const std::vector<PromptTokenLogprob>& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].token_id, want[i].token_id) << what << " position " << i + 1;
        EXPECT_NEAR(got[i].logprob, want[i].logprob, 1e-4) << what << " position " << i + 1;
        // Deep in the tail (stories260K ranks some prompt tokens ~400th of 512) logits lie within
        // float rounding of each other, and another summation order may swap neighbours there.
        EXPECT_NEAR(got[i].rank, want[i].rank, want[i].rank / 50) << what << " position " << i + 1;
        ASSERT_EQ(got[i].top.size(), want[i].top.size()) << what;
        for (size_t k = 0; k < got[i].top.size(); ++k) {
            EXPECT_EQ(got[i].top[k].token_id, want[i].top[k].token_id) << what;
            EXPECT_NEAR(got[i].top[k].logprob, want[i].top[k].logprob, 1e-4) << what;
        }
    }
}

class PromptLogprobsModel : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string path = SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(path, "stories260K.bin");
        Result<std::unique_ptr<ModelFile>> f = OpenModel(path);
        ASSERT_TRUE(f.ok()) << f.status().ToString();
        file_ = std::move(*f);
    }
    // Slices of 4 rows: a 38-token chunk is classified in 10 slices.
    RunnerOptions Options() const {
        RunnerOptions o;
        o.max_context = 64;
        o.num_kv_blocks = 8;
        o.block_size = kBlockSize;
        o.max_step_tokens = 64;
        o.max_step_seqs = 4;
        return o;
    }
    std::unique_ptr<ModelFile> file_;
};

TEST_F(PromptLogprobsModel, ScoresAreAFullSoftmaxOfTheRowsLogits) {
    Result<std::unique_ptr<ModelRunner>> runner = MakeModelRunner(*file_, {}, Options());
    ASSERT_TRUE(runner.ok()) << runner.status().ToString();
    const std::vector<int32_t> prompt = Prompt();
    const auto len = static_cast<int64_t>(prompt.size());
    const int64_t vocab = (*runner)->spec().vocab_size;

    // Every row's logits, as the runner hands them out, slice by slice.
    std::vector<float> rows(static_cast<size_t>(len * vocab), 0.0f);
    std::vector<int64_t> slice_sizes;
    ScheduledSequence q = PromptChunk(prompt, 1, 0, len, kTopK);
    q.num_top_logprobs = 0;
    SequenceChunk chunk{.seq_id = 1,
                        .tokens = q.token_ids,
                        .start_pos = 0,
                        .block_table = q.block_table,
                        .slot_mapping = q.slot_mapping,
                        .all_logits = true};
    std::vector<float> last;
    ASSERT_TRUE((*runner)
                    ->Forward(std::span<const SequenceChunk>(&chunk, 1), &last, {},
                              [&](size_t c, int64_t first, int64_t n, const float* logits) {
                                  EXPECT_EQ(c, 0u);
                                  slice_sizes.push_back(n);
                                  std::copy(logits, logits + n * vocab, &rows[first * vocab]);
                              })
                    .ok());
    EXPECT_EQ(slice_sizes.size(), 10u);  // ceil(38 / 4)
    EXPECT_LE(*std::max_element(slice_sizes.begin(), slice_sizes.end()), 4);
    // The last row is the one Forward returns for sampling.
    EXPECT_TRUE(std::equal(last.begin(), last.end(), rows.end() - vocab));

    // Each row equals the logits of a token-by-token decode at that position (sequence 2).
    for (int64_t p = 0; p < len; ++p) {
        const ScheduledSequence one = PromptChunk(prompt, 2, p, p + 1, -1);
        std::vector<int32_t> table = {4, 5, 6, 7};
        std::vector<int64_t> slot = {4 * kBlockSize + p};
        SequenceChunk c{.seq_id = 2,
                        .tokens = one.token_ids,
                        .start_pos = p,
                        .block_table = table,
                        .slot_mapping = slot};
        std::vector<float> logits;
        ASSERT_TRUE((*runner)->Forward(std::span<const SequenceChunk>(&c, 1), &logits).ok());
        double max_diff = 0, max_abs = 0;
        for (int64_t v = 0; v < vocab; ++v) {
            max_diff = std::max(max_diff, std::fabs(double(logits[v]) - rows[p * vocab + v]));
            max_abs = std::max(max_abs, std::fabs(double(logits[v])));
        }
        EXPECT_LT(max_diff / max_abs, 1e-4) << "position " << p;
    }

    // The StepRunner's scores against a double-precision log-softmax of those rows.
    StepRunner steps(**runner);
    StepPlan plan;
    plan.sequences.push_back(q);
    Result<StepResult> r = steps.Execute(plan);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->prompt_logprobs.size(), 1u);
    const std::vector<PromptTokenLogprob>& got = r->prompt_logprobs[0].tokens;
    ASSERT_EQ(static_cast<int64_t>(got.size()), len - 1);
    for (int64_t p = 1; p < len; ++p) {
        const float* row = &rows[(p - 1) * vocab];
        const double max = *std::max_element(row, row + vocab);
        double sum = 0;
        for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - max);
        const double lse = max + std::log(sum);
        const int32_t target = prompt[p];
        int64_t rank = 1;
        for (int64_t v = 0; v < vocab; ++v) rank += row[v] > row[target] ? 1 : 0;
        const PromptTokenLogprob& s = got[static_cast<size_t>(p - 1)];
        EXPECT_EQ(s.token_id, target);
        EXPECT_NEAR(s.logprob, row[target] - lse, 1e-5) << "position " << p;
        EXPECT_EQ(s.rank, rank) << "position " << p;
        ASSERT_EQ(s.top.size(), static_cast<size_t>(kTopK));
        EXPECT_EQ(s.top[0].token_id, std::max_element(row, row + vocab) - row);
        for (size_t k = 0; k < s.top.size(); ++k) {
            EXPECT_NEAR(s.top[k].logprob, row[s.top[k].token_id] - lse, 1e-5);
            if (k > 0) {
                EXPECT_GE(s.top[k - 1].logprob, s.top[k].logprob);
            }
        }
    }
    // A sampled token is scored alike: the greedy sample of the last row carries the logprob a
    // full softmax of that row gives it (what the API's echo invariance rests on).
    ASSERT_EQ(r->tokens.size(), 1u);
    const float* row = &rows[(len - 1) * vocab];
    const double max = *std::max_element(row, row + vocab);
    double sum = 0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - max);
    EXPECT_EQ(r->tokens[0].token_id, std::max_element(row, row + vocab) - row);
    EXPECT_NEAR(r->tokens[0].logprob, max - (max + std::log(sum)), 1e-5);
}

TEST_F(PromptLogprobsModel, ChunkedPrefillScoresWhatOnePassDoes) {
    Result<std::unique_ptr<ModelRunner>> runner = MakeModelRunner(*file_, {}, Options());
    ASSERT_TRUE(runner.ok()) << runner.status().ToString();
    StepRunner steps(**runner);
    const std::vector<int32_t> prompt = Prompt();
    const std::vector<PromptTokenLogprob> one_pass =
        ScoreInChunks(steps, prompt, static_cast<int64_t>(prompt.size()), 1);
    for (int64_t chunk : {1, 7, 16}) {
        ExpectSameScores(ScoreInChunks(steps, prompt, chunk, 10 + chunk), one_pass,
                         "chunks of " + std::to_string(chunk));
    }
}

TEST_F(PromptLogprobsModel, TensorParallelScoresWhatOneRankDoes) {
    Result<std::unique_ptr<ModelRunner>> runner = MakeModelRunner(*file_, {}, Options());
    ASSERT_TRUE(runner.ok()) << runner.status().ToString();
    StepRunner steps(**runner);
    const std::vector<int32_t> prompt = Prompt();
    const std::vector<PromptTokenLogprob> tp1 = ScoreInChunks(steps, prompt, 16, 1);
    Result<std::unique_ptr<TpGroup>> group =
        TpGroup::Create(*file_, {.tp = 2, .runner = Options()});
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    ExpectSameScores(ScoreInChunks(**group, prompt, 16, 1), tp1, "tp 2");
}

TEST_F(PromptLogprobsModel, RefusesABadRequestByName) {
    Result<std::unique_ptr<ModelRunner>> runner = MakeModelRunner(*file_, {}, Options());
    ASSERT_TRUE(runner.ok()) << runner.status().ToString();
    StepRunner steps(**runner);
    const std::vector<int32_t> prompt = Prompt();
    StepPlan plan;
    plan.sequences.push_back(PromptChunk(prompt, 1, 0, 8, kMaxLogprobs + 1));
    EXPECT_NE(steps.Execute(plan).status().message().find("num_prompt_logprobs"),
              std::string::npos);
    plan.sequences[0].num_prompt_logprobs = 1;
    plan.sequences[0].next_prompt_token = 1 << 20;
    EXPECT_NE(steps.Execute(plan).status().message().find("next_prompt_token"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
