// The host-staged collective (worker/staged_collective.h) and the choice of a rank's collective
// (worker/rank_collective.h): on a fake device whose memory the host cannot read directly and
// whose copies run only at Synchronize, the staged operations give the host collective's results;
// and tensor-parallel groups whose all-reduces go through the staging (worker threads over a
// LocalGroup, and ranks over Gloo meeting in a store as worker processes do) give tp 1's greedy
// tokens on stories260K and the default model.
#include "worker/staged_collective.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/collective_store.h"
#include "comm/local_collective.h"
#include "common/build_config.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "tests/test_util.h"
#include "worker/generator.h"
#include "worker/rank_collective.h"
#include "worker/tp_group.h"

namespace kvshard {
namespace {

using testing::DefaultModel;
using testing::SharedModel;

// A device stand-in: its addresses are the host allocation moved by kFar (reading one directly
// faults), and copies are queued, run only by Synchronize, as on a stream. Only memory and copies
// are implemented; the ops are not this test's business.
class FarBackend final : public Backend {
  public:
    static constexpr uintptr_t kFar = uintptr_t{1} << 44;

    BackendKind kind() const override { return BackendKind::kCuda; }
    std::string Describe() const override { return "far (test)"; }

    Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
        queued_.push_back([=] { std::memcpy(Near(dst), src, bytes); });
        return Status::Ok();
    }
    Status CopyToHost(void* dst, const void* src, size_t bytes) override {
        queued_.push_back([=] { std::memcpy(dst, Near(src), bytes); });
        return Status::Ok();
    }
    Status Synchronize() override {
        ++syncs;
        for (auto& f : queued_) f();
        queued_.clear();
        return Status::Ok();
    }

    // Test access to device memory.
    void Write(void* dst, const std::vector<float>& v) {
        std::memcpy(Near(dst), v.data(), v.size() * sizeof(float));
    }
    std::vector<float> Read(const void* src, size_t n) {
        std::vector<float> v(n);
        std::memcpy(v.data(), Near(src), n * sizeof(float));
        return v;
    }
    int syncs = 0;

    void Embedding(const WeightView&, int64_t, const int32_t*, int64_t, float*) override { Op(); }
    void MatMul(const float*, int64_t, const WeightView&, float*) override { Op(); }
    void RmsNorm(const float*, const float*, float*, int64_t, int64_t, float) override { Op(); }
    void AddRmsNorm(float*, const float*, const float*, float*, int64_t, int64_t, float) override {
        Op();
    }
    void Add(float*, const float*, int64_t) override { Op(); }
    void Rope(float*, int64_t, const int32_t*, int64_t, int64_t, int64_t, const float*) override {
        Op();
    }
    void SiluMul(const float*, int64_t, int64_t, float*) override { Op(); }
    void KvWrite(const PagedKvLayer&, const float*, const float*, int64_t, const int64_t*,
                 int64_t) override {
        Op();
    }
    void PagedAttention(const float*, int64_t, const PagedKvLayer&, const PagedAttentionBatch&,
                        float*, int64_t, const int32_t*) override {
        Op();
    }
    void CopyBlocks(void*, int64_t, const int32_t*, int64_t) override { Op(); }
    void GatherRows(const float*, int64_t, const int32_t*, int64_t, float*) override { Op(); }

  protected:
    Result<void*> AllocateRaw(size_t bytes) override {
        void* p = std::malloc(bytes);
        return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) + kFar);
    }
    void FreeRaw(void* data, size_t) override { std::free(Near(data)); }

  private:
    static void* Near(const void* p) {
        return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) - kFar);
    }
    static void Op() { ADD_FAILURE() << "an op was queued on the collective's backend"; }
    std::vector<std::function<void()>> queued_;
};

// Runs fn(rank) on `tp` threads at once.
void OnRanks(int tp, const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r) threads.emplace_back(fn, r);
    for (std::thread& t : threads) t.join();
}

TEST(StagedCollective, AllReduceAllGatherBroadcastOnDeviceMemory) {
    constexpr int kTp = 3;
    constexpr int64_t kN = 1000;
    std::shared_ptr<LocalGroup> group = LocalGroup::Create(kTp);
    std::vector<std::vector<float>> reduced(kTp), gathered(kTp), broadcast(kTp);
    std::vector<int> syncs(kTp);
    std::vector<int64_t> counted(kTp);
    OnRanks(kTp, [&](int rank) {
        std::unique_ptr<Collective> host = group->Collective(rank);
        FarBackend backend;
        StagedCollective staged(*host, backend);
        EXPECT_EQ(staged.rank(), rank);
        EXPECT_EQ(staged.size(), kTp);
        Result<BackendBuffer> data = backend.Allocate(kN * sizeof(float));
        Result<BackendBuffer> all = backend.Allocate(kTp * kN * sizeof(float));
        ASSERT_TRUE(data.ok() && all.ok());
        std::vector<float> mine(kN);
        for (int64_t i = 0; i < kN; ++i) mine[static_cast<size_t>(i)] = 0.25f * rank + 0.125f * i;
        backend.Write(data->data(), mine);
        // Queued work (a copy standing for the ops that wrote the buffer) before the call.
        ASSERT_TRUE(backend.CopyToDevice(data->data(), mine.data(), kN * sizeof(float)).ok());
        ASSERT_TRUE(staged.AllGather(data->As<float>(), kN, all->As<float>()).ok());
        gathered[static_cast<size_t>(rank)] = backend.Read(all->data(), kTp * kN);
        ASSERT_TRUE(staged.AllReduceSum(data->As<float>(), kN).ok());
        reduced[static_cast<size_t>(rank)] = backend.Read(data->data(), kN);
        backend.Write(data->data(), std::vector<float>(kN, static_cast<float>(rank + 7)));
        ASSERT_TRUE(staged.Broadcast(data->data(), kN * sizeof(float), 1).ok());
        broadcast[static_cast<size_t>(rank)] = backend.Read(data->data(), kN);
        ASSERT_TRUE(staged.Barrier().ok());
        syncs[static_cast<size_t>(rank)] = backend.syncs;
        counted[static_cast<size_t>(rank)] = staged.bytes_all_reduced();
    });
    for (int rank = 0; rank < kTp; ++rank) {
        const auto r = static_cast<size_t>(rank);
        for (int64_t i = 0; i < kN; ++i) {
            const auto k = static_cast<size_t>(i);
            // Exact in float (multiples of 1/8), so any order gives these bits.
            const float expected =
                ((0.0f + 0.125f * i) + (0.25f + 0.125f * i)) + (0.5f + 0.125f * i);
            ASSERT_EQ(reduced[r][k], expected) << "rank " << rank << " element " << i;
            for (int q = 0; q < kTp; ++q) {
                ASSERT_EQ(gathered[r][static_cast<size_t>(q) * kN + k], 0.25f * q + 0.125f * i);
            }
            ASSERT_EQ(broadcast[r][k], 8.0f);
        }
        // Each of the three payload calls waits for the stream on the way out and back in.
        EXPECT_EQ(syncs[r], 6);
        EXPECT_EQ(counted[r], kN * 4);
    }
}

TEST(StagedCollective, AbortBreaksTheHostGroup) {
    std::shared_ptr<LocalGroup> group = LocalGroup::Create(2, 10'000);
    std::unique_ptr<Collective> host = group->Collective(0);
    FarBackend backend;
    StagedCollective staged(*host, backend);
    staged.Abort("test");
    Result<BackendBuffer> data = backend.Allocate(16);
    ASSERT_TRUE(data.ok());
    EXPECT_EQ(staged.AllReduceSum(data->As<float>(), 4).code(), StatusCode::kAborted);
}

TEST(RankCollective, FailsUntilAttachedAndForwardsAnEarlyAbort) {
    std::shared_ptr<LocalGroup> group = LocalGroup::Create(2, 10'000);
    std::unique_ptr<Collective> host = group->Collective(1);
    RankCollective rc(1, 2);
    float x = 1;
    const Status before = rc.AllReduceSum(&x, 1);
    EXPECT_EQ(before.code(), StatusCode::kInternal);
    EXPECT_NE(before.message().find("rank 1"), std::string::npos) << before.message();
    rc.Abort("peer died");
    rc.Attach(host.get());
    EXPECT_TRUE(rc.attached());
    EXPECT_EQ(rc.AllReduceSum(&x, 1).code(), StatusCode::kAborted);
}

TEST(RankCollective, AttachingTheStagedPathWrapsTheHostCollective) {
    std::shared_ptr<LocalGroup> group = LocalGroup::Create(1);
    std::unique_ptr<Collective> host = group->Collective(0);
    FarBackend backend;
    RankCollective rc(0, 1);
    ASSERT_TRUE(AttachBackendCollective(
                    {.path = CollectivePath::kStaged, .rank = 0, .size = 1, .host = host.get()},
                    backend, rc)
                    .ok());
    Result<BackendBuffer> data = backend.Allocate(8);
    ASSERT_TRUE(data.ok());
    backend.Write(data->data(), {3.0f, 4.0f});
    ASSERT_TRUE(rc.AllReduceSum(data->As<float>(), 2).ok());  // would fault unstaged
    EXPECT_EQ(backend.Read(data->data(), 2), (std::vector<float>{3.0f, 4.0f}));
    EXPECT_EQ(rc.bytes_all_reduced(), 8);

    RankCollective none(0, 1);
    EXPECT_EQ(AttachBackendCollective({.path = CollectivePath::kStaged}, backend, none).code(),
              StatusCode::kInvalidArgument);
    // NCCL needs the CUDA backend's stream; the fake has none.
    EXPECT_EQ(AttachBackendCollective({.path = CollectivePath::kNccl, .rank = 0, .size = 1},
                                      backend, none)
                  .code(),
              StatusCode::kInvalidArgument);
    EXPECT_FALSE(none.attached());
}

TEST(CollectivePathChoice, Table) {
    struct Case {
        BackendKind backend;
        int tp;
        std::vector<int> devices;
        bool nccl, force;
        CollectivePath want;
    };
    using enum CollectivePath;
    const Case cases[] = {
        {BackendKind::kCpu, 2, {}, true, false, kHost},
        {BackendKind::kCpu, 2, {}, false, true, kStaged},
        {BackendKind::kCuda, 2, {0, 1}, true, false, kNccl},
        {BackendKind::kCuda, 2, {0, 1}, true, true, kStaged},
        {BackendKind::kCuda, 2, {0, 1}, false, false, kStaged},  // no NCCL (id)
        {BackendKind::kCuda, 2, {0, 0}, true, false, kStaged},   // one GPU, two ranks
        {BackendKind::kCuda, 4, {0, 1, 2, 1}, true, false, kStaged},
        {BackendKind::kCuda, 4, {3, 2, 1, 0}, true, false, kNccl},
        {BackendKind::kCuda, 2, {}, true, false, kStaged},  // devices unknown
    };
    for (const Case& c : cases) {
        EXPECT_EQ(ChooseCollectivePath({.backend = c.backend,
                                        .tp = c.tp,
                                        .devices = c.devices,
                                        .nccl_available = c.nccl,
                                        .force_staged = c.force}),
                  c.want)
            << BackendKindName(c.backend) << " tp " << c.tp << " devices " << c.devices.size()
            << " nccl " << c.nccl << " force " << c.force;
    }
}

std::unique_ptr<ModelFile> Open(const std::string& path) {
    Result<std::unique_ptr<ModelFile>> f = OpenModel(path);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    return f.ok() ? std::move(*f) : nullptr;
}

RunnerOptions SmallRunner() {
    RunnerOptions o;
    o.max_context = 256;
    o.num_kv_blocks = RunnerOptions::kOneSequence;
    return o;
}

// Greedy tokens of an embedded group at `tp` (staged when asked) and the path it took.
std::vector<int32_t> GroupTokens(const ModelFile& model, int tp, bool staged,
                                 const std::vector<int32_t>& prompt, int64_t max_tokens,
                                 CollectivePath* path) {
    TpGroupConfig c{.tp = tp, .runner = SmallRunner()};
    c.force_staged = staged;
    Result<std::unique_ptr<TpGroup>> group = TpGroup::Create(model, c);
    EXPECT_TRUE(group.ok()) << group.status().ToString();
    if (!group.ok()) return {};
    *path = (*group)->collective_path();
    Result<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(model.tokenizer_data());
    EXPECT_TRUE(tok.ok());
    GenerateOptions g;
    g.max_tokens = max_tokens;
    Result<GenerateResult> r = GenerateOnEveryRank(**group, **tok, prompt, g);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->token_ids : std::vector<int32_t>{};
}

// Greedy tokens of `tp` ranks that meet as worker processes do: a Gloo group in one store
// (the coordinator's, in process mode), each rank's all-reduces staged through its backend.
std::vector<int32_t> GlooStagedTokens(const ModelFile& model, int tp,
                                      const std::vector<int32_t>& prompt, int64_t max_tokens) {
    auto store = std::make_shared<MemoryCollectiveStore>();
    std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(tp));
    OnRanks(tp, [&](int rank) {
        CollectiveConfig cc;
        cc.kind = CollectiveConfig::Kind::kGloo;
        cc.rank = rank;
        cc.size = tp;
        cc.timeout_ms = 60'000;
        cc.gloo_store = store;
        Result<std::unique_ptr<Collective>> gloo = MakeCollective(cc);
        ASSERT_TRUE(gloo.ok()) << gloo.status().ToString();
        RankCollective rc(rank, tp);
        Result<std::unique_ptr<ModelRunner>> runner =
            MakeModelRunner(model, {.rank = rank, .tp = tp}, SmallRunner(), &rc);
        ASSERT_TRUE(runner.ok()) << runner.status().ToString();
        ASSERT_TRUE(
            AttachBackendCollective(
                {.path = CollectivePath::kStaged, .rank = rank, .size = tp, .host = gloo->get()},
                (*runner)->backend(), rc)
                .ok());
        Result<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(model.tokenizer_data());
        ASSERT_TRUE(tok.ok());
        GenerateOptions g;
        g.max_tokens = max_tokens;
        Result<GenerateResult> r = Generate(**runner, **tok, prompt, g);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        tokens[static_cast<size_t>(rank)] = r->token_ids;
        EXPECT_GT(rc.bytes_all_reduced(), 0);
    });
    for (int r = 1; r < tp; ++r) EXPECT_EQ(tokens[static_cast<size_t>(r)], tokens[0]) << r;
    return tokens[0];
}

void ExpectStagedSameAsTp1(const ModelFile& model, const std::vector<int32_t>& prompt,
                           int64_t max_tokens, const std::vector<int>& tps) {
    CollectivePath path = CollectivePath::kHost;
    const std::vector<int32_t> ref = GroupTokens(model, 1, false, prompt, max_tokens, &path);
    ASSERT_EQ(static_cast<int64_t>(ref.size()), max_tokens);
    for (int tp : tps) {
        EXPECT_EQ(GroupTokens(model, tp, true, prompt, max_tokens, &path), ref)
            << "threads, tp " << tp;
        EXPECT_EQ(path, CollectivePath::kStaged);
        EXPECT_EQ(GroupTokens(model, tp, false, prompt, max_tokens, &path), ref) << "tp " << tp;
        EXPECT_EQ(path, CollectivePath::kHost);
        if (KVSHARD_WITH_GLOO) {
            EXPECT_EQ(GlooStagedTokens(model, tp, prompt, max_tokens), ref) << "gloo, tp " << tp;
        }
    }
}

TEST(StagedTp, Stories260KGivesTp1Tokens) {
    const std::string path = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(path, "stories260K.bin");
    std::unique_ptr<ModelFile> f = Open(path);
    ASSERT_NE(f, nullptr);
    ExpectStagedSameAsTp1(*f, {1, 403, 407, 261, 378}, 32, {2, 4});
}

TEST(StagedTp, DefaultModelGivesTp1Tokens) {
    const std::string path = DefaultModel();
    KV_REQUIRE_FIXTURE(path, "the default model (scripts/fetch-model)");
    std::unique_ptr<ModelFile> f = Open(path);
    ASSERT_NE(f, nullptr);
    Result<std::unique_ptr<Tokenizer>> tok = Tokenizer::Create(f->tokenizer_data());
    ASSERT_TRUE(tok.ok());
    const std::vector<int32_t> prompt = (*tok)->Encode("The capital of France is", {});
    ASSERT_FALSE(prompt.empty());
    ExpectStagedSameAsTp1(*f, prompt, 8, {2});
}

}  // namespace
}  // namespace kvshard
