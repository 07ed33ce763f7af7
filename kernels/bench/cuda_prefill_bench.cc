// The tensor-core prefill attention against the fp32 one (kernels/cuda/prefill_select.h) at the
// Llama-3-8B attention shape (32 query heads on 8 KV heads of 128, bf16 pool of 16-token blocks):
// one --tokens chunk from position 0, causal. Per kernel: ms (median of --reps calls, the two
// kernels interleaved), TFLOP/s of the causal FLOPs (4 · heads · head_dim · n(n+1)/2) and % of
// the backend's bf16 MatMul ceiling (cuBLASLt, the best of 4096³ and the 8B gate|up product at
// --tokens rows, as kvshard_cuda_op_bench measures it). Fails (exit 1) when the two kernels'
// outputs differ by more than the bf16 bound (relative L2 1e-2) or hold a NaN.
// Prints one line per figure, a `note` line (scripts/gpu-check's prefilltc step) and, with
// --json, one JSON object.
//   kvshard_cuda_prefill_bench [--tokens 2048] [--reps 10] [--json]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/backend.h"
#include "kernels/bench/cuda_bench_flags.h"
#include "kernels/bench/cuda_bench_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/paged_attention.h"

namespace {

using kvshard::Backend;
using kvshard::BackendBuffer;
using kvshard::cuda::PrefillKernel;
using kvshard::bench::Median;
using kvshard::bench::TimeOnce;

constexpr double kTargetPct = 60.0;  // issue 13

int Fail(const std::string& message) {
    std::fprintf(stderr, "kvshard_cuda_prefill_bench: %s\n", message.c_str());
    return 2;
}

}  // namespace

int main(int argc, char** argv) {
    int64_t tokens = 2048;
    int reps = 10;
    bool json = false;
    CLI::App app{"kvshard_cuda_prefill_bench: the tensor-core prefill attention against the fp32 "
                 "one at the 8B shape, as % of the bf16 MatMul ceiling"};
    app.add_option("--tokens", tokens, "Prompt tokens of the one sequence")
        ->check(CLI::Range(int64_t{2}, int64_t{1} << 20))
        ->capture_default_str();
    app.add_option("--reps", reps, "Timed repetitions of each kernel")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    app.add_flag("--json", json, "Also print one JSON object");
    if (const int rc = kvshard::bench::ParseCudaBenchFlags(app, argc, argv); rc >= 0) return rc;
    if (tokens < 2 || reps < 1) return Fail("--tokens must be at least 2 and --reps at least 1");
    auto made = kvshard::MakeBackend({.kind = kvshard::BackendKind::kCuda});
    if (!made.ok()) return Fail(made.status().message());
    Backend& b = **made;
    auto& cuda = static_cast<kvshard::cuda::CudaBackend&>(b);

    const int64_t heads = 32, kv_heads = 8, hd = 128, hidden = 4096, ffn = 14336, bs = 16;
    const double ceiling =
        std::max(kvshard::bench::Bf16MatMulTflops(b, 4096, 4096, 4096),
                 kvshard::bench::Bf16MatMulTflops(b, tokens, 2 * ffn, hidden));
    if (ceiling <= 0) return Fail("the bf16 MatMul failed");
    std::printf("ceiling %.2f TFLOP/s (bf16 MatMul: best of 4096^3 and %lldx%lldx%lld)\n", ceiling,
                static_cast<long long>(tokens), static_cast<long long>(2 * ffn),
                static_cast<long long>(hidden));

    // One sequence of `tokens` rows at positions 0.., its K/V written first by KvWrite.
    const int64_t blocks = (tokens + bs - 1) / bs;
    const int64_t block_bytes =
        kvshard::cpu::PagedLayerBytes(kvshard::KvDtype::kBf16, bs, kv_heads, hd);
    const int64_t stride = (heads + 2 * kv_heads) * hd, out_floats = tokens * heads * hd;
    auto pool = b.Allocate(size_t(blocks * block_bytes));
    auto qkv = b.Allocate(size_t(tokens * stride) * 4);
    auto out_tc = b.Allocate(size_t(out_floats) * 4), out_fp32 = b.Allocate(size_t(out_floats) * 4);
    auto slots = b.Allocate(size_t(tokens) * 8);
    auto meta = b.Allocate(size_t(blocks + 8) * 4);
    if (!pool.ok() || !qkv.ok() || !out_tc.ok() || !out_fp32.ok() || !slots.ok() || !meta.ok()) {
        return Fail("allocation failed");
    }
    const std::vector<float> xh = kvshard::bench::RandomFloats(size_t(tokens * stride), 5, 1.0f);
    std::vector<int64_t> sh(static_cast<size_t>(tokens));
    for (int64_t i = 0; i < tokens; ++i) sh[size_t(i)] = i;
    std::vector<int32_t> mh = {0, int32_t(tokens), int32_t(tokens), 0, int32_t(blocks)};
    for (int64_t i = 0; i < blocks; ++i) mh.push_back(int32_t(i));
    if (!b.CopyToDevice(qkv->data(), xh.data(), xh.size() * 4).ok() ||
        !b.CopyToDevice(slots->data(), sh.data(), sh.size() * 8).ok() ||
        !b.CopyToDevice(meta->data(), mh.data(), mh.size() * 4).ok()) {
        return Fail("copy to the device failed");
    }
    const kvshard::PagedKvLayer kv = kvshard::cpu::MakePagedKvLayer(
        pool->As<uint8_t>(), block_bytes, 0, kvshard::KvDtype::kBf16, bs, kv_heads, hd);
    float* q = qkv->As<float>();
    b.KvWrite(kv, q + heads * hd, q + (heads + kv_heads) * hd, stride, slots->As<int64_t>(),
              tokens);
    const int32_t* m = meta->As<int32_t>();
    kvshard::PagedAttentionBatch batch;
    batch.num_seqs = 1;
    batch.query_starts = m;
    batch.context_lens = m + 2;
    batch.block_table_starts = m + 3;
    batch.block_tables = m + 5;

    struct Run {
        const char* name;
        PrefillKernel kernel;
        float* out;
        std::vector<double> sec;
    };
    Run runs[] = {{"tc", PrefillKernel::kTensorCore, out_tc->As<float>(), {}},
                  {"fp32", PrefillKernel::kFp32, out_fp32->As<float>(), {}}};
    for (int i = 0; i <= reps; ++i) {  // call 0 of each: warm-up (module load, smem opt-in)
        for (Run& r : runs) {
            cuda.set_prefill_kernel(r.kernel);
            const double s =
                TimeOnce(b, [&] { b.PagedAttention(q, stride, kv, batch, r.out, heads, nullptr); });
            if (s <= 0) return Fail(std::string("the ") + r.name + " prefill attention failed");
            if (i > 0) r.sec.push_back(s);
        }
    }
    std::vector<float> got(static_cast<size_t>(out_floats)), want(static_cast<size_t>(out_floats));
    if (!b.CopyToHost(got.data(), out_tc->data(), got.size() * 4).ok() ||
        !b.CopyToHost(want.data(), out_fp32->data(), want.size() * 4).ok() ||
        !b.Synchronize().ok()) {
        return Fail("copy to the host failed");
    }
    double num = 0, den = 1e-30;
    bool nan = false;
    for (size_t i = 0; i < got.size(); ++i) {
        nan = nan || std::isnan(got[i]) || std::isnan(want[i]);
        num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
        den += double(want[i]) * want[i];
    }
    const double rel = nan ? INFINITY : std::sqrt(num / den);

    const double flops =
        4.0 * double(heads) * double(hd) * double(tokens) * double(tokens + 1) / 2.0;
    double ms[2], tflops[2], pct[2];
    for (int k = 0; k < 2; ++k) {
        const double sec = Median(runs[k].sec);
        ms[k] = sec * 1e3;
        tflops[k] = flops / sec / 1e12;
        pct[k] = 100.0 * tflops[k] / ceiling;
        std::printf("prefill %-4s tokens=%lld %.3f ms %.2f TFLOP/s %.1f%% of ceiling\n",
                    runs[k].name, static_cast<long long>(tokens), ms[k], tflops[k], pct[k]);
    }
    std::printf("tc vs fp32: relative L2 %.2e (bound 1e-2)%s\n", rel, nan ? ", NaN" : "");
    std::printf(
        "note %lld tokens: tc %.2f ms = %.1f TFLOP/s = %.1f%% of %.1f (%s the %.0f%% "
        "target); fp32 %.2f ms; speedup %.2fx; rel L2 %.1e\n",
        static_cast<long long>(tokens), ms[0], tflops[0], pct[0], ceiling,
        pct[0] >= kTargetPct ? "meets" : "below", kTargetPct, ms[1], ms[1] / ms[0], rel);
    if (json) {
        std::printf(
            "{\"tokens\":%lld,\"ceiling_tflops\":%.3f,\"tc\":{\"ms\":%.4f,\"tflops\":%.3f,"
            "\"pct_of_ceiling\":%.2f},\"fp32\":{\"ms\":%.4f,\"tflops\":%.3f,"
            "\"pct_of_ceiling\":%.2f},\"rel_l2\":%.3e}\n",
            static_cast<long long>(tokens), ceiling, ms[0], tflops[0], pct[0], ms[1], tflops[1],
            pct[1], nan ? -1.0 : rel);
    }
    if (!(rel <= 1e-2)) {
        std::fprintf(stderr,
                     "kvshard_cuda_prefill_bench: tc and fp32 outputs differ (rel L2 %.2e)\n", rel);
        return 1;
    }
    return 0;
}
