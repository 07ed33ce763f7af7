// Tensor parallelism must not change results (DESIGN.md "Tensor-parallel rules"): greedy tokens at
// tp N equal tp 1's, logits agree within a relative tolerance, for stories260K (tp 2, 4), the
// default model (tp 2 with its uneven head split, tp 3), a synthetic model with the attention
// geometry of a 70B-class Llama (64 query heads, 8 KV heads; tp 2, 4, 8, 16 with KV heads
// replicated past 8), a Hugging Face folder, and the synthetic qwen2/qwen3/mistral/gemma3 models. Also: the bytes all-reduced per step, and the
// embedded group as a StepExecutor.
//
// Tolerance: tp N adds each row-parallel product's partial sums in another order than tp 1, so
// logits differ by float rounding only. Measured max |tp N - tp 1| / max |tp 1| over a prompt's
// logits: 3e-7 (stories260K), 1e-6 (SmolLM2 at tp 2 and 3, the synthetic model up to tp 16); the
// bound is 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/local_collective.h"
#include "model/hf_export.h"
#include "model/synthetic_gguf.h"
#include "tests/test_util.h"
#include "worker/generator.h"
#include "worker/model_runner.h"
#include "worker/sequence_slots.h"
#include "worker/step_runner.h"
#include "worker/tp_group.h"

namespace kvshard {
namespace {

using testing::DefaultModel;
using testing::SharedModel;
using testing::TempDir;

constexpr double kLogitRelTolerance = 1e-5;

double RelativeDiff(const std::vector<float>& a, const std::vector<float>& b) {
    double max_diff = 0, max_abs = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        max_diff = std::max(max_diff, std::fabs(double(a[i]) - double(b[i])));
        max_abs = std::max(max_abs, std::fabs(double(a[i])));
    }
    return max_abs > 0 ? max_diff / max_abs : max_diff;
}

size_t Distinct(std::vector<int32_t> v) {
    std::sort(v.begin(), v.end());
    return static_cast<size_t>(std::unique(v.begin(), v.end()) - v.begin());
}

struct Outcome {
    std::vector<float> prompt_logits;  // rank 0's, after the whole prompt in one chunk
    std::vector<int32_t> greedy;       // Generate through the paged pool
};

// Loads `model` as `tp` ranks of an embedded group and runs the prompt once for its logits and
// once through Generate.
Outcome RunAtTp(const ModelFile& model, int tp, const std::vector<int32_t>& prompt,
                int64_t max_tokens) {
    Outcome out;
    TpGroupConfig c{.tp = tp};
    c.runner.max_context = 256;
    c.runner.num_kv_blocks = RunnerOptions::kOneSequence;
    c.runner.block_size = 16;
    Result<std::unique_ptr<TpGroup>> group = TpGroup::Create(model, c);
    EXPECT_TRUE(group.ok()) << group.status().ToString();
    if (!group.ok()) return out;
    Status st = (*group)->RunOnEveryRank([&](int rank, ModelRunner& runner) -> Status {
        SequenceChunk chunk{.seq_id = 9, .tokens = prompt, .start_pos = 0};
        FixedBlockTables tables(1, int64_t(prompt.size()), 16, runner.kv_groups().num_groups());
        tables.Place(0, &chunk);
        std::vector<float> logits;
        KV_RETURN_IF_ERROR(runner.Forward(std::span<const SequenceChunk>(&chunk, 1), &logits));
        if (rank == 0) out.prompt_logits = std::move(logits);
        return Status::Ok();
    });
    EXPECT_TRUE(st.ok()) << st.ToString();
    Result<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(model.tokenizer_data());
    EXPECT_TRUE(tok.ok());
    GenerateOptions g;
    g.max_tokens = max_tokens;  // no stop tokens: exactly max_tokens
    Result<GenerateResult> r = GenerateOnEveryRank(**group, **tok, prompt, g);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok()) out.greedy = r->token_ids;
    return out;
}

void ExpectSameAsTp1(const ModelFile& model, const std::vector<int>& tps,
                     const std::vector<int32_t>& prompt, int64_t max_tokens) {
    const Outcome ref = RunAtTp(model, 1, prompt, max_tokens);
    ASSERT_EQ(static_cast<int64_t>(ref.greedy.size()), max_tokens);
    for (int tp : tps) {
        const Outcome o = RunAtTp(model, tp, prompt, max_tokens);
        EXPECT_EQ(o.greedy, ref.greedy) << "tp " << tp;
        ASSERT_EQ(o.prompt_logits.size(), ref.prompt_logits.size());
        const double rel = RelativeDiff(o.prompt_logits, ref.prompt_logits);
        EXPECT_LT(rel, kLogitRelTolerance) << "tp " << tp;
        std::printf(
            "[ tp %2d ] %s: %zu greedy tokens (%zu distinct) equal tp 1's: %s; logits max "
            "rel diff %.2e\n",
            tp, model.path().c_str(), ref.greedy.size(), Distinct(ref.greedy),
            o.greedy == ref.greedy ? "yes" : "NO", rel);
    }
}

std::unique_ptr<ModelFile> Open(const std::string& path) {
    Result<std::unique_ptr<ModelFile>> f = OpenModel(path);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? std::move(*f) : nullptr;
}

TEST(TpInvariance, Stories260KAtTp2And4) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    std::unique_ptr<ModelFile> f = Open(path);
    ASSERT_NE(f, nullptr);
    ExpectSameAsTp1(*f, {2, 4}, {1, 403, 407, 261, 378}, 48);
}

TEST(TpInvariance, HuggingFaceFolderAtTp2) {
    const std::string src = SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(src, "stories260K.gguf");
    TempDir dir;
    std::unique_ptr<ModelFile> original = Open(src);
    ASSERT_NE(original, nullptr);
    ASSERT_TRUE(ExportHuggingFace(*original, dir.path(), {.dtype = DType::kBF16}).ok());
    std::unique_ptr<ModelFile> hf = Open(dir.path());
    ASSERT_NE(hf, nullptr);
    ExpectSameAsTp1(*hf, {2}, {1, 403, 407, 261, 378}, 24);
}

// SmolLM2: 9 query heads and 3 KV heads, so tp 2 splits KV head 1's group between the ranks.
TEST(TpInvariance, DefaultModelAtTp2And3) {
    const std::string path = DefaultModel();
    KV_REQUIRE_FIXTURE(path, "the default model (scripts/fetch-model)");
    std::unique_ptr<ModelFile> f = Open(path);
    ASSERT_NE(f, nullptr);
    // "The capital of France is" in SmolLM2's tokenizer.
    Result<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(f->tokenizer_data());
    ASSERT_TRUE(tok.ok());
    const std::vector<int32_t> prompt = (*tok)->Encode("The capital of France is", {});
    ASSERT_FALSE(prompt.empty());
    ExpectSameAsTp1(*f, {2, 3}, prompt, 6);
}

// The attention geometry of Llama 3 70B (64 query heads, 8 KV heads) at toy sizes, in a real
// GGUF file with Q4_1 weights: at tp 16 each KV head lives on two ranks.
ModelSpec Llama70BGeometry() {
    ModelSpec s;
    s.num_layers = 2;
    s.hidden_size = 256;
    s.num_heads = 64;
    s.num_kv_heads = 8;
    s.head_dim = 16;
    s.ffn_size = 512;
    s.vocab_size = 512;
    s.max_position = 256;
    s.rope_theta = 500000.0f;
    s.bos_token_id = 1;
    s.eos_token_id = 2;
    return s;
}

TEST(TpInvariance, Llama70BGeometryAtTp2To16) {
    TempDir dir;
    const std::string path = dir.File("llama70b-geometry.gguf");
    const SyntheticGgufOptions o{.weight_dtype = DType::kQ4_1, .seed = 7, .weight_scale = 0.5f};
    ASSERT_TRUE(SyntheticLlamaGguf(Llama70BGeometry(), o).WriteFile(path).ok());
    std::unique_ptr<ModelFile> f = Open(path);
    ASSERT_NE(f, nullptr);
    ExpectSameAsTp1(*f, {2, 4, 8, 16}, {1, 300, 301, 302, 17, 40, 41, 290}, 16);
}

// The architectures past Llama at tp 2: Qwen 2's biases sliced with their heads, Qwen 3's and
// Gemma 3's q/k norms on every rank, Gemma 3's single KV head replicated, Mistral's window.
TEST(TpInvariance, ArchitecturesAtTp2) {
    for (const char* arch : {"qwen2", "qwen3", "mistral", "gemma3"}) {
        SCOPED_TRACE(arch);
        TempDir dir;
        const std::string path = dir.File(std::string(arch) + ".gguf");
        ASSERT_TRUE(SyntheticArchGguf(arch).WriteFile(path).ok());
        std::unique_ptr<ModelFile> f = Open(path);
        ASSERT_NE(f, nullptr);
        std::vector<int32_t> prompt;
        for (int i = 0; i < 20; ++i) prompt.push_back(3 + (i * 53) % 250);
        ExpectSameAsTp1(*f, {2}, prompt, 12);
    }
}

// The layers all-reduce 2 × layers × hidden × tokens × 4 bytes per step, whatever the batch;
// the embedding's all-reduce and the logits' gather are counted apart. The communicator's own
// counter agrees.
TEST(TpCommVolume, TwoAllReducesPerLayer) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    std::unique_ptr<ModelFile> f = Open(path);
    ASSERT_NE(f, nullptr);
    const ModelSpec& s = f->spec();
    constexpr int kTp = 2;
    std::shared_ptr<LocalGroup> group = LocalGroup::Create(kTp);
    const std::vector<int32_t> a = {1, 403, 407, 261, 378}, b = {1, 300}, next = {5};
    std::vector<CommStats> prefill(kTp), decode(kTp);
    std::vector<int64_t> collective_bytes(kTp);
    std::vector<std::thread> threads;
    for (int r = 0; r < kTp; ++r) {
        threads.emplace_back([&, r] {
            std::unique_ptr<Collective> c = group->Collective(r);
            Result<std::unique_ptr<ModelRunner>> made =
                MakeModelRunner(*f, {.rank = r, .tp = kTp}, {}, c.get());
            ASSERT_TRUE(made.ok());
            ModelRunner& runner = **made;
            FixedBlockTables tables(2, 16, runner.pool()->config().block_size,
                                    runner.kv_groups().num_groups());
            std::vector<float> logits;
            std::vector<SequenceChunk> batch = {{.seq_id = 1, .tokens = a, .start_pos = 0},
                                                {.seq_id = 2, .tokens = b, .start_pos = 0}};
            tables.Place(0, &batch[0]);
            tables.Place(1, &batch[1]);
            ASSERT_TRUE(runner.Forward(batch, &logits).ok());
            prefill[r] = runner.comm_stats();
            batch = {{.seq_id = 1, .tokens = next, .start_pos = 5},
                     {.seq_id = 2, .tokens = next, .start_pos = 2}};
            tables.Place(0, &batch[0]);
            tables.Place(1, &batch[1]);
            ASSERT_TRUE(runner.Forward(batch, &logits).ok());
            decode[r] = runner.comm_stats();
            collective_bytes[r] = c->bytes_all_reduced();
        });
    }
    for (std::thread& t : threads) t.join();
    const int64_t per_token = 2 * s.num_layers * s.hidden_size * 4;
    const int64_t pad = (s.vocab_size + kTp - 1) / kTp;
    for (int r = 0; r < kTp; ++r) {
        EXPECT_EQ(prefill[r].layer_all_reduce_bytes, per_token * 7);  // 5 + 2 tokens
        EXPECT_EQ(prefill[r].embedding_all_reduce_bytes, s.hidden_size * 7 * 4);
        EXPECT_EQ(prefill[r].logits_all_gather_bytes, kTp * 2 * pad * 4);  // 2 outputs
        EXPECT_EQ(decode[r].layer_all_reduce_bytes - prefill[r].layer_all_reduce_bytes,
                  per_token * 2);
        EXPECT_EQ(collective_bytes[r],
                  decode[r].layer_all_reduce_bytes + decode[r].embedding_all_reduce_bytes);
    }
    std::printf(
        "[ tp 2 ] stories260K: layers all-reduce %lld bytes per token "
        "(2 x %lld layers x %lld hidden x 4)\n",
        static_cast<long long>(per_token), static_cast<long long>(s.num_layers),
        static_cast<long long>(s.hidden_size));
}

// Plans with two sequences (one greedy, one seeded top-p) through the paged pool, step by step:
// the group returns the tokens one StepRunner returns at tp 1; a bad plan fails on every rank
// alike and leaves the group usable.
// With `allowed_tokens`, every sample is held to that token mask (structured outputs); the
// sequences are then ids 10 and 11, whose samplers are not those of the unmasked runs.
std::vector<std::vector<int32_t>> RunPlans(StepExecutor& executor, int num_steps,
                                           const std::vector<uint64_t>& allowed_tokens = {}) {
    constexpr int64_t kBlockSize = 16;
    std::vector<std::vector<int32_t>> context = {{1, 403, 407, 261, 378}, {1, 300, 310}};
    std::vector<std::vector<int32_t>> generated(2);
    std::vector<int64_t> computed = {0, 0};
    for (int step = 0; step < num_steps; ++step) {
        StepPlan plan;
        plan.step_id = static_cast<uint64_t>(step);
        for (int s = 0; s < 2; ++s) {
            ScheduledSequence q;
            q.seq_id = allowed_tokens.empty() ? s : 10 + s;
            q.start_pos = computed[s];
            q.token_ids.assign(context[s].begin() + computed[s], context[s].end());
            q.block_table = {2 * s, 2 * s + 1};  // 32 positions each
            for (int64_t p = q.start_pos; p < static_cast<int64_t>(context[s].size()); ++p) {
                q.slot_mapping.push_back(q.block_table[p / kBlockSize] * kBlockSize +
                                         p % kBlockSize);
            }
            if (s == 1) q.sampling = {.temperature = 0.8f, .top_p = 0.9f, .seed = 42};
            q.allowed_tokens = allowed_tokens;
            plan.sequences.push_back(q);
        }
        Result<StepResult> r = executor.Execute(plan);
        EXPECT_TRUE(r.ok()) << r.status().ToString();
        if (!r.ok()) return generated;
        for (int s = 0; s < 2; ++s) {
            computed[s] = static_cast<int64_t>(context[s].size());
            context[s].push_back(r->tokens[s].token_id);
            generated[s].push_back(r->tokens[s].token_id);
        }
    }
    return generated;
}

TEST(TpGroupExecutor, StepsMatchOneRunner) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    std::unique_ptr<ModelFile> f = Open(path);
    ASSERT_NE(f, nullptr);
    RunnerOptions ro{.max_context = 64, .num_kv_blocks = 4, .block_size = 16};
    Result<std::unique_ptr<ModelRunner>> runner = MakeModelRunner(*f, {}, ro);
    ASSERT_TRUE(runner.ok());
    StepRunner one(**runner);
    const std::vector<std::vector<int32_t>> ref = RunPlans(one, 12);
    // A token mask: greedy and top-p draw only allowed tokens, and every rank alike.
    std::vector<uint64_t> mask(512 / 64, 0);
    for (int32_t id = 3; id < 512; id += 3) mask[id / 64] |= uint64_t{1} << (id % 64);
    const std::vector<std::vector<int32_t>> masked = RunPlans(one, 12, mask);
    EXPECT_NE(masked, ref);
    for (const auto& tokens : masked) {
        for (int32_t id : tokens) EXPECT_EQ(id % 3, 0) << id;
    }
    StepPlan bad_mask;
    bad_mask.sequences.push_back({.seq_id = 5, .token_ids = {1}, .block_table = {3},
                                  .slot_mapping = {48}, .allowed_tokens = {1}});
    EXPECT_NE(one.Execute(bad_mask).status().message().find("allowed_tokens"), std::string::npos);
    bad_mask.sequences[0].allowed_tokens.assign(8, 0);
    EXPECT_NE(one.Execute(bad_mask).status().message().find("allows no token"), std::string::npos);
    for (int tp : {2, 4}) {
        Result<std::unique_ptr<TpGroup>> group = TpGroup::Create(*f, {.tp = tp, .runner = ro});
        ASSERT_TRUE(group.ok()) << group.status().ToString();
        EXPECT_EQ(RunPlans(**group, 12), ref) << "tp " << tp;
        EXPECT_EQ(RunPlans(**group, 12, mask), masked) << "tp " << tp;

        StepPlan bad;
        bad.sequences.push_back(
            {.seq_id = 5, .token_ids = {1, 999999}, .block_table = {3}, .slot_mapping = {48, 49}});
        Result<StepResult> r = (*group)->Execute(bad);
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
        EXPECT_EQ(RunPlans(**group, 2)[0],
                  std::vector<int32_t>(ref[0].begin(), ref[0].begin() + 2));
    }
}

TEST(TpGroupExecutor, RefusesMoreRanksThanHeads) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    std::unique_ptr<ModelFile> f = Open(path);
    ASSERT_NE(f, nullptr);
    Result<std::unique_ptr<TpGroup>> group = TpGroup::Create(*f, {.tp = 9});
    ASSERT_FALSE(group.ok());
    EXPECT_NE(group.status().message().find("8 query heads"), std::string::npos)
        << group.status().message();
}

}  // namespace
}  // namespace kvshard
