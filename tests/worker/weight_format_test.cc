// The stored-format fast path against the dequantize-at-load reference on the default model
// (SmolLM2-135M Q4_1 + Q8_0 tensors): 8 prompts x 64 tokens teacher-forced on the reference's
// greedy continuation. Activations stay fp32 in both paths (kernels/cpu_matmul.h), so they differ
// only in the order of the additions; the figures are printed for the issue note.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "worker/local_model.h"
#include "worker/sampler.h"
#include "worker/sequence_slots.h"

namespace kvshard {
namespace {

std::unique_ptr<LocalModel> Load(const std::string& path, WeightFormat format) {
    LocalModelOptions o;
    o.runner.max_context = 128;
    o.runner.num_kv_blocks = 8 * 8;  // 8 sequences x 128 positions in blocks of 16
    o.runner.weight_format = format;
    Result<LocalModel> m = LoadLocalModel(path, o);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? std::make_unique<LocalModel>(std::move(*m)) : nullptr;
}

TEST(WeightFormat, StoredAgreesWithF32TeacherForced) {
    const std::string path = testing::DefaultModel();
    KV_REQUIRE_FIXTURE(path, "default model (scripts/test fetches it)");
    std::unique_ptr<LocalModel> ref = Load(path, WeightFormat::kF32);
    std::unique_ptr<LocalModel> fast = Load(path, WeightFormat::kStored);
    ASSERT_TRUE(ref && fast);
    EXPECT_EQ(ref->runner->weights().layers[0].qkv.dtype, DType::kF32);
    EXPECT_EQ(fast->runner->weights().layers[0].qkv.dtype, DType::kQ4_1);
    EXPECT_LT(fast->runner->weight_bytes() * 4, ref->runner->weight_bytes());
    const std::vector<std::string> prompts = {
        "Once upon a time",          "The capital of France is",     "def fibonacci(n):",
        "In 1969, astronauts",       "The best way to learn is",     "Water boils at",
        "My favourite recipe needs", "Quantum computers differ from"};
    const int64_t kTokens = 64;
    const int64_t vocab = ref->runner->spec().vocab_size;
    const auto n = static_cast<int64_t>(prompts.size());
    FixedBlockTables tables(n, 128, 16);
    std::vector<std::vector<int32_t>> context(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) context[i] = ref->EncodePrompt(prompts[i]);
    int64_t agree = 0, total = 0;
    double max_err = 0, sum_err = 0, max_logit = 0;
    std::vector<int64_t> computed(prompts.size(), 0);
    for (int64_t step = 0; step < kTokens; ++step) {
        std::vector<SequenceChunk> batch;
        for (int64_t s = 0; s < n; ++s) {
            const std::vector<int32_t>& c = context[static_cast<size_t>(s)];
            SequenceChunk chunk{.seq_id = s,
                                .tokens = std::span<const int32_t>(c).subspan(
                                    static_cast<size_t>(computed[static_cast<size_t>(s)])),
                                .start_pos = computed[static_cast<size_t>(s)]};
            tables.Place(s, &chunk);
            batch.push_back(chunk);
        }
        std::vector<float> a, b;
        ASSERT_TRUE(ref->runner->Forward(batch, &a).ok());
        // The fast runner's own slots: same tables, its own pool.
        ASSERT_TRUE(fast->runner->Forward(batch, &b).ok());
        for (int64_t s = 0; s < n; ++s) {
            const float* ra = &a[s * vocab];
            const float* rb = &b[s * vocab];
            const int32_t greedy = Sampler::Argmax(ra, vocab);
            agree += Sampler::Argmax(rb, vocab) == greedy;
            ++total;
            double row_max = 0;
            for (int64_t v = 0; v < vocab; ++v) {
                const double e = std::fabs(double(ra[v]) - rb[v]);
                row_max = std::max(row_max, e);
                sum_err += e;
                max_logit = std::max(max_logit, std::fabs(double(ra[v])));
            }
            max_err = std::max(max_err, row_max);
            computed[static_cast<size_t>(s)] = int64_t(context[static_cast<size_t>(s)].size());
            context[static_cast<size_t>(s)].push_back(greedy);  // teacher-forced on the reference
        }
    }
    const double agreement = double(agree) / double(total);
    std::printf(
        "[ stored vs f32 ] %lld positions: top-1 agreement %.2f%%, max |logit error| %.3g "
        "(%.2g of max |logit| %.3g), mean %.3g\n",
        static_cast<long long>(total), 100 * agreement, max_err, max_err / max_logit, max_logit,
        sum_err / double(total * vocab));
    EXPECT_GE(agreement, 0.99);
    EXPECT_LT(max_err / max_logit, 1e-3);
}

}  // namespace
}  // namespace kvshard
