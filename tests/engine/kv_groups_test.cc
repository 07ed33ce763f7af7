// KV cache groups (sliding-window KV, kv/kv_cache_groups.h) end to end:
// - Gemma 3 27B at a 32k-token context through the coordinator's real Scheduler and BlockManager
//   (a table per group, the window releasing what no query reads), with the bytes of a block as the
//   worker's KvPool sizes them: the KV a sequence holds equals the planner's sliding-window figure
//   within one block per group, against the all-global figure without groups.
// - The synthetic windowed models (mistral: one windowed group; gemma3: a full group and two
//   windowed ones) served by the engine, whose windowed tables hold kv::kNoBlock once the window
//   passes, give the seeded tokens of a runner that keeps every block (FixedBlockTables).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "config/arch_config.h"
#include "coordinator/engine.h"
#include "coordinator/scheduler.h"
#include "kernels/backend.h"
#include "kv/capacity_planner.h"
#include "kv/kv_cache_groups.h"
#include "model/model_file.h"
#include "model/synthetic_gguf.h"
#include "model/tokenizer.h"
#include "tests/engine/collecting_sink.h"
#include "tests/test_util.h"
#include "worker/kv_pool.h"
#include "worker/local_model.h"
#include "worker/sampler.h"
#include "worker/sequence_slots.h"
#include "worker/step_runner.h"

namespace kvshard {
namespace {

constexpr int64_t kContext = 32768;
constexpr int64_t kBlock = 16;

// Bytes of one block of a worker's pool holding the 27B's 16 KV heads of 128 (fp32, tp 1) with
// `groups`' layout (one group of every layer when groups is null).
int64_t PoolBlockBytes(const ArchConfig& arch, const kv::KvCacheGroups* groups) {
    Result<std::unique_ptr<Backend>> backend = MakeBackend(BackendConfig{});
    KV_CHECK(backend.ok()) << backend.status().ToString();
    KvPoolConfig c{
        .num_blocks = 1,
        .block_size = kBlock,
        .num_layers = arch.num_layers,
        .layers_per_group = groups != nullptr ? groups->layers_per_group : 0,
        .slot_of_layer = groups != nullptr ? groups->slot_of_layer : std::vector<int64_t>{},
        .num_kv_heads = arch.num_kv_heads,
        .head_dim = arch.head_dim,
        .storage = KvDtype::kFp32};
    Result<std::unique_ptr<KvPool>> pool = KvPool::Create(c, **backend);
    KV_CHECK(pool.ok()) << pool.status().ToString();
    return (*pool)->bytes_per_block();
}

// A 32,767-token prompt scheduled as the engine schedules it (chunks of 512), then one decode to
// 32,768 tokens: the blocks the sequence holds at the end, over every group.
int64_t HeldBlocksAt32k(std::vector<int64_t> group_windows) {
    const int64_t groups = std::max<int64_t>(1, static_cast<int64_t>(group_windows.size()));
    kv::BlockManager blocks(kv::BlockManagerConfig{.num_blocks = groups * (kContext / kBlock) + 64,
                                                   .block_size = kBlock,
                                                   .watermark = 0.0,
                                                   .enable_prefix_caching = true,
                                                   .group_windows = std::move(group_windows)});
    Scheduler scheduler(SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 512}, blocks);
    Sequence seq;
    seq.seq_id = 1;
    for (int64_t i = 0; i < kContext - 1; ++i) seq.token_ids.push_back(int32_t(3 + i % 30000));
    seq.num_prompt_tokens = kContext - 1;
    scheduler.AddWaiting(&seq);
    int64_t steps = 0;
    while (seq.num_generated == 0) {
        const StepPlan plan = scheduler.Schedule();
        EXPECT_EQ(plan.sequences.size(), 1u);
        if (plan.sequences.empty()) return -1;
        // Every group's table travels in the plan; the windowed ones with released entries.
        EXPECT_EQ(static_cast<int64_t>(plan.sequences[0].group_block_tables.size()), groups - 1);
        scheduler.OnStepComputed(plan);
        if (plan.sequences[0].sample) scheduler.AppendToken(&seq, 7);
        ++steps;
    }
    EXPECT_EQ(steps, (kContext - 1 + 511) / 512);
    const StepPlan decode = scheduler.Schedule();  // the token at position 32,767
    EXPECT_EQ(decode.sequences.size(), 1u);
    scheduler.OnStepComputed(decode);
    EXPECT_TRUE(blocks.CheckInvariants().ok()) << blocks.CheckInvariants().ToString();
    const int64_t held = blocks.NumHeldBlocks(1);
    scheduler.Remove(&seq);
    return held;
}

TEST(KvGroupsServing, Gemma3At32kHoldsThePlannersSlidingWindowBytes) {
    Result<ArchConfig> arch =
        ReadArchConfig(std::string(KVSHARD_SOURCE_DIR) + "/tests/kv/configs/gemma-3-27b-it.json");
    ASSERT_TRUE(arch.ok()) << arch.status().ToString();
    kv::PlannerInput in;
    in.context_tokens = kContext;
    in.block_size = kBlock;
    Result<kv::CapacityPlan> bf16 = kv::PlanCapacity(*arch, in);
    ASSERT_TRUE(bf16.ok()) << bf16.status().ToString();
    EXPECT_EQ(bf16->kv_bytes_per_token, 507904);  // the seed's all-global figure (`kvshard plan`)
    in.kv_dtype = KvDtype::kFp32;             // the CPU pool's storage
    Result<kv::CapacityPlan> plan = kv::PlanCapacity(*arch, in);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();

    // What `kvshard serve` gives the engine and the workers: the groups of the layers' windows.
    Result<kv::KvCacheGroups> groups = kv::MakeKvCacheGroups(kv::LayerWindows(*arch));
    ASSERT_TRUE(groups.ok()) << groups.status().ToString();
    ASSERT_EQ(groups->num_groups(), 31);  // 10 global and 52 local layers in groups of 2
    const int64_t block_bytes = PoolBlockBytes(*arch, &*groups);
    const int64_t all_layer_block_bytes = PoolBlockBytes(*arch, nullptr);
    EXPECT_EQ(block_bytes * 31, all_layer_block_bytes);
    EXPECT_EQ(all_layer_block_bytes, plan->kv_bytes_per_block_per_gpu);

    const int64_t windowed = HeldBlocksAt32k(groups->BlockManagerWindows()) * block_bytes;
    const int64_t all_global = HeldBlocksAt32k({}) * all_layer_block_bytes;
    std::printf(
        "[ Gemma 3 27B, 32k, fp32 pool ] held per sequence: %lld B with KV cache groups, "
        "%lld B without; planner: %lld B windowed, %lld B all-global "
        "(bf16: %lld B windowed, %lld B all-global = 507,904 B/token)\n",
        static_cast<long long>(windowed), static_cast<long long>(all_global),
        static_cast<long long>(plan->kv_bytes_per_sequence_real),
        static_cast<long long>(plan->kv_bytes_per_sequence),
        static_cast<long long>(bf16->kv_bytes_per_sequence_real),
        static_cast<long long>(bf16->kv_bytes_per_sequence));
    EXPECT_LE(std::llabs(windowed - plan->kv_bytes_per_sequence_real),
              groups->num_groups() * block_bytes);
    EXPECT_EQ(all_global, plan->kv_bytes_per_sequence);
    EXPECT_EQ(all_global, 2 * 507904LL * kContext);
    EXPECT_LT(5 * windowed, all_global);  // 5.3 times less
}

// The synthetic windowed models served by the engine (releasing blocks) against a runner that
// keeps every block, both sampling with the same seed.
class KvGroupsEngine : public ::testing::TestWithParam<const char*> {
  protected:
    std::vector<int32_t> Prompt() const {
        std::vector<int32_t> p;
        for (int i = 0; i < 40; ++i) p.push_back(3 + (i * 41 + 7) % 250);
        return p;
    }

    testing::TempDir dir_;
};

TEST_P(KvGroupsEngine, ReleasedBlocksLeaveTheTokensOfAllBlocksKept) {
    const std::string path = dir_.File(std::string(GetParam()) + ".gguf");
    ASSERT_TRUE(SyntheticArchGguf(GetParam()).WriteFile(path).ok());
    constexpr int64_t kMaxTokens = 40;
    SamplingParams sampling;
    sampling.temperature = 1.0f;
    sampling.seed = 11;
    const std::vector<int32_t> prompt = Prompt();

    LocalModelOptions o;
    o.runner.max_context = 128;
    o.runner.block_size = kBlock;
    o.runner.num_kv_blocks = 64;
    Result<LocalModel> m = LoadLocalModel(path, o);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ModelRunner& runner = *m->runner;
    const kv::KvCacheGroups& groups = runner.kv_groups();

    // Every block kept: one prefill, then a decode step per token.
    std::vector<int32_t> want;
    {
        FixedBlockTables tables(1, 128, kBlock, groups.num_groups());
        Sampler sampler(sampling);
        std::vector<int32_t> context = prompt;
        int64_t pos = 0;
        std::vector<float> logits;
        while (static_cast<int64_t>(want.size()) < kMaxTokens) {
            SequenceChunk c{.seq_id = 1,
                            .tokens = std::span<const int32_t>(context).subspan(size_t(pos)),
                            .start_pos = pos};
            tables.Place(0, &c);
            ASSERT_TRUE(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).ok());
            pos = static_cast<int64_t>(context.size());
            want.push_back(sampler.Sample(logits.data(), runner.spec().vocab_size));
            context.push_back(want.back());
        }
    }

    StepRunner executor(runner);
    InstanceEngineConfig c;
    c.scheduler.max_num_seqs = 4;
    c.scheduler.max_num_batched_tokens = 64;
    c.blocks.num_blocks = 64;
    c.blocks.block_size = kBlock;
    c.blocks.group_windows = groups.BlockManagerWindows();
    c.max_context = 128;
    InstanceEngine engine(c, *m->tokenizer, executor);
    engine.Start();
    GenerationRequest r;
    r.request_id = "windowed";
    r.prompt_token_ids = prompt;
    r.max_tokens = kMaxTokens;
    r.ignore_eos = true;
    r.sampling = sampling;
    auto sink = std::make_shared<CollectingSink>(1);
    ASSERT_TRUE(engine.Submit(r, sink).ok());
    sink->Wait();
    ASSERT_TRUE(sink->status_.ok()) << sink->status_.ToString();
    EXPECT_EQ(sink->ids_[0], want);
    engine.Stop();
    const kv::BlockManagerStats stats = engine.BlockStats();
    // The windows (8 and 6 tokens) let go of the blocks behind them as the sequence grew to 80.
    EXPECT_GT(stats.num_window_released, 0);
    EXPECT_EQ(stats.num_used_blocks, 0);
}

// A handed-off sequence (its first 40 positions' KV arrives) takes, in a windowed group, only the
// blocks a query at position 40 or later reads.
TEST(KvGroupsHandoff, IncomingTokensTakeOnlyTheWindowsBlocks) {
    kv::BlockManager blocks(kv::BlockManagerConfig{.num_blocks = 32,
                                                   .block_size = 4,
                                                   .watermark = 0.0,
                                                   .enable_prefix_caching = true,
                                                   .group_windows = {0, 8}});
    std::vector<int32_t> tokens;
    for (int i = 0; i < 41; ++i) tokens.push_back(100 + i);  // the prompt and its first token
    const kv::SequenceRequest req{.seq_id = 1, .prompt_token_ids = tokens, .incoming_tokens = 40};
    ASSERT_TRUE(blocks.CanAllocate(req));
    blocks.Allocate(req);
    // Group 1 reads positions 33 .. 40 from the first decode on: entries 8 .. 10 of 11.
    EXPECT_EQ(blocks.NumReleasedBlocks(1, 1), 8);
    EXPECT_EQ(blocks.NumHeldBlocks(1), 11 + 3);
    EXPECT_EQ(blocks.Stats().num_free_blocks, 32 - 14);
    EXPECT_EQ(blocks.BlockTable(1, 1)[7], kv::kNoBlock);
    EXPECT_NE(blocks.BlockTable(1, 1)[8], kv::kNoBlock);
    blocks.MarkComputed(1, 41);
    EXPECT_TRUE(blocks.CheckInvariants().ok()) << blocks.CheckInvariants().ToString();
    blocks.Free(1);
    EXPECT_EQ(blocks.num_available_blocks(), 32);
    // Without windows nothing changes: every entry is taken.
    kv::BlockManager one(kv::BlockManagerConfig{.num_blocks = 32, .block_size = 4});
    one.Allocate({.seq_id = 1, .prompt_token_ids = tokens, .incoming_tokens = 40});
    EXPECT_EQ(one.NumHeldBlocks(1), 11);
}

// A plan that names no block where a window still reads, or lacks a group's table, is refused
// before anything is computed.
TEST(KvGroupsRunner, RefusesTablesThatDoNotMatchTheGroups) {
    testing::TempDir dir;
    const std::string path = dir.File("gemma3.gguf");
    ASSERT_TRUE(SyntheticArchGguf("gemma3").WriteFile(path).ok());
    LocalModelOptions o;
    o.runner.max_context = 64;
    o.runner.block_size = kBlock;
    o.runner.num_kv_blocks = 16;
    Result<LocalModel> m = LoadLocalModel(path, o);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ModelRunner& runner = *m->runner;
    ASSERT_EQ(runner.kv_groups().num_groups(), 3);  // layer 2 global; layers 0 and 1 windowed (6)
    const std::vector<int32_t> token = {5};
    std::vector<float> logits;
    // Position 20: the window reads 15 .. 20, so entry 0 (positions 0 .. 15) is still read.
    const std::vector<int32_t> full = {0, 1};
    const std::vector<int64_t> slots0 = {1 * kBlock + 4};
    std::vector<std::vector<int32_t>> tables = {{kv::kNoBlock, 3}, {4, 5}};
    std::vector<std::vector<int64_t>> slots = {{3 * kBlock + 4}, {5 * kBlock + 4}};
    SequenceChunk c{.seq_id = 1,
                    .tokens = token,
                    .start_pos = 20,
                    .block_table = full,
                    .slot_mapping = slots0,
                    .group_block_tables = tables,
                    .group_slot_mappings = slots};
    Status st = runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("KV cache group 1: block -1 at entry 0"), std::string::npos)
        << st.ToString();
    // At position 22 the window reads 17 .. 22: entry 0 may be released.
    c.start_pos = 22;
    const std::vector<int64_t> slots0_22 = {1 * kBlock + 6};
    slots = {{3 * kBlock + 6}, {5 * kBlock + 6}};
    c.slot_mapping = slots0_22;
    c.group_slot_mappings = slots;
    EXPECT_TRUE(runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits).ok());
    // The full-attention group reads every position: no entry of its table may be released.
    const std::vector<int32_t> released_full = {kv::kNoBlock, 1};
    c.block_table = released_full;
    st = runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    // One table for three groups.
    c.block_table = full;
    c.group_block_tables = {};
    c.group_slot_mappings = {};
    st = runner.Forward(std::span<const SequenceChunk>(&c, 1), &logits);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("for the model's 3 KV cache groups"), std::string::npos)
        << st.ToString();
}

INSTANTIATE_TEST_SUITE_P(Windowed, KvGroupsEngine, ::testing::Values("mistral", "gemma3"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace kvshard
