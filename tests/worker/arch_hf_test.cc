// The architectures past Llama from a Hugging Face folder equal the same model from GGUF: each
// synthetic model of model/synthetic_gguf.h (qwen2's biases, qwen3's q/k norms and wide heads,
// mistral's window, gemma3's whole block) is exported by model/hf_export.h as the folder its
// Hugging Face class would have (config.json of that class, safetensors with the Hugging Face
// names, half-split Q/K rows, Gemma's norms stored as the w of x * (1 + w)) and opened again.
// The F32 export holds the same numbers, so prompt logits and greedy tokens must be the same.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "model/hf_export.h"
#include "model/safetensors.h"
#include "model/synthetic_gguf.h"
#include "tests/test_util.h"
#include "worker/generator.h"
#include "worker/local_model.h"
#include "worker/sequence_slots.h"

namespace kvshard {
namespace {

using testing::TempDir;

struct Outcome {
    std::vector<float> logits;   // after the whole prompt
    std::vector<int32_t> greedy;
};

Outcome RunModel(const std::string& path, const std::vector<int32_t>& prompt) {
    Outcome out;
    LocalModelOptions lo;
    lo.runner.max_context = 64;
    Result<LocalModel> m = LoadLocalModel(path, lo);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return out;
    SequenceChunk chunk{
        .seq_id = 1, .tokens = prompt, .start_pos = 0, .block_table = {}, .slot_mapping = {}};
    FixedBlockTables tables(1, int64_t(prompt.size()), m->runner->pool()->config().block_size,
                            m->runner->kv_groups().num_groups());
    tables.Place(0, &chunk);
    const Status st = m->runner->Forward(std::span<const SequenceChunk>(&chunk, 1), &out.logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    GenerateOptions g;
    g.max_tokens = 12;
    Result<GenerateResult> r = Generate(*m->runner, *m->tokenizer, prompt, g);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok()) out.greedy = r->token_ids;
    return out;
}

class ArchHfFolder : public ::testing::TestWithParam<const char*> {};

TEST_P(ArchHfFolder, EqualsTheGgufFile) {
    const std::string arch = GetParam();
    TempDir dir;
    const std::string gguf = dir.File(arch + ".gguf");
    ASSERT_TRUE(SyntheticArchGguf(arch).WriteFile(gguf).ok());
    Result<std::unique_ptr<ModelFile>> original = OpenModel(gguf);
    ASSERT_TRUE(original.ok()) << original.status().ToString();
    const std::string folder = dir.File("hf");
    const Status exported = ExportHuggingFace(**original, folder);
    ASSERT_TRUE(exported.ok()) << exported.ToString();
    Result<std::unique_ptr<ModelFile>> hf = OpenModel(folder);
    ASSERT_TRUE(hf.ok()) << hf.status().ToString();
    EXPECT_EQ((*hf)->format(), ModelFormat::kHuggingFace);
    // The synthetic GGUF has no bos/eos keys; a folder's come from its tokenizer files.
    ModelSpec want = (*original)->spec();
    want.qk_layout = QkLayout::kHalfSplit;
    want.bos_token_id = (*original)->tokenizer_data().bos_id;
    want.eos_token_id = (*original)->tokenizer_data().eos_id;
    EXPECT_EQ((*hf)->spec().ToString(), want.ToString());
    EXPECT_EQ((*hf)->spec().attn_bias, want.attn_bias);
    EXPECT_EQ((*hf)->spec().embedding_scale, want.embedding_scale);

    // The folder is what the Hugging Face class reads: its own tensor names, and Gemma's norms
    // one less than GGUF's.
    Result<std::unique_ptr<SafetensorsModel>> st =
        SafetensorsModel::Open(folder + "/model.safetensors");
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    if (arch == "gemma3") {
        const TensorInfo* post = (*st)->FindTensor("model.layers.0.post_attention_layernorm.weight");
        const TensorInfo* pre = (*st)->FindTensor("model.layers.0.pre_feedforward_layernorm.weight");
        ASSERT_NE(post, nullptr);
        ASSERT_NE(pre, nullptr);
        std::vector<float> stored(static_cast<size_t>(post->NumElements()));
        std::vector<float> gguf_values(stored.size());
        DequantizeRows(*post, 0, 1, stored.data());
        DequantizeRows(**(*original)->GetTensor("blk.0.post_attention_norm.weight"), 0, 1,
                       gguf_values.data());
        for (size_t i = 0; i < stored.size(); ++i) EXPECT_EQ(stored[i] + 1.0f, gguf_values[i]);
    }
    if (arch == "qwen2") {
        EXPECT_NE((*st)->FindTensor("model.layers.1.self_attn.v_proj.bias"), nullptr);
    }
    if (arch == "qwen3" || arch == "gemma3") {
        EXPECT_NE((*st)->FindTensor("model.layers.1.self_attn.k_norm.weight"), nullptr);
    }

    std::vector<int32_t> prompt;
    for (int i = 0; i < 20; ++i) prompt.push_back(3 + (i * 37) % 250);
    const Outcome a = RunModel(gguf, prompt);
    const Outcome b = RunModel(folder, prompt);
    ASSERT_EQ(a.logits.size(), b.logits.size());
    ASSERT_FALSE(a.logits.empty());
    double max_diff = 0, max_abs = 0;
    for (size_t i = 0; i < a.logits.size(); ++i) {
        max_diff = std::max(max_diff, std::fabs(double(a.logits[i]) - b.logits[i]));
        max_abs = std::max(max_abs, std::fabs(double(a.logits[i])));
    }
    std::printf("%s: HF folder vs GGUF, max |logit diff| %.3g of max |logit| %.3g; greedy %s\n",
                arch.c_str(), max_diff, max_abs, a.greedy == b.greedy ? "equal" : "DIFFER");
    // Same numbers in another Q/K row order: equal up to float rounding.
    EXPECT_LT(max_diff, 1e-5 * max_abs);
    EXPECT_EQ(a.greedy.size(), 12u);
    EXPECT_EQ(a.greedy, b.greedy);
}

INSTANTIATE_TEST_SUITE_P(Architectures, ArchHfFolder,
                         ::testing::Values("qwen2", "qwen3", "mistral", "gemma3"));

}  // namespace
}  // namespace kvshard
