// Decode steps padded to their bucket, and run as graphs, give the tokens of the step as it is.
//
// Three runners of one model take the same steps in lockstep: one runs every step as it is, one
// pads pure-decode steps to their bucket (RunnerOptions::pad_decode_to_buckets), one runs them as
// graphs. On the CPU the graphs are RecordingBackend's (tests/worker/recording_backend.h: ops
// recorded, not run, inside a capture and run again by Replay, as a CUDA stream does); on a GPU
// (skipped without one) the CUDA backend's. The graph runner must give the padded runner's logits
// bit for bit, and the padded runner the plain runner's greedy tokens with its logits within float
// rounding (bit for bit too wherever the products' row tiling does not change with the row count:
// counted and printed). Decode batches of 1..9 sequences, each behind a prompt of its own or
// behind a shared prefix whose block every sequence's table holds (as prefix-cache hits leave it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "model/model_file.h"
#include "tests/test_util.h"
#include "tests/worker/recording_backend.h"
#include "worker/model_runner.h"
#include "worker/weights.h"

namespace kvshard {
namespace {

using testing::DefaultModel;
using testing::RecordingBackend;
using testing::SharedModel;

constexpr int64_t kBlockSize = 16;
constexpr int64_t kMaxBatch = 9;
constexpr int64_t kPrefixLen = kBlockSize;  // a full block shared by every sequence
constexpr int64_t kBlocksPerSeq = 4;        // 64 positions of a sequence's own
constexpr int64_t kDecodeSteps = 3;         // per batch size: a bucket's warm-up, capture, replay

struct Case {
    const char* model;
    bool is_default;
    bool prefix_cache;
    BackendKind backend;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
    const Case& c = info.param;
    return std::string(c.is_default ? "SmolLM2" : "Stories260K") +
           (c.prefix_cache ? "_PrefixCache" : "_NoPrefixCache") +
           (c.backend == BackendKind::kCuda ? "_Gpu" : "_Cpu");
}

// One sequence's blocks: the shared prefix blocks (prefix cache), then its own.
struct Seq {
    std::vector<int32_t> table;
    std::vector<int64_t> slots;  // of the chunk being placed
    int64_t len = 0;             // positions computed
};

class DecodePadding : public ::testing::TestWithParam<Case> {
  protected:
    void SetUp() override {
        const Case& c = GetParam();
        const std::string path = c.is_default ? DefaultModel() : SharedModel(c.model);
        KV_REQUIRE_FIXTURE(path, c.model);
        if (c.backend == BackendKind::kCuda) {
            Result<std::unique_ptr<Backend>> probe = MakeBackend({.kind = BackendKind::kCuda});
            if (!probe.ok()) GTEST_SKIP() << "no CUDA device: " << probe.status().ToString();
        }
        Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
        ASSERT_TRUE(file.ok()) << file.status().ToString();
        file_ = std::move(*file);
    }

    RunnerOptions Options() const {
        RunnerOptions o;
        o.max_context = 256;
        o.block_size = kBlockSize;
        o.num_kv_blocks = 1 + kMaxBatch * kBlocksPerSeq;
        o.max_step_tokens = 512;
        o.max_step_seqs = 16;  // buckets 1, 2, 4, 8, 16
        o.backend.kind = GetParam().backend;
        // The recording backend of the graph runner makes no single-row weight copies
        // (DecodeWeightPacker), so no runner here does: graph and padded steps then run the same
        // kernels and must agree bit for bit.
        o.pack_decode_weights = false;
        return o;
    }

    // A runner whose backend is `backend` (nullptr: the options' own).
    std::unique_ptr<ModelRunner> MakeRunner(const RunnerOptions& o,
                                            std::unique_ptr<Backend> backend = nullptr) {
        if (backend == nullptr) {
            Result<std::unique_ptr<Backend>> b = MakeBackend(o.backend);
            EXPECT_TRUE(b.ok()) << b.status().ToString();
            if (!b.ok()) return nullptr;
            backend = std::move(*b);
        }
        Result<ModelWeights> w = LoadWeights(*file_, *backend);
        EXPECT_TRUE(w.ok()) << w.status().ToString();
        if (!w.ok()) return nullptr;
        return std::make_unique<ModelRunner>(file_->spec(), std::move(backend), std::move(*w), o);
    }

    std::unique_ptr<ModelFile> file_;
};

int32_t TokenOf(int64_t seq, int64_t i, int64_t vocab) {
    return static_cast<int32_t>((seq * 37 + i * 11 + 5) % (vocab - 3) + 3);
}

int32_t Argmax(const float* row, int64_t n) {
    return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
    float m = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
        m = std::max(m, std::fabs(a[i] - b[i]));
    return m;
}

TEST_P(DecodePadding, PaddedAndGraphStepsGiveTheUnpaddedLogits) {
    if (file_ == nullptr) return;
    const Case& c = GetParam();
    const bool gpu = c.backend == BackendKind::kCuda;
    const int64_t vocab = file_->spec().vocab_size;

    RunnerOptions plain_options = Options();
    RunnerOptions padded_options = Options();
    padded_options.pad_decode_to_buckets = true;
    RunnerOptions graph_options = Options();
    // Graphs are opt-in: the third runner asks for them (on the CPU its recording backend
    // captures), the other two never take them.
    plain_options.cuda_graphs = false;
    padded_options.cuda_graphs = false;
    graph_options.cuda_graphs = true;
    std::unique_ptr<ModelRunner> plain = MakeRunner(plain_options);
    std::unique_ptr<ModelRunner> padded = MakeRunner(padded_options);
    RecordingBackend* recording = nullptr;
    std::unique_ptr<Backend> graph_backend;
    if (!gpu) {
        Result<std::unique_ptr<Backend>> cpu = MakeBackend(graph_options.backend);
        ASSERT_TRUE(cpu.ok());
        auto r = std::make_unique<RecordingBackend>(std::move(*cpu));
        recording = r.get();
        graph_backend = std::move(r);
    }
    std::unique_ptr<ModelRunner> graphs = MakeRunner(graph_options, std::move(graph_backend));
    ASSERT_TRUE(plain && padded && graphs);
    ASSERT_EQ(plain->kv_groups().num_groups(), 1) << "the tables below are for one KV group";
    ASSERT_EQ(plain->decode_graphs(), nullptr);
    ASSERT_EQ(padded->decode_graphs(), nullptr);
    ASSERT_NE(graphs->decode_graphs(), nullptr);
    ModelRunner* runners[] = {plain.get(), padded.get(), graphs.get()};

    // Runs one step on every runner and returns the plain one's logits. The graph runner must
    // give the padded runner's logits bit for bit (a graph replays the padded step's ops with the
    // same shapes); the padded runner must give the plain one's greedy tokens, and its logits
    // within float rounding (the CPU's quantized products tile activation rows by up to 8, so a
    // row of a 16-row product can round otherwise than in a 9-row one; CUDA picks cuBLASLt
    // algorithms by shape). Steps whose logits are identical too are counted.
    int64_t decode_steps = 0, identical_steps = 0;
    auto step = [&](std::vector<SequenceChunk>& batch, const std::string& what, bool decode) {
        std::vector<float> logits[3];
        for (int r = 0; r < 3; ++r) {
            const Status st = runners[r]->Forward(batch, &logits[r]);
            EXPECT_TRUE(st.ok()) << what << " runner " << r << ": " << st.ToString();
        }
        EXPECT_EQ(logits[0].size(), batch.size() * size_t(vocab)) << what;
        EXPECT_EQ(logits[1].size(), logits[0].size()) << what;
        EXPECT_TRUE(logits[2] == logits[1])
            << what << ": graph vs padded, max |diff| " << MaxAbsDiff(logits[2], logits[1]);
        float scale = 1.0f;
        for (float v : logits[0]) scale = std::max(scale, std::fabs(v));
        EXPECT_LE(MaxAbsDiff(logits[1], logits[0]), (gpu ? 1e-2f : 1e-4f) * scale)
            << what << ": padded vs plain";
        for (size_t s = 0; s < batch.size() && logits[1].size() == logits[0].size(); ++s) {
            EXPECT_EQ(Argmax(&logits[1][s * vocab], vocab), Argmax(&logits[0][s * vocab], vocab))
                << what << " sequence " << s;
        }
        if (decode) {
            ++decode_steps;
            identical_steps += logits[1] == logits[0] ? 1 : 0;
        } else {
            // Prefill steps are never padded.
            EXPECT_TRUE(logits[1] == logits[0]) << what << ": prefill";
        }
        return logits[0];
    };

    // Every sequence's blocks: the shared prefix's (prefix cache), then its own.
    std::vector<Seq> seqs(static_cast<size_t>(kMaxBatch));
    for (int64_t s = 0; s < kMaxBatch; ++s) {
        Seq& q = seqs[static_cast<size_t>(s)];
        if (c.prefix_cache) q.table = {0};
        for (int64_t k = 0; k < kBlocksPerSeq; ++k)
            q.table.push_back(static_cast<int32_t>(1 + s * kBlocksPerSeq + k));
    }
    auto place = [&](int64_t s, SequenceChunk* chunk) {
        Seq& q = seqs[static_cast<size_t>(s)];
        q.slots.clear();
        for (size_t i = 0; i < chunk->tokens.size(); ++i) {
            const int64_t pos = chunk->start_pos + static_cast<int64_t>(i);
            q.slots.push_back(int64_t(q.table[pos / kBlockSize]) * kBlockSize + pos % kBlockSize);
        }
        chunk->block_table = q.table;
        chunk->slot_mapping = q.slots;
    };
    // The shared prefix, computed once: its block is then a hit for every sequence.
    std::vector<int32_t> prefix;
    for (int64_t i = 0; i < kPrefixLen; ++i) prefix.push_back(TokenOf(99, i, vocab));
    if (c.prefix_cache) {
        std::vector<SequenceChunk> batch = {{.seq_id = 1000, .tokens = prefix}};
        place(0, &batch[0]);
        step(batch, "prefix", false);
    }
    // Every sequence's prompt in one step: the prefix, then 1 + s tokens of its own.
    std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(kMaxBatch));
    std::vector<SequenceChunk> batch;
    for (int64_t s = 0; s < kMaxBatch; ++s) {
        std::vector<int32_t>& t = prompts[static_cast<size_t>(s)];
        if (!c.prefix_cache) t = prefix;
        for (int64_t i = 0; i <= s; ++i) t.push_back(TokenOf(s, i, vocab));
        batch.push_back({.seq_id = s, .tokens = t, .start_pos = c.prefix_cache ? kPrefixLen : 0});
        place(s, &batch.back());
        seqs[static_cast<size_t>(s)].len = batch.back().start_pos + int64_t(t.size());
    }
    std::vector<float> logits = step(batch, "prefill", false);
    std::vector<int32_t> next(static_cast<size_t>(kMaxBatch));
    for (int64_t s = 0; s < kMaxBatch; ++s) next[size_t(s)] = Argmax(&logits[s * vocab], vocab);
    // Decode steps of the first b sequences, b = 1..9: each the plain runner's greedy token.
    for (int64_t b = 1; b <= kMaxBatch; ++b) {
        for (int64_t d = 0; d < kDecodeSteps; ++d) {
            batch.clear();
            for (int64_t s = 0; s < b; ++s) {
                Seq& q = seqs[static_cast<size_t>(s)];
                batch.push_back({.seq_id = s,
                                 .tokens = std::span<const int32_t>(&next[size_t(s)], 1),
                                 .start_pos = q.len});
                place(s, &batch.back());
                ++q.len;
            }
            logits =
                step(batch, "batch " + std::to_string(b) + " decode " + std::to_string(d), true);
            for (int64_t s = 0; s < b; ++s) next[size_t(s)] = Argmax(&logits[s * vocab], vocab);
        }
    }
    std::printf("%lld of %lld padded decode steps gave the plain runner's logits bit for bit\n",
                static_cast<long long>(identical_steps), static_cast<long long>(decode_steps));
    RecordProperty("identical_decode_steps", static_cast<int>(identical_steps));
    // Every runner pushed the same positions: padded rows are not counted.
    EXPECT_EQ(padded->tokens_processed(), plain->tokens_processed());
    EXPECT_EQ(graphs->tokens_processed(), plain->tokens_processed());
    // Buckets 1, 2, 4, 8 and 16 were each warmed up, captured once and replayed after.
    const DecodeGraphStats& st = graphs->decode_graphs()->stats();
    EXPECT_EQ(st.captures, 5);
    EXPECT_EQ(st.failed_captures, 0);
    EXPECT_EQ(st.releases, 0);
    // 9 batches × 3 decode steps, less the first step of each bucket (eager warm-up).
    EXPECT_EQ(st.replays, kMaxBatch * kDecodeSteps - 5);
    if (recording != nullptr) {
        EXPECT_GT(recording->replayed_ops, 0);
        EXPECT_EQ(recording->live_graphs(), 5);
    }
}

// Two sequences' decode steps on a plain CPU runner and on `graphs` (a RecordingBackend), with
// a prefill of `prefill_len` tokens of a third sequence after `steps_before` of them. Returns
// whether every logit agreed.
void RunAgainstPlain(const ModelFile& file, const RunnerOptions& options, ModelRunner& graphs,
                     int64_t steps_before, int64_t steps_after, int64_t prefill_len) {
    Result<std::unique_ptr<Backend>> cpu = MakeBackend({});
    ASSERT_TRUE(cpu.ok());
    Result<ModelWeights> w = LoadWeights(file, **cpu);
    ASSERT_TRUE(w.ok());
    ModelRunner plain(file.spec(), std::move(*cpu), std::move(*w), options);
    const int64_t vocab = file.spec().vocab_size;
    std::vector<std::vector<int32_t>> tables = {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}};
    std::vector<std::vector<int64_t>> slots(3);
    std::vector<std::vector<int32_t>> tokens = {{1, 20, 30}, {1, 40}, {}};
    std::vector<int64_t> len = {0, 0, 0};
    auto chunk = [&](size_t s, std::vector<int32_t>& t) {
        slots[s].clear();
        for (size_t i = 0; i < t.size(); ++i) {
            const int64_t pos = len[s] + int64_t(i);
            slots[s].push_back(int64_t(tables[s][pos / kBlockSize]) * kBlockSize +
                               pos % kBlockSize);
        }
        SequenceChunk c{.seq_id = int64_t(s),
                        .tokens = t,
                        .start_pos = len[s],
                        .block_table = tables[s],
                        .slot_mapping = slots[s]};
        len[s] += int64_t(t.size());
        return c;
    };
    auto run = [&](std::vector<SequenceChunk>& batch) {
        std::vector<float> a, b;
        ASSERT_TRUE(plain.Forward(batch, &a).ok());
        ASSERT_TRUE(graphs.Forward(batch, &b).ok());
        EXPECT_TRUE(a == b) << "max |diff| " << MaxAbsDiff(a, b);
        for (size_t s = 0; s < batch.size(); ++s) {
            tokens[static_cast<size_t>(batch[s].seq_id)] = {Argmax(&a[s * vocab], vocab)};
        }
    };
    std::vector<SequenceChunk> batch = {chunk(0, tokens[0]), chunk(1, tokens[1])};
    run(batch);
    for (int64_t d = 0; d < steps_before + steps_after; ++d) {
        if (d == steps_before && prefill_len > 0) {
            std::vector<int32_t> long_prompt(static_cast<size_t>(prefill_len), 7);
            std::vector<SequenceChunk> prefill = {chunk(2, long_prompt)};
            run(prefill);
        }
        batch = {chunk(0, tokens[0]), chunk(1, tokens[1])};
        run(batch);
    }
}

class DecodeGraphsCpu : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string path = SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(path, "stories260K");
        Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
        ASSERT_TRUE(file.ok()) << file.status().ToString();
        file_ = std::move(*file);
    }
    std::unique_ptr<ModelRunner> GraphRunner(RunnerOptions o, RecordingBackend** rec) {
        o.cuda_graphs = true;  // opt-in; the recording backend captures
        Result<std::unique_ptr<Backend>> cpu = MakeBackend({});
        EXPECT_TRUE(cpu.ok());
        auto r = std::make_unique<RecordingBackend>(std::move(*cpu));
        *rec = r.get();
        Result<ModelWeights> w = LoadWeights(*file_, *r);
        EXPECT_TRUE(w.ok());
        return std::make_unique<ModelRunner>(file_->spec(), std::move(r), std::move(*w), o);
    }
    RunnerOptions Options() const {
        return {.max_context = 64,
                .num_kv_blocks = 12,
                .block_size = kBlockSize,
                .max_step_tokens = 16,
                .max_step_seqs = 4};
    }
    std::unique_ptr<ModelFile> file_;
};

// An op refused inside the capture fails EndCapture: that bucket runs eagerly from then on, with
// the same logits, and nothing is captured.
TEST_F(DecodeGraphsCpu, RefusedCaptureFallsBackToEager) {
    if (file_ == nullptr) return;
    RecordingBackend* rec = nullptr;
    std::unique_ptr<ModelRunner> graphs = GraphRunner(Options(), &rec);
    rec->refuse_in_capture = "SiluMul";
    RunAgainstPlain(*file_, Options(), *graphs, 5, 0, 0);
    const DecodeGraphStats& st = graphs->decode_graphs()->stats();
    EXPECT_EQ(st.failed_captures, 1);
    EXPECT_EQ(st.captures, 0);
    EXPECT_EQ(st.replays, 0);
    EXPECT_EQ(rec->replayed_ops, 0);
    EXPECT_EQ(rec->live_graphs(), 0);
}

// A step larger than the workspace re-creates it: the graphs holding its old pointers are
// released, and the bucket warms up and is captured again.
TEST_F(DecodeGraphsCpu, WorkspaceGrowthReleasesTheGraphs) {
    if (file_ == nullptr) return;
    RecordingBackend* rec = nullptr;
    std::unique_ptr<ModelRunner> graphs = GraphRunner(Options(), &rec);
    RunAgainstPlain(*file_, Options(), *graphs, 3, 3, 40);  // 40 tokens > max_step_tokens 16
    const DecodeGraphStats& st = graphs->decode_graphs()->stats();
    EXPECT_EQ(st.captures, 2);
    EXPECT_EQ(st.releases, 1);
    // Decode steps 0-2: warm-up, capture, replay; after the prefill 3-5: the same.
    EXPECT_EQ(st.replays, 4);
    EXPECT_EQ(rec->live_graphs(), 1);
}

TEST(CudaGraphsSetting, TrueIsRefusedByNameWhereGraphsCannotBeHad) {
    const RunnerOptions unset, off{.cuda_graphs = false}, on{.cuda_graphs = true};
    EXPECT_TRUE(CheckCudaGraphs(unset, BackendKind::kCpu, false, 1).ok());
    EXPECT_TRUE(CheckCudaGraphs(off, BackendKind::kCpu, false, 1).ok());
    EXPECT_TRUE(CheckCudaGraphs(on, BackendKind::kCuda, true, 1).ok());
    const Status cpu = CheckCudaGraphs(on, BackendKind::kCpu, false, 1);
    EXPECT_EQ(cpu.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(cpu.message().find("cuda_graphs"), std::string::npos) << cpu.message();
    EXPECT_NE(cpu.message().find("cpu backend"), std::string::npos) << cpu.message();
    const Status tp = CheckCudaGraphs(on, BackendKind::kCuda, true, 2);
    EXPECT_EQ(tp.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(tp.message().find("tp 2"), std::string::npos) << tp.message();

    // MakeModelRunner refuses it before loading any weight.
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K");
    Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
    ASSERT_TRUE(file.ok());
    Result<std::unique_ptr<ModelRunner>> runner = MakeModelRunner(**file, {}, on);
    ASSERT_FALSE(runner.ok());
    EXPECT_NE(runner.status().message().find("cuda_graphs"), std::string::npos);
    // Unset on the CPU: no graphs, no padding.
    runner = MakeModelRunner(**file, {}, unset);
    ASSERT_TRUE(runner.ok()) << runner.status().ToString();
    EXPECT_EQ((*runner)->decode_graphs(), nullptr);
}

INSTANTIATE_TEST_SUITE_P(
    Models, DecodePadding,
    ::testing::Values(Case{"stories260K/stories260K.bin", false, false, BackendKind::kCpu},
                      Case{"stories260K/stories260K.bin", false, true, BackendKind::kCpu},
                      Case{"SmolLM2-135M-Instruct.Q4_1.gguf", true, false, BackendKind::kCpu},
                      Case{"SmolLM2-135M-Instruct.Q4_1.gguf", true, true, BackendKind::kCpu},
                      Case{"stories260K/stories260K.bin", false, false, BackendKind::kCuda},
                      Case{"stories260K/stories260K.bin", false, true, BackendKind::kCuda},
                      Case{"SmolLM2-135M-Instruct.Q4_1.gguf", true, false, BackendKind::kCuda},
                      Case{"SmolLM2-135M-Instruct.Q4_1.gguf", true, true, BackendKind::kCuda}),
    Name);

}  // namespace
}  // namespace kvshard
