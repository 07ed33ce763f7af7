// The ModelRunner's fused RoPE + KV write (RunnerOptions::fuse_rope_kv_write, kernels/backend.h
// RopeKvWriter) against the separate Rope and KvWrite, and the attention launch plan it hands the
// backend (PagedAttentionBatch::max_query_rows, read by kernels/cuda/launch_math.h
// LaunchesPrefillAttention).
//
// Two runners of one model take the same steps: a prefill of three prompts (one cut into two
// chunks), then decode steps of the three, greedy. One runner's backend offers the fused op, the
// other's does not (tests/worker/op_log_backend.h): the logits must agree bit for bit at every
// step, for every KV storage, and each runner must have queued the ops of its path only. A third
// runner with the fused backend and fuse_rope_kv_write false must take the separate ops.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/launch_math.h"
#include "model/model_file.h"
#include "tests/test_util.h"
#include "tests/worker/op_log_backend.h"
#include "worker/model_runner.h"
#include "worker/weights.h"

namespace kvshard {
namespace {

using testing::DefaultModel;
using testing::FusedOpLogBackend;
using testing::OpLogBackend;
using testing::SharedModel;

constexpr int64_t kBlockSize = 16;
constexpr int64_t kBlocksPerSeq = 4;
constexpr int64_t kSeqs = 3;
constexpr int64_t kDecodeSteps = 5;

struct Case {
    bool is_default;  // the default model (SmolLM2), else stories260K
    KvDtype storage;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
    return std::string(info.param.is_default ? "SmolLM2_" : "Stories260K_") +
           std::string(KvDtypeName(info.param.storage));
}

int32_t Argmax(const float* row, int64_t n) {
    return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

class RunnerRopeKvWrite : public ::testing::TestWithParam<Case> {
  protected:
    void SetUp() override {
        const std::string path =
            GetParam().is_default ? DefaultModel() : SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(path, GetParam().is_default ? "the default model" : "stories260K");
        Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
        ASSERT_TRUE(file.ok()) << file.status().ToString();
        file_ = std::move(*file);
    }

    RunnerOptions Options(bool fuse) const {
        RunnerOptions o;
        o.max_context = kBlockSize * kBlocksPerSeq;
        o.block_size = kBlockSize;
        o.num_kv_blocks = kSeqs * kBlocksPerSeq;
        o.kv_storage = GetParam().storage;
        o.max_step_tokens = 64;
        o.max_step_seqs = 8;
        o.fuse_rope_kv_write = fuse;
        return o;
    }

    // A runner whose backend is the CPU's behind an op log, offering the fused op or not.
    std::unique_ptr<ModelRunner> MakeRunner(const RunnerOptions& o, bool offer_fused,
                                            OpLogBackend** log) {
        Result<std::unique_ptr<Backend>> cpu = MakeBackend({});
        EXPECT_TRUE(cpu.ok());
        if (!cpu.ok()) return nullptr;
        std::unique_ptr<OpLogBackend> b = offer_fused
                                              ? std::make_unique<FusedOpLogBackend>(std::move(*cpu))
                                              : std::make_unique<OpLogBackend>(std::move(*cpu));
        *log = b.get();
        Result<ModelWeights> w = LoadWeights(*file_, *b);
        EXPECT_TRUE(w.ok()) << w.status().ToString();
        if (!w.ok()) return nullptr;
        return std::make_unique<ModelRunner>(file_->spec(), std::move(b), std::move(*w), o);
    }

    std::unique_ptr<ModelFile> file_;
};

TEST_P(RunnerRopeKvWrite, FusedGivesTheSeparateOpsLogitsAndLaunchPlan) {
    if (file_ == nullptr) return;
    const int64_t vocab = file_->spec().vocab_size;
    const int64_t layers = file_->spec().num_layers;
    OpLogBackend *fused_log = nullptr, *separate_log = nullptr, *refused_log = nullptr;
    std::unique_ptr<ModelRunner> fused = MakeRunner(Options(true), true, &fused_log);
    std::unique_ptr<ModelRunner> separate = MakeRunner(Options(true), false, &separate_log);
    // The backend offers the fused op, the runner is told not to take it.
    std::unique_ptr<ModelRunner> refused = MakeRunner(Options(false), true, &refused_log);
    ASSERT_TRUE(fused && separate && refused);
    ModelRunner* runners[] = {fused.get(), separate.get(), refused.get()};
    OpLogBackend* logs[] = {fused_log, separate_log, refused_log};

    std::vector<std::vector<int32_t>> tables(kSeqs);
    for (int64_t s = 0; s < kSeqs; ++s) {
        for (int64_t k = 0; k < kBlocksPerSeq; ++k)
            tables[size_t(s)].push_back(static_cast<int32_t>(s * kBlocksPerSeq + k));
    }
    std::vector<std::vector<int64_t>> slots(kSeqs);
    std::vector<int64_t> len(kSeqs, 0);
    auto chunk = [&](int64_t s, std::span<const int32_t> tokens) {
        auto& sl = slots[size_t(s)];
        sl.clear();
        for (size_t i = 0; i < tokens.size(); ++i) {
            const int64_t pos = len[size_t(s)] + int64_t(i);
            sl.push_back(int64_t(tables[size_t(s)][size_t(pos / kBlockSize)]) * kBlockSize +
                         pos % kBlockSize);
        }
        SequenceChunk c{.seq_id = s,
                        .tokens = tokens,
                        .start_pos = len[size_t(s)],
                        .block_table = tables[size_t(s)],
                        .slot_mapping = sl};
        len[size_t(s)] += int64_t(tokens.size());
        return c;
    };
    // Runs `batch` on every runner; returns the fused runner's logits. `longest` is the most
    // rows of one chunk, which every attention call of the step must be told.
    int64_t steps = 0;
    auto step = [&](const std::vector<SequenceChunk>& batch, int64_t longest,
                    const std::string& what) {
        std::vector<float> logits[3];
        for (int r = 0; r < 3; ++r) {
            logs[r]->attention_max_query_rows.clear();
            const Status st = runners[r]->Forward(batch, &logits[r]);
            EXPECT_TRUE(st.ok()) << what << " runner " << r << ": " << st.ToString();
            EXPECT_EQ(logs[r]->attention_max_query_rows,
                      std::vector<int64_t>(size_t(layers), longest))
                << what << " runner " << r;
        }
        EXPECT_EQ(logits[0].size(), batch.size() * size_t(vocab)) << what;
        EXPECT_TRUE(logits[0] == logits[1]) << what << ": fused vs separate";
        EXPECT_TRUE(logits[0] == logits[2]) << what << ": fused vs told not to fuse";
        EXPECT_EQ(cuda::LaunchesPrefillAttention(longest), longest > 1) << what;
        ++steps;
        return logits[0];
    };

    // Prompts of 19, 7 and 30 tokens; the last in two chunks (12, then 18 beside the decodes).
    std::vector<std::vector<int32_t>> prompts(kSeqs);
    const int64_t prompt_len[kSeqs] = {19, 7, 30};
    for (int64_t s = 0; s < kSeqs; ++s) {
        for (int64_t i = 0; i < prompt_len[s]; ++i)
            prompts[size_t(s)].push_back(
                static_cast<int32_t>((s * 37 + i * 11 + 5) % (vocab - 3) + 3));
    }
    const std::span<const int32_t> p2(prompts[2]);
    std::vector<SequenceChunk> batch = {chunk(0, prompts[0]), chunk(1, prompts[1]),
                                        chunk(2, p2.first(12))};
    std::vector<float> logits = step(batch, 19, "prefill");
    std::vector<int32_t> next(kSeqs);
    for (int64_t s = 0; s < 2; ++s) next[size_t(s)] = Argmax(&logits[size_t(s * vocab)], vocab);
    // Sequences 0 and 1 decode beside the rest of sequence 2's prompt: a mixed step.
    batch = {chunk(0, std::span<const int32_t>(&next[0], 1)),
             chunk(1, std::span<const int32_t>(&next[1], 1)), chunk(2, p2.subspan(12))};
    logits = step(batch, 18, "mixed");
    for (int64_t s = 0; s < kSeqs; ++s) next[size_t(s)] = Argmax(&logits[size_t(s * vocab)], vocab);
    for (int64_t d = 0; d < kDecodeSteps; ++d) {
        batch.clear();
        for (int64_t s = 0; s < kSeqs; ++s)
            batch.push_back(chunk(s, std::span<const int32_t>(&next[size_t(s)], 1)));
        logits = step(batch, 1, "decode " + std::to_string(d));
        for (int64_t s = 0; s < kSeqs; ++s)
            next[size_t(s)] = Argmax(&logits[size_t(s * vocab)], vocab);
    }

    // Each runner queued its own path's ops, one per layer and step.
    const int64_t per_layer = layers * steps;
    EXPECT_EQ(fused_log->count("RopeKvWrite"), per_layer);
    EXPECT_EQ(fused_log->count("Rope"), 0);
    EXPECT_EQ(fused_log->count("KvWrite"), 0);
    for (OpLogBackend* log : {separate_log, refused_log}) {
        EXPECT_EQ(log->count("RopeKvWrite"), 0);
        EXPECT_EQ(log->count("Rope"), per_layer);
        EXPECT_EQ(log->count("KvWrite"), per_layer);
    }
}

// Every KV storage on stories260K; the default model (30 layers, 576 wide: minutes of three
// runners on a loaded two-core machine) with one 8-bit storage.
INSTANTIATE_TEST_SUITE_P(Models, RunnerRopeKvWrite,
                         ::testing::Values(Case{false, KvDtype::kFp32}, Case{false, KvDtype::kBf16},
                                           Case{false, KvDtype::kFp16}, Case{false, KvDtype::kInt8},
                                           Case{false, KvDtype::kFp8}, Case{true, KvDtype::kInt8}),
                         Name);

// A padded decode step (worker/decode_buckets.h: padded sequences of at most one row) is still
// a decode step to the attention launch: max_query_rows 1.
TEST(RunnerAttentionPlan, PaddedDecodeStepsLaunchNoPrefill) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K");
    Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    Result<std::unique_ptr<Backend>> cpu = MakeBackend({});
    ASSERT_TRUE(cpu.ok());
    auto log = std::make_unique<OpLogBackend>(std::move(*cpu));
    OpLogBackend* l = log.get();
    Result<ModelWeights> w = LoadWeights(**file, *log);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    RunnerOptions o;
    o.max_context = 64;
    o.block_size = kBlockSize;
    o.num_kv_blocks = 8;
    o.max_step_seqs = 8;  // buckets 1, 2, 4, 8
    o.pad_decode_to_buckets = true;
    ModelRunner runner((*file)->spec(), std::move(log), std::move(*w), o);
    const int64_t layers = (*file)->spec().num_layers;
    // Three sequences of prompt 1, 20, 30 (padded to bucket 4 when they decode).
    std::vector<std::vector<int32_t>> tables = {{0, 1}, {2, 3}, {4, 5}};
    std::vector<std::vector<int32_t>> prompts = {{1}, {1, 20}, {1, 30, 40}};
    std::vector<std::vector<int64_t>> slots(3);
    std::vector<SequenceChunk> batch;
    for (size_t s = 0; s < 3; ++s) {
        for (size_t i = 0; i < prompts[s].size(); ++i)
            slots[s].push_back(int64_t(tables[s][0]) * kBlockSize + int64_t(i));
        batch.push_back({.seq_id = int64_t(s),
                         .tokens = prompts[s],
                         .block_table = tables[s],
                         .slot_mapping = slots[s]});
    }
    std::vector<float> logits;
    ASSERT_TRUE(runner.Forward(batch, &logits).ok());
    EXPECT_EQ(l->attention_max_query_rows, std::vector<int64_t>(size_t(layers), 3));
    const std::vector<int32_t> next = {5, 6, 7};
    for (size_t s = 0; s < 3; ++s) {
        const int64_t pos = int64_t(prompts[s].size());
        slots[s] = {int64_t(tables[s][0]) * kBlockSize + pos};
        batch[s] = {.seq_id = int64_t(s),
                    .tokens = std::span<const int32_t>(&next[s], 1),
                    .start_pos = pos,
                    .block_table = tables[s],
                    .slot_mapping = slots[s]};
    }
    l->attention_max_query_rows.clear();
    ASSERT_TRUE(runner.Forward(batch, &logits).ok());
    EXPECT_EQ(l->attention_max_query_rows, std::vector<int64_t>(size_t(layers), 1));
    EXPECT_FALSE(cuda::LaunchesPrefillAttention(l->attention_max_query_rows.front()));
}

}  // namespace
}  // namespace kvshard
