// The step cost model: invariants that follow from the roofline (and could fail if a term were
// mis-scaled), a plausible-range check against a hand derivation, and the CPU profile fit.
#include "sim/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tests/sim/sim_test_util.h"

namespace kvshard::sim {
namespace {

Accelerator Gpu(const char* name) { return *FindAccelerator(name); }

CostModel Model(const ArchConfig& arch, int64_t tp, const Accelerator& acc,
                kv::WeightDtype w = kv::WeightDtype::kBf16) {
    Result<CostModel> m = CostModel::Create(arch, w, KvDtype::kBf16, tp, acc);
    KV_CHECK(m.ok()) << m.status().ToString();
    return *m;
}

struct Seq {
    int64_t start_pos;
    int64_t num_tokens;
    bool sample = true;
};

StepPlan Plan(const std::vector<Seq>& seqs) {
    StepPlan p;
    int64_t id = 0;
    for (const Seq& s : seqs) {
        ScheduledSequence ss;
        ss.seq_id = id++;
        ss.start_pos = s.start_pos;
        ss.token_ids.assign(static_cast<size_t>(s.num_tokens), 1);
        ss.sample = s.sample;
        p.sequences.push_back(ss);
    }
    return p;
}

StepPlan Decode(int64_t batch, int64_t context) {
    return Plan(std::vector<Seq>(static_cast<size_t>(batch), Seq{context - 1, 1}));
}

// Llama 3 70B bf16, tp 8 on H200, one sequence decoding at context 1024. By hand:
//   linear weights per GPU  (70.55e9 - 2 x 1.05e9 embedding/head params) / 8 x 2 B = 17.1 GB;
//                           / (4.8e12 x 0.85) = 4.19 ms
//   LM head                 128256 / 8 x 8192 x 2 B = 263 MB -> 0.064 ms
//   attention               1024 x 80 layers x 2 x 1 KV head x 128 x 2 B = 42 MB -> 0.010 ms
//   all-reduce              160 x (14 hops x 0.75 us + 14/8 x 16 KB / (450 GB/s x 0.7)) = 1.69
//                           ms, + the logits' all-gather (7 hops) 0.005 ms
//   overhead                2 ms
//   total                   ~7.96 ms, i.e. ~126 tok/s for one stream (TensorRT-LLM and vLLM
//                           report 50-100 tok/s per stream on 8xH100/H200: the same order).
TEST(CostModelTest, Llama70bTp8H200LoneDecodeIsPlausible) {
    const CostModel m = Model(Config("llama-3-70b.json"), 8, Gpu("h200"));
    const StepCost c = m.Cost(Decode(1, 1024));
    EXPECT_NEAR(static_cast<double>(m.linear_weight_bytes_per_gpu()), 17.1e9, 0.1e9);
    EXPECT_NEAR(c.gemm_s, 4.19e-3, 0.05e-3);
    EXPECT_NEAR(c.lm_head_s, 0.064e-3, 0.002e-3);
    EXPECT_NEAR(c.attention_s, 0.0103e-3, 0.001e-3);
    EXPECT_NEAR(c.allreduce_s, 1.69e-3, 0.02e-3);
    EXPECT_DOUBLE_EQ(c.overhead_s, 2e-3);
    EXPECT_NEAR(c.total_s, 7.96e-3, 0.1e-3);
    EXPECT_GT(c.total_s, 5e-3);  // the plausible band: 5-12 ms
    EXPECT_LT(c.total_s, 12e-3);
    EXPECT_EQ(c.num_tokens, 1);
    EXPECT_EQ(c.num_decode_tokens, 1);
    EXPECT_EQ(c.num_prefill_tokens, 0);
    EXPECT_DOUBLE_EQ(c.total_s, c.gemm_s + c.attention_s + c.lm_head_s + c.allreduce_s +
                                    c.kv_transfer_s + c.overhead_s);
}

// A lone decode step can never beat streaming the linear weights once at the achievable bandwidth.
TEST(CostModelTest, DecodeNeverBeatsTheWeightBandwidthRoofline) {
    for (const char* config : {"llama-3-8b.json", "llama-3-70b.json", "qwen3-8b.json"}) {
        const ArchConfig arch = Config(config);
        for (const char* gpu : {"a100", "h100", "h200", "b200"}) {
            for (int64_t tp : {1, 2, 4, 8}) {
                const Accelerator acc = Gpu(gpu);
                const CostModel m = Model(arch, tp, acc);
                const double floor = static_cast<double>(m.linear_weight_bytes_per_gpu()) /
                                     (acc.memory_bandwidth * acc.bandwidth_efficiency);
                for (int64_t context : {1, 512, 8192}) {
                    EXPECT_GE(m.Cost(Decode(1, context)).total_s, floor)
                        << config << " " << gpu << " tp " << tp << " context " << context;
                    EXPECT_GE(m.Cost(Decode(1, context)).gemm_s, floor);
                }
            }
        }
    }
}

// What doubling tp guarantees: the compute terms (gemm, attention, head) never grow, because every
// GPU's share of weights, heads and vocabulary shrinks or stays (a replicated KV head) — for any
// model and batch. The total adds the all-reduce, which grows with tp; for Llama 3 70B on H200
// the weight time saved by each doubling (>= 2.1 ms up to tp 8) exceeds the all-reduce added
// (<= 0.9 ms), so a lone decode step gets strictly faster up to tp 8.
TEST(CostModelTest, DoublingTpNeverIncreasesComputeAndSpeedsUp70bDecode) {
    const ArchConfig arch = Config("llama-3-70b.json");
    const Accelerator h200 = Gpu("h200");
    for (const auto& plan : {Decode(1, 1024), Decode(64, 2048), Plan({{0, 4096}, {100, 1}})}) {
        double previous_compute = INFINITY;
        for (int64_t tp : {1, 2, 4, 8, 16}) {
            const StepCost c = Model(arch, tp, h200).Cost(plan);
            const double compute = c.gemm_s + c.attention_s + c.lm_head_s;
            EXPECT_LE(compute, previous_compute) << "tp " << tp;
            previous_compute = compute;
        }
    }
    double previous_total = INFINITY;
    for (int64_t tp : {1, 2, 4, 8}) {
        const double total = Model(arch, tp, h200).Cost(Decode(1, 1024)).total_s;
        EXPECT_LT(total, previous_total) << "tp " << tp;
        previous_total = total;
    }
    // Past one node the all-reduce goes over InfiniBand: tp 16 is slower than tp 8.
    EXPECT_GT(Model(arch, 16, h200).Cost(Decode(1, 1024)).total_s,
              Model(arch, 8, h200).Cost(Decode(1, 1024)).total_s);
}

TEST(CostModelTest, PrefillCostGrowsWithTokens) {
    const CostModel m = Model(Config("llama-3-70b.json"), 8, Gpu("h200"));
    double previous = 0;
    for (int64_t tokens = 1; tokens <= 32768; tokens *= 2) {
        const StepCost c = m.Cost(Plan({{0, tokens}}));
        EXPECT_GT(c.total_s, previous) << tokens;
        EXPECT_EQ(c.num_prefill_tokens, tokens);
        previous = c.total_s;
    }
    // Large prefills are compute-bound: 8192 tokens cost about 2 x 8192 x params / FLOP/s.
    const StepCost big = m.Cost(Plan({{0, 8192}}));
    const Accelerator h200 = Gpu("h200");
    EXPECT_NEAR(big.gemm_s, 2.0 * 8192 * 69.5e9 / 8 / (h200.bf16_flops * h200.flops_efficiency),
                0.02 * big.gemm_s);
    // A chunk after a cached prefix costs more attention than the same chunk from position 0.
    EXPECT_GT(m.Cost(Plan({{4096, 512}})).attention_s, m.Cost(Plan({{0, 512}})).attention_s);
}

TEST(CostModelTest, BatchingAmortizesWeights) {
    const CostModel m = Model(Config("llama-3-8b.json"), 1, Gpu("h100"));
    const double one = m.Cost(Decode(1, 1024)).total_s;
    const double many = m.Cost(Decode(64, 1024)).total_s;
    EXPECT_GT(many, one);
    EXPECT_LT(many, 4 * one);  // 64 streams for well under 64x the time
    // Only sampled rows pay for the head.
    const StepCost chunk = m.Cost(Plan({{0, 256, false}}));
    EXPECT_EQ(chunk.lm_head_s, 0);
    EXPECT_EQ(chunk.allreduce_s, 0);  // tp 1
}

TEST(CostModelTest, SlidingLayersReadAtMostTheWindow) {
    // Mistral 7B v0.1: every layer slides over 4096 tokens.
    const CostModel m = Model(Config("mistral-7b-v0.1.json"), 1, Gpu("h100"));
    const double at_8k = m.Cost(Decode(1, 8192)).attention_s;
    EXPECT_DOUBLE_EQ(m.Cost(Decode(1, 32768)).attention_s, at_8k);
    EXPECT_LT(m.Cost(Decode(1, 2048)).attention_s, at_8k);
    // Llama 3 8B has no window: attention keeps growing with context.
    const CostModel llama = Model(Config("llama-3-8b.json"), 1, Gpu("h100"));
    EXPECT_GT(llama.Cost(Decode(1, 32768)).attention_s, llama.Cost(Decode(1, 8192)).attention_s);
}

TEST(CostModelTest, KvTransfersByLink) {
    const CostModel m = Model(Config("llama-3-70b.json"), 8, Gpu("h200"));
    // 80 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes.
    EXPECT_EQ(m.KvBytesPerToken(), 327'680);
    EXPECT_EQ(m.KvBytesPerTokenPerGpu(), 40'960);
    const double nvlink = m.KvTransferSeconds(4096, Link::kIntraNode);
    const double network = m.KvTransferSeconds(4096, Link::kNetwork);
    // 4096 x 327680 B = 1.34 GB over 8 x 450 GB/s x 0.7 = 0.53 ms; over 8 x 50 GB/s x 0.7: 4.8 ms.
    EXPECT_NEAR(nvlink, 1.342e9 / (8 * 450e9 * 0.7), 0.01e-3);
    EXPECT_NEAR(network, 1.342e9 / (8 * 50e9 * 0.7), 0.02e-3);
    EXPECT_EQ(m.KvTransferSeconds(0, Link::kNetwork), 0);

    StepPlan plan = Plan({{0, 4096}});
    const StepCost alone = m.Cost(plan);
    KvSendOp send;
    send.num_tokens = 4096;
    plan.kv_sends.push_back(send);
    const StepCost after = m.Cost(plan, Link::kNetwork);
    EXPECT_NEAR(after.kv_transfer_s, network, 1e-12);
    EXPECT_NEAR(after.total_s, alone.total_s + network, 1e-12);
    plan.kv_sends[0].layerwise = true;  // overlapped with the forward pass
    const StepCost overlapped = m.Cost(plan, Link::kNetwork);
    const double forward = alone.total_s - alone.overhead_s;
    EXPECT_NEAR(overlapped.total_s, alone.overhead_s + std::max(forward, network), 1e-12);
}

TEST(CostModelTest, KvBlocksFollowTheCapacityPlanner) {
    const CostModel m = Model(Config("llama-3-70b.json"), 8, Gpu("h200"));
    // floor(141e9 x 0.9) - 17.6 GB of weights - 1 GiB reserve = 107.7 GB per GPU, / (40960 B x 16)
    // = ~164k blocks of 16 tokens: ~2.6M tokens per instance.
    const int64_t blocks = m.NumKvBlocks(16, 0.9);
    EXPECT_GT(blocks, 160'000);
    EXPECT_LT(blocks, 168'000);
    EXPECT_LE(blocks * 16 * m.KvBytesPerTokenPerGpu(),
              static_cast<int64_t>(141e9 * 0.9) - m.weight_bytes_per_gpu());
    EXPECT_LT(m.NumKvBlocks(16, 0.5), blocks);
    // 70B bf16 does not fit one H100 at all.
    EXPECT_EQ(Model(Config("llama-3-70b.json"), 1, Gpu("h100")).NumKvBlocks(16, 0.9), 0);
}

TEST(CostModelTest, CreateRejectsBadSplitsAndProfileOnlyKinds) {
    const ArchConfig arch = Config("llama-3-70b.json");
    Result<CostModel> bad_tp =
        CostModel::Create(arch, kv::WeightDtype::kBf16, KvDtype::kBf16, 3, Gpu("h200"));
    EXPECT_EQ(bad_tp.status().code(), StatusCode::kInvalidArgument);
    Result<CostModel> cpu =
        CostModel::Create(arch, kv::WeightDtype::kBf16, KvDtype::kBf16, 1, Gpu("cpu"));
    EXPECT_EQ(cpu.status().code(), StatusCode::kInvalidArgument);
    Result<CostModel> moe = CostModel::Create(Config("qwen3-30b-a3b.json"), kv::WeightDtype::kBf16,
                                              KvDtype::kBf16, 1, Gpu("h200"));
    EXPECT_EQ(moe.status().code(), StatusCode::kUnimplemented);
    Accelerator broken = Gpu("h200");
    broken.memory_bandwidth = 0;
    EXPECT_FALSE(CostModel::Create(arch, kv::WeightDtype::kBf16, KvDtype::kBf16, 8, broken).ok());
}

TEST(CostModelTest, Fp8WeightsHalveTheDecodeWeightTime) {
    const ArchConfig arch = Config("llama-3-70b.json");
    const double bf16 = Model(arch, 8, Gpu("h200")).Cost(Decode(1, 1024)).gemm_s;
    const double fp8 =
        Model(arch, 8, Gpu("h200"), kv::WeightDtype::kFp8).Cost(Decode(1, 1024)).gemm_s;
    EXPECT_NEAR(fp8 / bf16, 0.5, 0.01);
}

// ---- CPU profile ----

TEST(CpuProfileTest, FitRecoversAKnownLinearModel) {
    const double a = 2e-3, b = 1e-4, c = 5e-4, d = 1e-7;
    std::vector<CpuProfilePoint> points;
    for (int64_t prefill : {0, 128, 1024}) {
        for (int64_t seqs : {0, 1, 16}) {
            for (int64_t kv : {0, 512, 8192}) {
                points.push_back({prefill, seqs, kv, a + b * prefill + c * seqs + d * kv});
            }
        }
    }
    Result<CpuProfile> p = FitCpuProfile(points);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_NEAR(p->a, a, 1e-9);
    EXPECT_NEAR(p->b, b, 1e-10);
    EXPECT_NEAR(p->c, c, 1e-10);
    EXPECT_NEAR(p->d, d, 1e-12);
    EXPECT_LT(p->rms_error_s, 1e-9);
    EXPECT_EQ(p->num_points, 27);
}

TEST(CpuProfileTest, StepsCaughtInAStallDoNotMoveTheFit) {
    // Serving steps with +-2% noise, one in eight of them stalled 2-10x (a shared machine
    // preempting the server). The plain relative fit would move every coefficient by several
    // percent (it did so by a stall's weight: run D of docs/simulate.md); the robust one gives the
    // stalls weight 0.
    const double a = 8e-3, b = 1.3e-3, c = 1.5e-3, d = 5e-6, e = 1e-6;
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<double> noise(-0.02, 0.02), stall(2.0, 10.0);
    std::vector<CpuProfilePoint> points;
    int64_t stalls = 0;
    for (int64_t prefill : {0, 24, 128, 512}) {
        for (int64_t seqs : {0, 1, 2, 4, 8}) {
            for (int64_t context : {100, 450, 900}) {
                if (prefill == 0 && seqs == 0) continue;
                for (int rep = 0; rep < 4; ++rep) {
                    const int64_t start = rep % 2 == 1 ? 400 : 0;  // a chunk after a cached prefix
                    const int64_t pairs = prefill * start + prefill * (prefill + 1) / 2;
                    const int64_t kv = prefill + start + context * seqs;
                    double t = (a + b * prefill + c * seqs + d * kv + e * pairs) * (1 + noise(rng));
                    if (points.size() % 8 == 3) {
                        t *= stall(rng);
                        stalls++;
                    }
                    points.push_back({prefill, seqs, kv, t, pairs});
                }
            }
        }
    }
    Result<CpuProfile> p = FitCpuProfile(points);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_NEAR(p->a, a, 0.03 * a);
    EXPECT_NEAR(p->b, b, 0.03 * b);
    EXPECT_NEAR(p->c, c, 0.03 * c);
    EXPECT_NEAR(p->d, d, 0.1 * d);
    EXPECT_NEAR(p->e, e, 0.1 * e);
    EXPECT_GE(p->num_outliers, stalls);
    EXPECT_LE(p->num_outliers, stalls + static_cast<int64_t>(points.size()) / 20);
}

TEST(CpuProfileTest, CoefficientsStayNonNegative) {
    // Time falls with kv_tokens in these points: least squares would give d < 0.
    const std::vector<CpuProfilePoint> points = {
        {100, 0, 1000, 0.010}, {200, 0, 100, 0.021}, {0, 4, 4000, 0.004}, {0, 8, 400, 0.0085}};
    Result<CpuProfile> p = FitCpuProfile(points);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_GE(p->a, 0);
    EXPECT_GE(p->b, 0);
    EXPECT_GE(p->c, 0);
    EXPECT_EQ(p->d, 0);
    EXPECT_FALSE(FitCpuProfile({}).ok());
    EXPECT_FALSE(FitCpuProfile({{-1, 0, 0, 1.0}}).ok());
}

TEST(CpuProfileTest, ReadsPointsAndBenchEngineOutput) {
    const std::string points =
        "{\"prefill_tokens\": 128, \"decode_seqs\": 0, \"kv_tokens\": 128, \"seconds\": 0.1}\n"
        "{\"points\": [{\"prefill_tokens\": 0, \"decode_seqs\": 4, \"kv_tokens\": 600, "
        "\"seconds\": 0.02}]}\n";
    Result<std::vector<CpuProfilePoint>> p = ParseCpuProfilePoints(points, "p.jsonl");
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ASSERT_EQ(p->size(), 2u);
    EXPECT_EQ((*p)[1].decode_seqs, 4);

    // `kvshard bench-engine --json` output: each row a prefill and a decode point.
    const std::string bench = R"({"engine": "kvshard", "threads": 2, "tp": 1, "comm": "local",
      "results": [{"batch": 1, "prompt_tokens": 128, "decode_tokens": 64,
                   "prefill_tokens_per_second": 640.0, "decode_tokens_per_second": 20.0},
                  {"batch": 16, "prompt_tokens": 128, "decode_tokens": 64,
                   "prefill_tokens_per_second": 800.0, "decode_tokens_per_second": 160.0}]})";
    Result<std::vector<CpuProfilePoint>> b = ParseCpuProfilePoints(bench, "bench.json");
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    ASSERT_EQ(b->size(), 4u);
    EXPECT_EQ((*b)[0].prefill_tokens, 128);
    EXPECT_DOUBLE_EQ((*b)[0].seconds, 0.2);
    EXPECT_EQ((*b)[1].decode_seqs, 1);
    EXPECT_EQ((*b)[1].kv_tokens, 128 + 32);
    EXPECT_DOUBLE_EQ((*b)[1].seconds, 0.05);
    EXPECT_EQ((*b)[3].decode_seqs, 16);
    EXPECT_DOUBLE_EQ((*b)[3].seconds, 0.1);

    Result<std::vector<CpuProfilePoint>> bad = ParseCpuProfilePoints(
        "{\"prefill_tokens\": 1, \"decode_seqs\": 0, \"kv_tokens\": 1, \"seconds\": 1}\n"
        "{\"prefill_tokens\": 1, \"decode_seqs\": 0, \"seconds\": 1}\n",
        "p.jsonl");
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().message(), "p.jsonl:2: field 'kv_tokens': missing");
    EXPECT_EQ(ParseCpuProfilePoints("{oops\n", "p.jsonl").status().message(),
              "p.jsonl:1: not valid JSON");
}

TEST(CpuProfileTest, ProfileDrivesTheCost) {
    const CpuProfile profile{.a = 1e-3, .b = 2e-4, .c = 3e-3, .d = 1e-6};
    Result<CostModel> m = CostModel::CreateWithProfile(
        Config("llama-3-8b.json"), kv::WeightDtype::kBf16, KvDtype::kBf16, 1, Gpu("cpu"), profile);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_TRUE(m->uses_profile());
    // 128 prefill tokens (context 128) and 4 decodes at context 100.
    const StepCost c = m->Cost(Plan({{0, 128}, {99, 1}, {99, 1}, {99, 1}, {99, 1}}));
    EXPECT_NEAR(c.total_s, 1e-3 + 128 * 2e-4 + 4 * 3e-3 + (128 + 400) * 1e-6, 1e-12);
    EXPECT_EQ(c.num_decode_tokens, 4);
    EXPECT_EQ(c.num_prefill_tokens, 128);
}

}  // namespace
}  // namespace kvshard::sim
