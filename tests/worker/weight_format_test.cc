// The stored-format fast path against the dequantize-at-load reference on the default model
// (SmolLM2-135M Q4_1 + Q8_0 tensors): 8 prompts x 64 tokens teacher-forced on the reference's
// greedy continuation (each decode step is a product of m = 8 rows). The stored weights run twice
// in the same pass: with fp32 activations (kernels/cpu_matmul.h) they differ from the reference
// only in the order of the additions; with int8 activations (KVSHARD_MATMUL_ACTIVATIONS=int8)
// also by the activations' 8-bit rounding. A third copy runs each sequence alone (decode steps of
// m = 1, which read the interleaved Q4_1 copies) with int16 activations (opt-in, AVX512-VNNI;
// the prompts' prefill rounds too).
// The figures are printed for the issue note.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/cpu_matmul.h"
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

// Agreement of one model's logits with the reference's over the teacher-forced positions.
struct Agreement {
    int64_t agree = 0;
    int64_t total = 0;
    double max_err = 0;
    double sum_err = 0;

    void Add(const float* ref, const float* got, int64_t vocab, int32_t greedy) {
        agree += Sampler::Argmax(got, vocab) == greedy;
        ++total;
        for (int64_t v = 0; v < vocab; ++v) {
            const double e = std::fabs(double(ref[v]) - got[v]);
            max_err = std::max(max_err, e);
            sum_err += e;
        }
    }
    double Top1() const { return double(agree) / double(total); }
    void Print(const char* what, double max_logit, int64_t vocab) const {
        std::printf(
            "[ stored, %s activations, vs f32 ] %lld positions: top-1 agreement %.2f%%, max "
            "|logit error| %.3g (%.2g of max |logit| %.3g), mean %.3g\n",
            what, static_cast<long long>(total), 100 * Top1(), max_err, max_err / max_logit,
            max_logit, sum_err / double(total * vocab));
    }
};

// Runs a model's forward pass with its activation format pinned.
Status ForwardWith(cpu::ActivationFormat format, LocalModel& model,
                   std::span<const SequenceChunk> batch, std::vector<float>* logits) {
    cpu::ForceActivationFormat(format);
    Status st = model.runner->Forward(batch, logits);
    cpu::ResetActivationFormat();
    return st;
}

TEST(WeightFormat, StoredAgreesWithF32TeacherForced) {
    const std::string path = testing::DefaultModel();
    KV_REQUIRE_FIXTURE(path, "default model (scripts/test fetches it)");
    std::unique_ptr<LocalModel> ref = Load(path, WeightFormat::kF32);
    std::unique_ptr<LocalModel> fast = Load(path, WeightFormat::kStored);
    std::unique_ptr<LocalModel> fast8 = Load(path, WeightFormat::kStored);
    std::unique_ptr<LocalModel> fast16 = Load(path, WeightFormat::kStored);
    ASSERT_TRUE(ref && fast && fast8 && fast16);
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
    Agreement exact, int8, int16;
    double max_logit = 0;
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
        std::vector<float> a, b, b8;
        ASSERT_TRUE(ref->runner->Forward(batch, &a).ok());
        // Each stored runner has its own slots: same tables, its own pool.
        ASSERT_TRUE(ForwardWith(cpu::ActivationFormat::kFp32, *fast, batch, &b).ok());
        ASSERT_TRUE(ForwardWith(cpu::ActivationFormat::kInt8, *fast8, batch, &b8).ok());
        std::vector<float> b16;
        for (const SequenceChunk& chunk : batch) {
            std::vector<float> one;
            ASSERT_TRUE(ForwardWith(cpu::ActivationFormat::kInt16, *fast16, {&chunk, 1}, &one).ok());
            b16.insert(b16.end(), one.begin(), one.end());
        }
        for (int64_t s = 0; s < n; ++s) {
            const float* ra = &a[s * vocab];
            const int32_t greedy = Sampler::Argmax(ra, vocab);
            exact.Add(ra, &b[s * vocab], vocab, greedy);
            int8.Add(ra, &b8[s * vocab], vocab, greedy);
            int16.Add(ra, &b16[s * vocab], vocab, greedy);
            for (int64_t v = 0; v < vocab; ++v)
                max_logit = std::max(max_logit, std::fabs(double(ra[v])));
            computed[static_cast<size_t>(s)] = int64_t(context[static_cast<size_t>(s)].size());
            context[static_cast<size_t>(s)].push_back(greedy);  // teacher-forced on the reference
        }
    }
    exact.Print("fp32", max_logit, vocab);
    int8.Print("int8", max_logit, vocab);
    int16.Print("int16 (m = 1)", max_logit, vocab);
    EXPECT_GE(exact.Top1(), 0.99);
    EXPECT_LT(exact.max_err / max_logit, 1e-3);
    EXPECT_GE(int16.Top1(), 0.99);
    EXPECT_LT(int16.max_err / max_logit, 1e-3);
    // 8-bit activations (prefill rounded too): measured top-1 96.88%, max |logit error| 4.9e-2
    // of the largest |logit|, mean 0.18. Below the 99% the fp32 path keeps, hence opt-in
    // (kernels/cpu_matmul.h); llama.cpp's own 8-bit arithmetic on this file agrees with kvshard's
    // fp32 top-1 at 98.2% of its greedy positions (reference_output_test.cc).
    EXPECT_GE(int8.Top1(), 0.95);
    EXPECT_LT(int8.max_err / max_logit, 0.1);
}

}  // namespace
}  // namespace kvshard
