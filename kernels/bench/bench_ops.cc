// Google Benchmark figures for the CPU ops (built with -DKVSHARD_BUILD_BENCHMARKS=ON):
//   build/kernels/kvshard_bench_ops --benchmark_filter=MatMulWT
// MatMulWT reports GFLOP/s as the "FLOPS" counter (2·m·n·k per call).
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "kernels/cpu_ops.h"

namespace kvshard::cpu {
namespace {

std::vector<float> RandomVector(size_t n, uint32_t seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (float& x : v) x = dist(gen);
    return v;
}

// Args: m, n (out_features), k (in_features).
void BM_MatMulWT(benchmark::State& state) {
    const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
    const auto x = RandomVector(m * k, 1);
    const auto w = RandomVector(n * k, 2);
    std::vector<float> y(m * n);
    for (auto _ : state) {
        MatMulWT(x.data(), w.data(), y.data(), m, n, k);
        benchmark::DoNotOptimize(y.data());
        benchmark::ClobberMemory();
    }
    state.counters["FLOPS"] = benchmark::Counter(static_cast<double>(2 * m * n * k),
                                                 benchmark::Counter::kIsIterationInvariantRate,
                                                 benchmark::Counter::kIs1000);
}
BENCHMARK(BM_MatMulWT)
    ->ArgNames({"m", "n", "k"})
    ->Args({1, 576, 1536})
    ->Args({64, 576, 1536})
    ->Args({1, 1536, 576})
    ->Args({64, 1536, 576})
    ->Args({1, 4096, 4096})
    ->Args({64, 4096, 4096})
    ->UseRealTime();  // BLAS threads work too: CPU time of the main thread would flatter it

// Args: num_q, context length (q_pos0 + num_q), heads, kv heads; head_dim 64.
void BM_Attention(benchmark::State& state) {
    const int64_t num_q = state.range(0), num_kv = state.range(1);
    const int64_t heads = state.range(2), kv_heads = state.range(3), head_dim = 64;
    const auto q = RandomVector(num_q * heads * head_dim, 3);
    const auto k = RandomVector(num_kv * kv_heads * head_dim, 4);
    const auto v = RandomVector(num_kv * kv_heads * head_dim, 5);
    std::vector<float> out(q.size());
    for (auto _ : state) {
        Attention(q.data(), k.data(), v.data(), out.data(), num_q, num_kv - num_q, num_kv, heads,
                  kv_heads, head_dim, kv_heads * head_dim);
        benchmark::DoNotOptimize(out.data());
    }
}
BENCHMARK(BM_Attention)
    ->ArgNames({"q", "ctx", "heads", "kv_heads"})
    ->Args({1, 1024, 9, 3})
    ->Args({256, 256, 9, 3})
    ->UseRealTime();

void BM_RmsNorm(benchmark::State& state) {
    const int64_t rows = state.range(0), dim = state.range(1);
    const auto x = RandomVector(rows * dim, 6);
    const auto weight = RandomVector(dim, 7);
    std::vector<float> out(x.size());
    for (auto _ : state) {
        RmsNorm(x.data(), weight.data(), out.data(), rows, dim, 1e-5f);
        benchmark::DoNotOptimize(out.data());
    }
    state.SetBytesProcessed(state.iterations() * rows * dim * 2 * sizeof(float));
}
BENCHMARK(BM_RmsNorm)->Args({1, 576})->Args({64, 576})->UseRealTime();

void BM_SiluMul(benchmark::State& state) {
    const int64_t rows = state.range(0), dim = state.range(1);
    const auto gate = RandomVector(rows * dim, 8);
    const auto up = RandomVector(rows * dim, 9);
    std::vector<float> out(gate.size());
    for (auto _ : state) {
        SiluMul(gate.data(), up.data(), out.data(), rows, dim);
        benchmark::DoNotOptimize(out.data());
    }
    state.SetItemsProcessed(state.iterations() * rows * dim);
}
BENCHMARK(BM_SiluMul)->Args({1, 1536})->Args({64, 1536})->UseRealTime();

void BM_Rope(benchmark::State& state) {
    const int64_t rows = state.range(0), heads = 9, head_dim = 64;
    auto x = RandomVector(rows * heads * head_dim, 10);
    std::vector<int32_t> positions(rows);
    for (int64_t r = 0; r < rows; ++r) positions[r] = static_cast<int32_t>(r);
    std::vector<float> inv_freq(head_dim / 2);
    RopeInvFreq(head_dim, 10000.0f, {}, inv_freq.data());
    for (auto _ : state) {
        Rope(x.data(), positions.data(), rows, heads, head_dim, inv_freq.data());
        benchmark::DoNotOptimize(x.data());
    }
}
BENCHMARK(BM_Rope)->Arg(1)->Arg(64)->UseRealTime();

}  // namespace
}  // namespace kvshard::cpu

int main(int argc, char** argv) {
    // OpenBLAS's kernel choice decides the matmul figures (see cpu::SuggestedBlasCoreType).
    benchmark::AddCustomContext("openblas_core", kvshard::cpu::BlasCoreName());
    benchmark::AddCustomContext("omp_threads", std::to_string(kvshard::cpu::NumThreads()));
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
}
