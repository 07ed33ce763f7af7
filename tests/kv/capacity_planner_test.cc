// The capacity planner against published figures: KV bytes per token from the configs, parameter
// counts equal to the published checkpoint sizes, and the sizing example of issue 3. Sources of
// every figure are in docs/kv.md.
#include "kv/capacity_planner.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/build_config.h"
#include "kv/capacity_report.h"

namespace kvshard::kv {
namespace {

ArchConfig Arch(const std::string& name) {
    Result<ArchConfig> c =
        ReadArchConfig(std::string(KVSHARD_SOURCE_DIR) + "/tests/kv/configs/" + name);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : ArchConfig{};
}

CapacityPlan MustPlan(const ArchConfig& a, const PlannerInput& in) {
    Result<CapacityPlan> p = PlanCapacity(a, in);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? *p : CapacityPlan{};
}

PlannerInput Tp(int64_t tp, int64_t context = 0) {
    PlannerInput in;
    in.tp = tp;
    in.context_tokens = context;
    return in;
}

TEST(CapacityPlannerTest, KvBytesPerToken) {
    struct Case {
        const char* file;
        int64_t tp;
        int64_t kv_bytes_per_token;
        int64_t kv_bytes_per_token_per_gpu;
    };
    const Case cases[] = {
        // 2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B = 128 KiB.
        {"llama-3-8b.json", 1, 131072, 131072},
        // 2 x 80 x 8 x 128 x 2 = 327,680 B = 320 KiB; tp 8: one KV head per GPU, 40 KiB.
        {"llama-3-70b.json", 1, 327680, 327680},
        {"llama-3-70b.json", 8, 327680, 40960},
        // tp 16 > 8 KV heads: each head on two GPUs, still 40 KiB per GPU.
        {"llama-3-70b.json", 16, 327680, 40960},
        // Gemma 3 27B, every layer counted global: 2 x 62 x 16 x 128 x 2 = 507,904 B.
        {"gemma-3-27b-it.json", 1, 507904, 507904},
        {"gemma-3-27b-it.json", 4, 507904, 126976},
        // DeepSeek-V2 MLA: 60 x (512 + 64) x 2 = 69,120 B, replicated on every GPU.
        {"deepseek-v2.json", 1, 69120, 69120},
        {"deepseek-v2.json", 8, 69120, 69120},
        {"deepseek-v3.json", 8, 70272, 70272},  // 61 x 576 x 2
        {"mistral-7b-v0.1.json", 1, 131072, 131072},
        {"qwen2-7b-instruct.json", 1, 57344, 57344},  // 2 x 28 x 4 x 128 x 2
        {"qwen3-8b.json", 1, 147456, 147456},         // 2 x 36 x 8 x 128 x 2
        {"gemma-2-27b.json", 1, 376832, 376832},      // 2 x 46 x 16 x 128 x 2
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(std::string(c.file) + " tp " + std::to_string(c.tp));
        CapacityPlan p = MustPlan(Arch(c.file), Tp(c.tp));
        EXPECT_EQ(p.kv_bytes_per_token, c.kv_bytes_per_token);
        EXPECT_EQ(p.kv_bytes_per_token_per_gpu, c.kv_bytes_per_token_per_gpu);
        EXPECT_EQ(p.kv_bytes_per_block_per_gpu, c.kv_bytes_per_token_per_gpu * 16);
    }
}

TEST(CapacityPlannerTest, KvDtypes) {
    struct Case {
        KvDtype dtype;
        int64_t llama8b;
        int64_t deepseek_v2;
    };
    const Case cases[] = {
        {KvDtype::kFp32, 262144, 138240},
        {KvDtype::kFp16, 131072, 69120},
        {KvDtype::kBf16, 131072, 69120},
        // 8-bit: + one fp32 scale per token per head for K and V (MLA: per token per layer), as
        // kvshard's pools store them.
        {KvDtype::kFp8, 67584, 34800},
        {KvDtype::kInt8, 67584, 34800},
    };
    for (const Case& c : cases) {
        PlannerInput in = Tp(1);
        in.kv_dtype = c.dtype;
        EXPECT_EQ(MustPlan(Arch("llama-3-8b.json"), in).kv_bytes_per_token, c.llama8b);
        EXPECT_EQ(MustPlan(Arch("deepseek-v2.json"), in).kv_bytes_per_token, c.deepseek_v2);
    }
}

// One formula: the planner's per-GPU bytes are KvGeometry's, which the worker's pool is sized by
// too (tests/worker/kv_storage_test.cc checks the pool's side), for every dtype and split.
TEST(CapacityPlannerTest, PerGpuBytesAreTheGeometrysForEveryDtype) {
    const ArchConfig a = Arch("llama-3-8b.json");
    ModelSpec spec;
    spec.num_layers = a.num_layers;
    spec.num_heads = a.num_heads;
    spec.num_kv_heads = a.num_kv_heads;
    spec.head_dim = a.head_dim;
    for (KvDtype dtype :
         {KvDtype::kFp32, KvDtype::kFp16, KvDtype::kBf16, KvDtype::kFp8, KvDtype::kInt8}) {
        for (int64_t tp : {1, 2, 8, 16}) {
            PlannerInput in = Tp(tp);
            in.kv_dtype = dtype;
            in.block_size = 32;
            const CapacityPlan p = MustPlan(a, in);
            Result<KvGeometry> g = MakeKvGeometry(spec, tp, dtype, 32);
            ASSERT_TRUE(g.ok()) << g.status().ToString();
            EXPECT_EQ(p.kv_bytes_per_token_per_gpu, g->BytesPerToken()) << g->ToString();
            EXPECT_EQ(p.kv_bytes_per_block_per_gpu, g->BytesPerBlock()) << g->ToString();
        }
    }
}

// Sliding-window layers hold only their window: the real per-sequence KV of Gemma 3 27B at 128K
// tokens is 10 global layers x 131,072 + 52 sliding layers x 1,024 tokens, not 62 x 131,072.
TEST(CapacityPlannerTest, SlidingWindowsAtLongContext) {
    struct Case {
        const char* file;
        int64_t context;
        int64_t per_sequence;
        int64_t per_sequence_real;
    };
    const Case cases[] = {
        {"gemma-3-27b-it.json", 131072, 507904LL * 131072, 8192LL * (10 * 131072 + 52 * 1024)},
        {"gemma-3-27b-it.json", 512, 507904LL * 512, 507904LL * 512},  // window not reached
        {"gemma-2-27b.json", 8192, 376832LL * 8192, 8192LL * (23 * 8192 + 23 * 4096)},
        {"mistral-7b-v0.1.json", 32768, 131072LL * 32768, 131072LL * 4096},
        {"llama-3-8b.json", 8192, 131072LL * 8192, 131072LL * 8192},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.file);
        CapacityPlan p = MustPlan(Arch(c.file), Tp(1, c.context));
        EXPECT_EQ(p.kv_bytes_per_sequence, c.per_sequence);
        EXPECT_EQ(p.kv_bytes_per_sequence_real, c.per_sequence_real);
    }
    CapacityPlan g = MustPlan(Arch("gemma-3-27b-it.json"), Tp(1, 131072));
    EXPECT_DOUBLE_EQ(g.kv_bytes_per_token_real, 85248.0);  // 8192 x (10 + 52 / 128)
    EXPECT_GT(g.max_concurrent_sequences_real, 5 * g.max_concurrent_sequences);
}

TEST(CapacityPlannerTest, ParameterCountsMatchPublishedCheckpoints) {
    struct Case {
        const char* file;
        int64_t params;    // exact where the published count is exact
        double tolerance;  // relative, for counts published rounded
    };
    const Case cases[] = {
        {"llama-3-8b.json", 8'030'261'248, 0},
        {"llama-3-70b.json", 70'553'706'496, 0},
        {"mistral-7b-v0.1.json", 7'241'732'096, 0},
        {"qwen2-7b-instruct.json", 7'615'616'512, 0},
        {"qwen3-8b.json", 8'190'735'360, 0},
        {"qwen3-30b-a3b.json", 30'532'122'624, 0},
        {"gemma-2-27b.json", 27'227'128'320, 0},
        {"gemma-3-27b-it.json", 27'009'346'304, 0},  // text model; the vision tower is not counted
        {"deepseek-v2.json", 236'000'000'000, 0.002},  // "236B total parameters"
        {"deepseek-v3.json", 671'000'000'000, 0.001},  // "671B", without the 14B MTP module
    };
    for (const Case& c : cases) {
        const int64_t got = CountParameters(Arch(c.file)).Total();
        if (c.tolerance == 0) {
            EXPECT_EQ(got, c.params) << c.file;
        } else {
            EXPECT_NEAR(static_cast<double>(got), static_cast<double>(c.params),
                        c.tolerance * static_cast<double>(c.params))
                << c.file;
        }
    }
}

TEST(CapacityPlannerTest, WeightBytesPerGpu) {
    struct Case {
        const char* file;
        int64_t tp;
        WeightDtype dtype;
        int64_t bytes_total;
        int64_t bytes_per_gpu;
    };
    const Case cases[] = {
        {"llama-3-8b.json", 1, WeightDtype::kBf16, 16'060'522'496, 16'060'522'496},
        {"llama-3-70b.json", 1, WeightDtype::kBf16, 141'107'412'992, 141'107'412'992},
        // Split over 4: everything but 80 x 2 + 1 norms of 8,192 (1,318,912 params, replicated).
        {"llama-3-70b.json", 4, WeightDtype::kBf16, 141'107'412'992,
         2 * ((70'553'706'496 - 1'318'912) / 4 + 1'318'912)},
        {"llama-3-8b.json", 1, WeightDtype::kFp32, 32'121'044'992, 32'121'044'992},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.file);
        Result<WeightFootprint> w = ComputeWeightFootprint(Arch(c.file), c.tp, c.dtype);
        ASSERT_TRUE(w.ok()) << w.status().ToString();
        EXPECT_EQ(w->bytes_total, c.bytes_total);
        EXPECT_EQ(w->bytes_per_gpu, c.bytes_per_gpu);
    }
    // Quantized linear layers; embedding and LM head stay 16-bit.
    Result<WeightFootprint> w8 =
        ComputeWeightFootprint(Arch("llama-3-8b.json"), 1, WeightDtype::kFp8);
    Result<WeightFootprint> w4 =
        ComputeWeightFootprint(Arch("llama-3-8b.json"), 1, WeightDtype::kInt4);
    const int64_t embed_head = 2 * 128256LL * 4096;
    const int64_t norms = 65 * 4096LL;
    const int64_t linear = 8'030'261'248 - embed_head - norms;
    EXPECT_EQ(w8->bytes_total, linear + 2 * (embed_head + norms));
    EXPECT_EQ(w4->bytes_total, (linear * 66 + 127) / 128 + 2 * (embed_head + norms));
    // The MLA down-projections are replicated: DeepSeek-V2 at tp 8 holds more than 1/8.
    Result<WeightFootprint> ds =
        ComputeWeightFootprint(Arch("deepseek-v2.json"), 8, WeightDtype::kBf16);
    ASSERT_TRUE(ds.ok());
    EXPECT_GT(ds->bytes_per_gpu, ds->bytes_total / 8);
    EXPECT_LT(ds->bytes_per_gpu, ds->bytes_total / 7);
}

// "4 x H200 (141 GB each), Llama 3 70B in bf16: about 420 GB left for KV, about 1.3 million
// tokens, about ten 128K-token sessions." All memory to kvshard, no reserve, as the example has it.
TEST(CapacityPlannerTest, FourH200Llama3_70B) {
    PlannerInput in;
    in.tp = 4;
    in.num_gpus = 4;
    in.gpu_memory_bytes = 141'000'000'000;
    in.memory_utilization = 1.0;
    in.overhead_bytes_per_gpu = 0;
    in.context_tokens = 131072;
    CapacityPlan p = MustPlan(Arch("llama-3-70b.json"), in);
    EXPECT_EQ(p.weights.bytes_total, 141'107'412'992);
    EXPECT_EQ(p.weights.bytes_per_gpu, 35'278'831'616);
    EXPECT_EQ(p.kv_bytes_per_token_per_gpu, 81920);  // 2 of 8 KV heads per GPU
    EXPECT_EQ(p.kv_budget_bytes_per_gpu, 105'721'168'384);
    EXPECT_EQ(p.kv_budget_bytes_total, 422'884'673'536);  // about 420 GB
    EXPECT_EQ(p.kv_blocks_per_gpu, 80'658);
    EXPECT_EQ(p.kv_tokens_capacity, 1'290'528);  // about 1.3 million tokens
    EXPECT_EQ(p.blocks_per_sequence, 8192);
    EXPECT_EQ(p.max_concurrent_sequences, 9);                   // 9 whole sessions ...
    EXPECT_NEAR(p.sequences_per_instance_exact, 9.846, 0.001);  // ... memory for about ten
    EXPECT_TRUE(p.weights_fit);
}

TEST(CapacityPlannerTest, InstancesAndDefaults) {
    PlannerInput in;
    in.tp = 2;
    in.num_gpus = 8;
    CapacityPlan p = MustPlan(Arch("llama-3-8b.json"), in);
    EXPECT_EQ(p.num_instances, 4);
    EXPECT_EQ(p.input.context_tokens, 8192) << "max_position_embeddings";
    EXPECT_EQ(p.kv_tokens_capacity, 4 * p.kv_tokens_per_instance);
    EXPECT_EQ(p.max_concurrent_sequences, 4 * p.max_sequences_per_instance);
    EXPECT_EQ(p.usable_bytes_per_gpu, static_cast<int64_t>(80 * kGiB * 0.9));
    EXPECT_EQ(p.kv_budget_bytes_per_gpu,
              p.usable_bytes_per_gpu - p.weights.bytes_per_gpu - 1 * kGiB);
    EXPECT_EQ(p.kv_tokens_per_instance, p.kv_budget_bytes_per_gpu / (65536 * 16) * 16);
}

TEST(CapacityPlannerTest, WeightsThatDoNotFit) {
    PlannerInput in = Tp(1);
    in.gpu_memory_bytes = 80 * kGiB;
    CapacityPlan p = MustPlan(Arch("llama-3-70b.json"), in);
    EXPECT_FALSE(p.weights_fit);
    EXPECT_EQ(p.kv_budget_bytes_per_gpu, 0);
    EXPECT_EQ(p.kv_tokens_capacity, 0);
    EXPECT_EQ(p.max_concurrent_sequences, 0);
}

TEST(CapacityPlannerTest, BadInputsNameTheValue) {
    struct Case {
        const char* file;
        PlannerInput in;
        std::vector<std::string> want;
    };
    auto with = [](auto edit) {
        PlannerInput in;
        edit(in);
        return in;
    };
    const Case cases[] = {
        {"llama-3-8b.json", with([](PlannerInput& i) { i.tp = 3; }), {"llama-3-8b.json", "tp 3"}},
        {"llama-3-8b.json", with([](PlannerInput& i) { i.tp = 0; }), {"tp must be positive"}},
        {"llama-3-8b.json",
         with([](PlannerInput& i) { i.tp = 4, i.num_gpus = 6; }),
         {"GPUs (6)", "tp (4)"}},
        {"llama-3-8b.json",
         with([](PlannerInput& i) { i.memory_utilization = 1.5; }),
         {"utilization", "1.5"}},
        {"llama-3-8b.json", with([](PlannerInput& i) { i.block_size = 0; }), {"block size", "0"}},
        {"llama-3-8b.json", with([](PlannerInput& i) { i.gpu_memory_bytes = 0; }), {"GPU memory"}},
        {"llama-3-8b.json", with([](PlannerInput& i) { i.context_tokens = -1; }), {"context"}},
        {"deepseek-v2.json",
         with([](PlannerInput& i) { i.tp = 3; }),
         {"num_attention_heads 128", "tp 3"}},
    };
    for (const Case& c : cases) {
        Result<CapacityPlan> p = PlanCapacity(Arch(c.file), c.in);
        ASSERT_FALSE(p.ok()) << c.file;
        for (const std::string& w : c.want) {
            EXPECT_NE(p.status().message().find(w), std::string::npos)
                << "want '" << w << "' in: " << p.status().message();
        }
    }
}

// The function behind `kvshard plan --json`.
TEST(CapacityReportTest, JsonHasTheDocumentedKeys) {
    PlannerInput in = Tp(8, 131072);
    CapacityPlan p = MustPlan(Arch("llama-3-70b.json"), in);
    nlohmann::json j = nlohmann::json::parse(CapacityPlanJson(p));
    EXPECT_EQ(j["kv_bytes_per_token"], 327680);
    EXPECT_EQ(j["kv_bytes_per_token_per_gpu"], 40960);
    EXPECT_EQ(j["weight_bytes_per_gpu"], p.weights.bytes_per_gpu);
    EXPECT_EQ(j["kv_tokens_capacity"], p.kv_tokens_capacity);
    EXPECT_EQ(j["max_concurrent_sequences"], p.max_concurrent_sequences);
    EXPECT_EQ(j["context_tokens"], 131072);
    EXPECT_EQ(j["tp"], 8);
    EXPECT_EQ(j["attention"], "mha");
    EXPECT_TRUE(j["notes"].is_array());

    const std::string table = CapacityPlanTable(p);
    EXPECT_NE(table.find("327,680 B (320.00 KiB)"), std::string::npos) << table;
    EXPECT_NE(table.find("40,960 B (40.00 KiB)"), std::string::npos) << table;
}

}  // namespace
}  // namespace kvshard::kv
