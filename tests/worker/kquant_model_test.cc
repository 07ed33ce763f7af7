// The default model quantized to K-quants by llama.cpp (scripts/make-kquant-models writes
// models/SmolLM2-135M-Instruct.{Q4_K_M,Q6_K}.gguf) loads and generates; greedy tokens and the
// first position's log-probabilities are compared with llama.cpp's on the same file
// (tests/golden/kquant_llamacpp.json, made by tests/golden/make_kquant_llamacpp.py).
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
#include "worker/generator.h"
#include "worker/local_model.h"
#include "worker/sequence_slots.h"

namespace kvshard {
namespace {

std::string KQuantModel(const std::string& name) {
    const std::filesystem::path p = std::filesystem::path(KVSHARD_SOURCE_DIR) / "models" / name;
    return std::filesystem::exists(p) ? p.string() : "";
}

class KQuantVsLlamaCpp : public ::testing::TestWithParam<const char*> {};

TEST_P(KQuantVsLlamaCpp, GreedyTokensAgreeWithLlamaCpp) {
    const std::string name = GetParam();
    const std::string path = KQuantModel(name);
    KV_REQUIRE_FIXTURE(path, name + " (run scripts/make-kquant-models)");
    Result<LocalModel> m = LoadLocalModel(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    std::ifstream in(std::string(KVSHARD_SOURCE_DIR) + "/tests/golden/kquant_llamacpp.json");
    ASSERT_TRUE(in.good());
    const nlohmann::json golden = nlohmann::json::parse(in);
    const nlohmann::json& cases = golden["models"][name];
    ASSERT_FALSE(cases.empty());
    ModelRunner& runner = *m->runner;

    int64_t same = 0, total = 0, first_same = 0, whole_same = 0;
    double max_logprob_err = 0;
    for (const auto& c : cases) {
        const std::vector<int32_t> prompt = c["prompt_token_ids"];
        const std::vector<int32_t> want = c["greedy_token_ids"];
        SCOPED_TRACE(c["prompt"].get<std::string>());

        // Log-probabilities at the last prompt position against llama.cpp's top 10.
        SequenceChunk chunk{
            .seq_id = 1, .tokens = prompt, .start_pos = 0, .block_table = {}, .slot_mapping = {}};
        FixedBlockTables tables(1, int64_t(prompt.size()), runner.pool()->config().block_size,
                                runner.kv_groups().num_groups());
        tables.Place(0, &chunk);
        std::vector<float> logits;
        ASSERT_TRUE(runner.Forward(std::span<const SequenceChunk>(&chunk, 1), &logits).ok());
        const float top = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        for (float l : logits) sum += std::exp(double(l) - top);
        const double log_z = top + std::log(sum);
        for (const auto& pair : c["first_top_logprobs"]) {
            const size_t id = pair[0];
            max_logprob_err =
                std::max(max_logprob_err, std::fabs(logits.at(id) - log_z - double(pair[1])));
        }

        GenerateOptions o;
        o.max_tokens = golden["new_tokens"];
        o.stop_token_ids = m->StopTokenIds();
        Result<GenerateResult> r = Generate(runner, *m->tokenizer, prompt, o);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        const std::vector<int32_t>& got = r->token_ids;
        // Agreement: the common prefix (after a parting, the contexts differ).
        size_t prefix = 0;
        while (prefix < got.size() && prefix < want.size() && got[prefix] == want[prefix]) {
            ++prefix;
        }
        same += int64_t(prefix);
        total += int64_t(want.size());
        first_same += !got.empty() && !want.empty() && got[0] == want[0] ? 1 : 0;
        whole_same += got == want ? 1 : 0;
    }
    const int64_t n = int64_t(cases.size());
    std::printf(
        "%s: first token %lld/%lld, whole continuation %lld/%lld, common-prefix tokens "
        "%lld/%lld (%.0f%%), max |logprob - llama.cpp| over its top 10 %.4f\n",
        name.c_str(), (long long)first_same, (long long)n, (long long)whole_same, (long long)n,
        (long long)same, (long long)total, 100.0 * double(same) / double(total), max_logprob_err);
    // llama.cpp quantizes the activations to 8 bits (Q8_K / Q8_0) for these products; kvshard
    // keeps fp32 (its fp32 arithmetic matches llama.cpp's on F32 weights to ~1e-3 of the logits,
    // reference_output_test). Observed: first token 8/8 on both files, max logprob error 0.52
    // (Q4_K_M) and 0.37 (Q6_K), common-prefix tokens 51% and 41% (greedy paths part at
    // near-ties and then differ). A wrong block layout gives unrelated tokens from the first.
    EXPECT_EQ(first_same, n);
    EXPECT_LT(max_logprob_err, 0.8);
    EXPECT_GE(double(same), 0.3 * double(total));
}

INSTANTIATE_TEST_SUITE_P(Files, KQuantVsLlamaCpp,
                         ::testing::Values("SmolLM2-135M-Instruct.Q4_K_M.gguf",
                                           "SmolLM2-135M-Instruct.Q6_K.gguf"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                             std::string s = info.param;
                             s = s.substr(s.find('.') + 1);
                             s = s.substr(0, s.find('.'));
                             return s;
                         });

}  // namespace
}  // namespace kvshard
