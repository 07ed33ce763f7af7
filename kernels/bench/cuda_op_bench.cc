// Where a Llama-3-8B-shaped step's time goes on a backend, op by op, against the backend's own
// matrix-product ceiling:
//   - ceiling: TFLOP/s of the backend's bf16 MatMul (cuBLASLt bf16 × bf16, fp32 compute and out,
//     the fp32 activations converted to bf16 first, as every product of a step) at 4096³ and at
//     the 8B model's four products for a 2k-token prefill; the ceiling is the best of them;
//   - ops: microseconds per call of each backend op of a decode step (layer 0 of
//     kernels/cuda/synthetic_decode.h, context 512) at each --batches size;
//   - prefill: PagedAttention of one --prefill-tokens chunk from position 0 (causal, the 8B
//     attention shape: 32 query heads on 8 KV heads of 128, bf16 pool): ms, TFLOP/s of its causal
//     FLOPs (4 · heads · head_dim · n(n+1)/2) and % of the ceiling.
// Prints one line per measurement; --json adds one JSON object (scripts/gpu_check_ops.py reads it).
//   kvshard_cuda_op_bench [--backend cuda|cpu] [--shape 8b|tiny] [--batches 1,32]
//                         [--prefill-tokens 2048] [--json]
// Flags are parsed by CLI11 (the shared ones in kernels/bench/cuda_bench_flags.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/backend.h"
#include "kernels/bench/cuda_bench_flags.h"
#include "kernels/bench/cuda_bench_util.h"
#include "kernels/cuda/synthetic_decode.h"
#include "kernels/paged_attention.h"

namespace {

using kvshard::Backend;

int Fail(const std::string& message) {
    std::fprintf(stderr, "kvshard_cuda_op_bench: %s\n", message.c_str());
    return 2;
}

struct Gemm {
    std::string name;
    int64_t m, n, k;
    double tflops = 0.0;
};

struct Prefill {
    double ms = 0.0, tflops = 0.0;
};

// One sequence of `tokens` new rows at positions 0.., its K/V written first by KvWrite into a
// bf16 pool of 16-token blocks; times PagedAttention alone.
Prefill PrefillAttention(Backend& b, const kvshard::cuda::DecodeShape& s, int64_t tokens) {
    const int64_t heads = s.heads, kv_heads = s.kv_heads, hd = s.head_dim, bs = 16;
    const int64_t blocks = (tokens + bs - 1) / bs;
    const int64_t block_bytes = kvshard::cpu::PagedLayerBytes(kvshard::KvDtype::kBf16, bs, kv_heads, hd);
    const int64_t stride = (heads + 2 * kv_heads) * hd;
    auto pool = b.Allocate(size_t(blocks * block_bytes));
    auto qkv = b.Allocate(size_t(tokens * stride) * 4);
    auto out = b.Allocate(size_t(tokens * heads * hd) * 4);
    auto slots = b.Allocate(size_t(tokens) * 8);
    auto meta = b.Allocate(size_t(blocks + 8) * 4);
    if (!pool.ok() || !qkv.ok() || !out.ok() || !slots.ok() || !meta.ok()) return {};
    const std::vector<float> xh = kvshard::bench::RandomFloats(size_t(tokens * stride), 5, 1.0f);
    std::vector<int64_t> sh(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i) sh[size_t(i)] = i;  // block b holds positions 16b..
    // query_starts {0, tokens}, context_lens {tokens}, block_table_starts {0, blocks}, table.
    std::vector<int32_t> mh = {0, int32_t(tokens), int32_t(tokens), 0, int32_t(blocks)};
    for (int64_t i = 0; i < blocks; ++i) mh.push_back(int32_t(i));
    if (!b.CopyToDevice(qkv->data(), xh.data(), xh.size() * 4).ok() ||
        !b.CopyToDevice(slots->data(), sh.data(), sh.size() * 8).ok() ||
        !b.CopyToDevice(meta->data(), mh.data(), mh.size() * 4).ok()) {
        return {};
    }
    const kvshard::PagedKvLayer kv = kvshard::cpu::MakePagedKvLayer(
        pool->As<uint8_t>(), block_bytes, 0, kvshard::KvDtype::kBf16, bs, kv_heads, hd);
    float* q = qkv->As<float>();
    b.KvWrite(kv, q + heads * hd, q + (heads + kv_heads) * hd, stride, slots->As<int64_t>(), tokens);
    const int32_t* m = meta->As<int32_t>();
    kvshard::PagedAttentionBatch batch;
    batch.num_seqs = 1;
    batch.query_starts = m;
    batch.context_lens = m + 2;
    batch.block_table_starts = m + 3;
    batch.block_tables = m + 5;
    const double sec = kvshard::bench::TimeMedian(b, 5, [&] {
        b.PagedAttention(q, stride, kv, batch, out->As<float>(), heads, nullptr);
    });
    if (sec <= 0) return {};
    const double flops = 4.0 * double(heads) * double(hd) * double(tokens) * double(tokens + 1) / 2.0;
    return {sec * 1e3, flops / sec / 1e12};
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"The bf16 MatMul ceiling, per-op times of a decode step and the prefill "
                 "attention's share of the ceiling",
                 "kvshard_cuda_op_bench"};
    kvshard::bench::CudaBenchFlags flags;
    flags.batches = {1, 32};
    int64_t prefill_tokens = 2048;
    kvshard::bench::AddCudaBenchFlags(app, &flags);
    app.add_option("--prefill-tokens", prefill_tokens, "Rows of the timed prefill chunk")
        ->check(CLI::Range(int64_t{2}, std::numeric_limits<int64_t>::max() / 2))
        ->capture_default_str();
    if (const int code = kvshard::bench::ParseCudaBenchFlags(app, argc, argv); code >= 0) {
        return code;
    }
    const std::string& backend = flags.backend;
    const std::string& shape_name = flags.shape;
    const std::vector<int64_t>& batches = flags.batches;
    const bool json = flags.json;
    if (batches.empty()) return Fail("--batches: at least one batch size");
    const kvshard::cuda::DecodeShape shape = kvshard::bench::ShapeOf(flags);
    std::vector<Gemm> gemms;
    if (shape_name == "tiny") {
        gemms = {{"square_256", 256, 256, 256}};
    } else {
        const int64_t t = prefill_tokens;
        gemms = {{"square_4096", 4096, 4096, 4096},
                 {"8b_qkv", t, shape.qkv_rows(), shape.hidden},
                 {"8b_o", t, shape.hidden, shape.heads * shape.head_dim},
                 {"8b_gate_up", t, 2 * shape.ffn, shape.hidden},
                 {"8b_down", t, shape.hidden, shape.ffn}};
    }
    auto made = kvshard::MakeBackend({.kind = kvshard::bench::BackendOf(flags)});
    if (!made.ok()) return Fail(made.status().message());
    Backend& b = **made;

    double ceiling = 0.0;
    std::string gemm_json;
    for (Gemm& g : gemms) {
        g.tflops = kvshard::bench::Bf16MatMulTflops(b, g.m, g.n, g.k);
        if (g.tflops <= 0) return Fail("the bf16 MatMul of " + g.name + " failed");
        ceiling = std::max(ceiling, g.tflops);
        std::printf("gemm %-12s m=%lld n=%lld k=%lld %.2f TFLOP/s\n", g.name.c_str(),
                    static_cast<long long>(g.m), static_cast<long long>(g.n),
                    static_cast<long long>(g.k), g.tflops);
        char row[256];
        std::snprintf(row, sizeof(row), "%s{\"name\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"tflops\":%.3f}",
                      gemm_json.empty() ? "" : ",", g.name.c_str(), static_cast<long long>(g.m),
                      static_cast<long long>(g.n), static_cast<long long>(g.k), g.tflops);
        gemm_json += row;
    }
    std::printf("ceiling %.2f TFLOP/s (bf16 MatMul, best of the products above)\n", ceiling);

    const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
    auto d = kvshard::cuda::SyntheticDecode::Create(b, shape, max_batch, 512, 1);
    if (!d.ok()) return Fail(d.status().message());
    std::string ops_json;
    for (int64_t batch : batches) {
        d->Step(batch);  // warm-up: plans, module load
        if (auto st = b.Synchronize(); !st.ok()) return Fail(st.message());
        std::string one;
        for (const auto& [name, ms] : d->OpTimes(batch, 20)) {
            std::printf("op batch=%lld %-14s %10.2f us\n", static_cast<long long>(batch),
                        name.c_str(), ms * 1e3);
            char item[128];
            std::snprintf(item, sizeof(item), "%s\"%s\":%.3f", one.empty() ? "" : ",",
                          name.c_str(), ms * 1e3);
            one += item;
        }
        ops_json += (ops_json.empty() ? "" : ",") + std::string("\"") + std::to_string(batch) +
                    "\":{" + one + "}";
    }

    const Prefill p = PrefillAttention(b, shape, prefill_tokens);
    if (p.ms <= 0) return Fail("the prefill attention of " + std::to_string(prefill_tokens) + " tokens failed");
    const double pct = ceiling > 0 ? 100.0 * p.tflops / ceiling : 0.0;
    std::printf("prefill tokens=%lld %.3f ms %.2f TFLOP/s %.1f%% of ceiling\n",
                static_cast<long long>(prefill_tokens), p.ms, p.tflops, pct);
    if (json) {
        std::printf("{\"backend\":\"%s\",\"shape\":\"%s\",\"ceiling_tflops\":%.3f,\"gemms\":[%s],"
                    "\"ops_us\":{%s},\"prefill\":{\"tokens\":%lld,\"ms\":%.4f,\"tflops\":%.3f,"
                    "\"pct_of_ceiling\":%.2f}}\n",
                    backend.c_str(), shape_name.c_str(), ceiling, gemm_json.c_str(),
                    ops_json.c_str(), static_cast<long long>(prefill_tokens), p.ms, p.tflops, pct);
    }
    return 0;
}
