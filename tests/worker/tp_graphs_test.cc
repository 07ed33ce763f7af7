// Decode graphs at tp > 1 (docs/cuda.md "CUDA graphs", "Tensor parallelism on GPUs").
//
// - CheckCudaGraphs' matrix: graphs are refused by name on a backend that does not capture, and
//   at tp > 1 unless the collective is queued on the backend's stream (the nccl path); the host
//   and host-staged collectives wait on the host.
// - The capture at tp 2 on the CPU: two rank threads whose backends are RecordingBackends (ops
//   recorded, not run, inside a capture; tests/worker/recording_backend.h) and whose collective
//   queues its all-reduces on that stream as NCCL does on a CUDA stream (StreamQueuedCollective
//   below), so a decode step's graph holds the all-reduces and a replay runs them, each rank
//   meeting the other inside its replay. Their logits must equal those of two ranks that pad the
//   same steps eagerly over a plain host collective, bit for bit, at every step; and a capture
//   that fails on one rank only leaves both ranks eager (the vote in CaptureStep).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/local_collective.h"
#include "model/model_file.h"
#include "tests/test_util.h"
#include "tests/worker/recording_backend.h"
#include "worker/model_runner.h"
#include "worker/rank_collective.h"
#include "worker/weights.h"

namespace kvshard {
namespace {

using testing::RecordingBackend;
using testing::SharedModel;

TEST(CudaGraphsCheck, RefusalAndAcceptanceMatrix) {
    struct Row {
        std::optional<bool> graphs;
        BackendKind kind;
        bool captures;
        int tp;
        CollectivePath path;
        bool ok;
        const char* names;  // in the refusal
    };
    const Row rows[] = {
        // Unset or false: never refused.
        {std::nullopt, BackendKind::kCpu, false, 2, CollectivePath::kHost, true, ""},
        {false, BackendKind::kCuda, true, 2, CollectivePath::kStaged, true, ""},
        // A backend that does not capture.
        {true, BackendKind::kCpu, false, 1, CollectivePath::kHost, false, "cpu backend"},
        {true, BackendKind::kCpu, false, 2, CollectivePath::kNccl, false, "cpu backend"},
        // tp 1: the collective is not read.
        {true, BackendKind::kCuda, true, 1, CollectivePath::kHost, true, ""},
        {true, BackendKind::kCuda, true, 1, CollectivePath::kStaged, true, ""},
        // tp > 1: the nccl path only.
        {true, BackendKind::kCuda, true, 2, CollectivePath::kNccl, true, ""},
        {true, BackendKind::kCuda, true, 8, CollectivePath::kNccl, true, ""},
        {true, BackendKind::kCuda, true, 2, CollectivePath::kStaged, false, "host-staged"},
        {true, BackendKind::kCuda, true, 4, CollectivePath::kHost, false, "host collective"},
    };
    for (const Row& r : rows) {
        RunnerOptions o;
        o.cuda_graphs = r.graphs;
        o.collective_path = r.path;
        const Status st = CheckCudaGraphs(o, r.kind, r.captures, r.tp);
        const std::string what = std::string(BackendKindName(r.kind)) + " tp " +
                                 std::to_string(r.tp) + " " +
                                 std::string(CollectivePathName(r.path));
        EXPECT_EQ(st.ok(), r.ok) << what << ": " << st.ToString();
        if (!r.ok) {
            EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what;
            EXPECT_NE(st.message().find("cuda_graphs: true"), std::string::npos) << st.message();
            EXPECT_NE(st.message().find(r.names), std::string::npos) << st.message();
            if (r.tp > 1 && r.captures) {
                EXPECT_NE(st.message().find("tp " + std::to_string(r.tp)), std::string::npos)
                    << st.message();
            }
        }
    }
}

// A rank's collective whose AllReduceSum is queued on the rank's RecordingBackend, as NCCL's is
// on a CUDA stream: recorded inside a capture and run by its replays, run at once otherwise.
// Errors of a replayed all-reduce are kept (a graph's kernels report nothing to the caller
// either) and checked by the test. Everything else runs on the host collective at once. Like
// NCCL's, its bytes_all_reduced counts the calls that queued an all-reduce, not what a replay
// runs.
class StreamQueuedCollective final : public Collective {
  public:
    StreamQueuedCollective(std::unique_ptr<Collective> host, RecordingBackend* stream)
        : host_(std::move(host)), stream_(stream) {}

    int rank() const override { return host_->rank(); }
    int size() const override { return host_->size(); }
    Status AllReduceSum(float* data, int64_t count) override {
        if (!stream_->capturing()) {
            KV_RETURN_IF_ERROR(host_->AllReduceSum(data, count));
        } else {
            stream_->QueueOp("AllReduceSum", [this, data, count] {
                const Status st = host_->AllReduceSum(data, count);
                if (!st.ok() && replay_error.ok()) replay_error = st;
            });
        }
        bytes_queued_ += count * int64_t(sizeof(float));
        return Status::Ok();
    }
    Status AllGather(const float* send, int64_t count_per_rank, float* recv) override {
        if (stream_->capturing()) return Internal("AllGather inside a capture");
        return host_->AllGather(send, count_per_rank, recv);
    }
    Status Broadcast(void* data, int64_t bytes, int root) override {
        if (stream_->capturing()) return Internal("Broadcast inside a capture");
        return host_->Broadcast(data, bytes, root);
    }
    Status Barrier() override { return host_->Barrier(); }
    void Abort(const std::string& reason) override { host_->Abort(reason); }
    int64_t bytes_all_reduced() const override { return bytes_queued_; }

    Status replay_error;

  private:
    std::unique_ptr<Collective> host_;
    RecordingBackend* stream_;
    int64_t bytes_queued_ = 0;
};

constexpr int kTp = 2;
constexpr int64_t kBlockSize = 16;
constexpr int64_t kMaxSeqs = 4;  // buckets 1, 2, 4
constexpr int64_t kBlocksPerSeq = 4;
constexpr int64_t kDecodeSteps = 3;  // per batch size: a bucket's warm-up, capture, replay

// Runs fn(rank) on one thread per rank and waits for all.
void OnRanks(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < kTp; ++r) threads.emplace_back(fn, r);
    for (std::thread& t : threads) t.join();
}

struct Rank {
    std::unique_ptr<StreamQueuedCollective> graph_collective;
    // What the graph runner is given, as TpGroup and worker processes give theirs.
    std::unique_ptr<RankCollective> rank_collective;
    std::unique_ptr<Collective> padded_collective;
    RecordingBackend* recording = nullptr;
    std::unique_ptr<ModelRunner> graphs;
    std::unique_ptr<ModelRunner> padded;
};

class TpGraphs : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string path = SharedModel("stories260K/stories260K.bin");
        KV_REQUIRE_FIXTURE(path, "stories260K");
        Result<std::unique_ptr<ModelFile>> file = OpenModel(path);
        ASSERT_TRUE(file.ok()) << file.status().ToString();
        file_ = std::move(*file);
    }

    RunnerOptions Options() const {
        RunnerOptions o;
        o.max_context = kBlockSize * kBlocksPerSeq;
        o.block_size = kBlockSize;
        o.num_kv_blocks = kMaxSeqs * kBlocksPerSeq;
        o.max_step_tokens = 64;
        o.max_step_seqs = kMaxSeqs;
        // The recording backend makes no single-row weight copies; neither does the padded one.
        o.pack_decode_weights = false;
        return o;
    }

    // Makes both runners of every rank (on the rank threads: the groups meet as they are used).
    // `refuse_on_rank1`: an op rank 1's recording backend refuses inside a capture.
    void MakeRanks(const std::string& refuse_on_rank1) {
        auto graph_group = LocalGroup::Create(kTp, 20'000);
        auto padded_group = LocalGroup::Create(kTp, 20'000);
        ranks_.resize(kTp);
        for (int r = 0; r < kTp; ++r) {
            Rank& k = ranks_[size_t(r)];
            Result<std::unique_ptr<Backend>> cpu = MakeBackend({});
            ASSERT_TRUE(cpu.ok());
            auto rec = std::make_unique<RecordingBackend>(std::move(*cpu));
            k.recording = rec.get();
            if (r == 1) rec->refuse_in_capture = refuse_on_rank1;
            k.graph_collective =
                std::make_unique<StreamQueuedCollective>(graph_group->Collective(r), rec.get());
            k.rank_collective = std::make_unique<RankCollective>(r, kTp);
            k.rank_collective->Attach(k.graph_collective.get());
            k.padded_collective = padded_group->Collective(r);
            const ShardSpec shard{.rank = r, .tp = kTp};
            Result<ModelWeights> gw = LoadWeights(*file_, *rec, {.shard = shard});
            ASSERT_TRUE(gw.ok()) << gw.status().ToString();
            RunnerOptions go = Options();
            go.cuda_graphs = true;
            go.collective_path = CollectivePath::kNccl;  // the collective queues on the stream
            ASSERT_TRUE(CheckCudaGraphs(go, rec->kind(), true, kTp).ok());
            k.graphs = std::make_unique<ModelRunner>(file_->spec(), std::move(rec), std::move(*gw),
                                                     go, k.rank_collective.get());
            Result<std::unique_ptr<Backend>> cpu2 = MakeBackend({});
            ASSERT_TRUE(cpu2.ok());
            Result<ModelWeights> pw = LoadWeights(*file_, **cpu2, {.shard = shard});
            ASSERT_TRUE(pw.ok()) << pw.status().ToString();
            RunnerOptions po = Options();
            po.pad_decode_to_buckets = true;
            k.padded = std::make_unique<ModelRunner>(file_->spec(), std::move(*cpu2),
                                                     std::move(*pw), po, k.padded_collective.get());
            ASSERT_NE(k.graphs->decode_graphs(), nullptr);
        }
    }

    // Prefills kMaxSeqs prompts, then decodes batches of 1..kMaxSeqs sequences, kDecodeSteps
    // each, on every rank's two runners; every logit of the graph runner must equal the padded
    // runner's, and rank 1's rank 0's. Returns the decode steps run.
    int64_t Run() {
        const int64_t vocab = file_->spec().vocab_size;
        std::vector<std::vector<int32_t>> tables(kMaxSeqs);
        for (int64_t s = 0; s < kMaxSeqs; ++s) {
            for (int64_t k = 0; k < kBlocksPerSeq; ++k)
                tables[size_t(s)].push_back(static_cast<int32_t>(s * kBlocksPerSeq + k));
        }
        std::vector<std::vector<int64_t>> slots(kMaxSeqs);
        std::vector<int64_t> len(kMaxSeqs, 0);
        std::vector<std::vector<int32_t>> prompts(kMaxSeqs);
        for (int64_t s = 0; s < kMaxSeqs; ++s) {
            for (int64_t i = 0; i <= 2 * s + 1; ++i)
                prompts[size_t(s)].push_back(static_cast<int32_t>((s * 37 + i * 11 + 5) % 500 + 3));
        }
        std::vector<int32_t> next(kMaxSeqs);
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
            return c;
        };
        int64_t decode_steps = 0;
        auto step = [&](const std::vector<SequenceChunk>& batch, const std::string& what) {
            std::vector<float> logits[kTp][2];
            OnRanks([&](int r) {
                Rank& k = ranks_[size_t(r)];
                const Status g = k.graphs->Forward(batch, &logits[r][0]);
                EXPECT_TRUE(g.ok()) << what << " rank " << r << " graphs: " << g.ToString();
                const Status p = k.padded->Forward(batch, &logits[r][1]);
                EXPECT_TRUE(p.ok()) << what << " rank " << r << " padded: " << p.ToString();
            });
            for (int r = 0; r < kTp; ++r) {
                EXPECT_EQ(logits[r][1].size(), batch.size() * size_t(vocab)) << what;
                EXPECT_TRUE(logits[r][0] == logits[r][1])
                    << what << " rank " << r << ": graphs vs padded";
                EXPECT_TRUE(logits[r][0] == logits[0][0]) << what << " rank " << r << " vs 0";
                EXPECT_TRUE(ranks_[size_t(r)].graph_collective->replay_error.ok())
                    << what << ": " << ranks_[size_t(r)].graph_collective->replay_error.ToString();
            }
            for (size_t s = 0; s < batch.size(); ++s) {
                const float* row = &logits[0][1][s * size_t(vocab)];
                next[size_t(batch[s].seq_id)] =
                    static_cast<int32_t>(std::max_element(row, row + vocab) - row);
                len[size_t(batch[s].seq_id)] += int64_t(batch[s].tokens.size());
            }
        };
        std::vector<SequenceChunk> batch;
        for (int64_t s = 0; s < kMaxSeqs; ++s) batch.push_back(chunk(s, prompts[size_t(s)]));
        step(batch, "prefill");
        for (int64_t b = 1; b <= kMaxSeqs; ++b) {
            for (int64_t d = 0; d < kDecodeSteps; ++d) {
                batch.clear();
                for (int64_t s = 0; s < b; ++s)
                    batch.push_back(chunk(s, std::span<const int32_t>(&next[size_t(s)], 1)));
                step(batch, "batch " + std::to_string(b) + " decode " + std::to_string(d));
                ++decode_steps;
            }
        }
        return decode_steps;
    }

    std::unique_ptr<ModelFile> file_;
    std::vector<Rank> ranks_;
};

TEST_F(TpGraphs, ReplaysWithTheirAllReducesGiveTheEagerLogits) {
    if (file_ == nullptr) return;
    MakeRanks("");
    const int64_t decode_steps = Run();
    for (int r = 0; r < kTp; ++r) {
        const Rank& k = ranks_[size_t(r)];
        const DecodeGraphStats& st = k.graphs->decode_graphs()->stats();
        // Buckets 1, 2 and 4 (batches 3 and 4): warmed up, captured once, replayed after.
        EXPECT_EQ(st.captures, 3) << "rank " << r;
        EXPECT_EQ(st.failed_captures, 0) << "rank " << r;
        EXPECT_EQ(st.replays, decode_steps - 3) << "rank " << r;
        EXPECT_EQ(k.recording->live_graphs(), 3) << "rank " << r;
        EXPECT_GT(k.recording->replayed_ops, 0) << "rank " << r;
        // The replays' all-reduces are counted as the eager steps' are.
        EXPECT_EQ(k.graphs->comm_stats().layer_all_reduce_bytes,
                  k.padded->comm_stats().layer_all_reduce_bytes)
            << "rank " << r;
        EXPECT_EQ(k.graphs->comm_stats().embedding_all_reduce_bytes,
                  k.padded->comm_stats().embedding_all_reduce_bytes)
            << "rank " << r;
        // And so are they by the collective (as NCCL's, it counts only the calls): the eager
        // runner's bytes, and the vote after each capture (one float).
        EXPECT_GT(k.padded_collective->bytes_all_reduced(), 0);
        EXPECT_EQ(k.rank_collective->bytes_all_reduced(),
                  k.padded_collective->bytes_all_reduced() + 3 * int64_t(sizeof(float)))
            << "rank " << r;
    }
}

TEST_F(TpGraphs, ACaptureFailedOnOneRankLeavesEveryRankEager) {
    if (file_ == nullptr) return;
    MakeRanks("SiluMul");  // refused inside rank 1's captures only
    const int64_t decode_steps = Run();
    for (int r = 0; r < kTp; ++r) {
        const Rank& k = ranks_[size_t(r)];
        const DecodeGraphStats& st = k.graphs->decode_graphs()->stats();
        EXPECT_EQ(st.captures, 0) << "rank " << r;
        EXPECT_EQ(st.failed_captures, 3) << "rank " << r;
        EXPECT_EQ(st.replays, 0) << "rank " << r;
        EXPECT_EQ(k.recording->live_graphs(), 0) << "rank " << r;
        EXPECT_EQ(k.recording->replayed_ops, 0) << "rank " << r;
        // The discarded captures' all-reduces never ran: counted once, by the eager steps.
        EXPECT_EQ(k.graphs->comm_stats().layer_all_reduce_bytes,
                  k.padded->comm_stats().layer_all_reduce_bytes)
            << "rank " << r;
        EXPECT_EQ(k.graphs->comm_stats().embedding_all_reduce_bytes,
                  k.padded->comm_stats().embedding_all_reduce_bytes)
            << "rank " << r;
        EXPECT_EQ(k.rank_collective->bytes_all_reduced(),
                  k.padded_collective->bytes_all_reduced() + 3 * int64_t(sizeof(float)))
            << "rank " << r;
    }
    EXPECT_GT(decode_steps, 0);
}

}  // namespace
}  // namespace kvshard
