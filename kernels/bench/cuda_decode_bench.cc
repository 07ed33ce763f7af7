// The backend's ceilings (device copy GB/s through CopyBlocks; bf16 MatMul TFLOP/s at n = 8192),
// then decode time per step of a Llama-shaped model with random bf16 weights (kernels/cuda/
// synthetic_decode.h) on a backend, at several batch sizes and one context length: ms/step,
// tokens/s and the share of the memory roofline (the bytes a step must read — every weight once,
// plus the KV of every sequence — over the device copy bandwidth measured here with CopyBlocks).
// Each batch is timed eagerly and as a CUDA graph replay of the captured step (the logits of the
// two must be identical, bit for bit), after per-op times at batch 8. Prints one line per batch;
// --json adds one JSON object.
//   kvshard_cuda_decode_bench [--backend cuda|cpu] [--shape 8b|tiny] [--context 512]
//                             [--batches 1,8,32,64,128] [--steps 10] [--json]
// Flags are parsed by CLI11 (the shared ones in kernels/bench/cuda_bench_flags.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/bench/cuda_bench_flags.h"
#include "kernels/bench/cuda_bench_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/synthetic_decode.h"

namespace {

using kvshard::Backend;
using Clock = std::chrono::steady_clock;
using kvshard::bench::Median;

int Fail(const std::string& message) {
    std::fprintf(stderr, "kvshard_cuda_decode_bench: %s\n", message.c_str());
    return 2;
}

// Device copy bandwidth (bytes read + written per second): one block of `bytes` copied to
// another by CopyBlocks, median of 5 after a warm-up.
double CopyBandwidth(Backend& b, size_t bytes) {
    auto pool = b.Allocate(2 * bytes);
    if (!pool.ok()) return 0.0;
    auto pairs = b.Allocate(64);
    const int32_t host[2] = {0, 1};
    if (!pairs.ok() || !b.CopyToDevice(pairs->data(), host, sizeof(host)).ok()) return 0.0;
    std::vector<double> t;
    for (int i = 0; i < 6; ++i) {
        const auto t0 = Clock::now();
        b.CopyBlocks(pool->data(), int64_t(bytes), pairs->As<int32_t>(), 1);
        if (!b.Synchronize().ok()) return 0.0;
        if (i > 0) t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return 2.0 * double(bytes) / Median(t);
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{"Decode ms/step of a Llama-shaped model with random bf16 weights",
                 "kvshard_cuda_decode_bench"};
    kvshard::bench::CudaBenchFlags flags;
    flags.batches = {1, 8, 32, 64, 128};
    int64_t context = 512, steps = 10;
    kvshard::bench::AddCudaBenchFlags(app, &flags);
    app.add_option("--context", context, "Positions of KV behind every sequence")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    app.add_option("--steps", steps, "Timed steps per batch (the median is printed)")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    if (const int code = kvshard::bench::ParseCudaBenchFlags(app, argc, argv); code >= 0) {
        return code;
    }
    const std::string& backend = flags.backend;
    const std::string& shape_name = flags.shape;
    const std::vector<int64_t>& batches = flags.batches;
    const bool json = flags.json;
    const kvshard::cuda::DecodeShape shape = kvshard::bench::ShapeOf(flags);
    if (batches.empty()) return Fail("--batches: at least one batch size");
    auto b = kvshard::MakeBackend({.kind = kvshard::bench::BackendOf(flags)});
    if (!b.ok()) return Fail(b.status().message());
    Backend& be = **b;
    const double bw = CopyBandwidth(be, backend == "cuda" ? size_t{1} << 30 : size_t{64} << 20);
    const int64_t n_ceiling = backend == "cuda" ? 8192 : 256;  // an n x n x n product
    const double tflops = kvshard::bench::Bf16MatMulTflops(be, n_ceiling, n_ceiling, n_ceiling);
    std::printf("ceilings: device copy %.0f GB/s (read + write), bf16 MatMul %.1f TFLOP/s at n=%d\n",
                bw / 1e9, tflops, backend == "cuda" ? 8192 : 256);
    const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
    const auto t_load = Clock::now();
    auto d = kvshard::cuda::SyntheticDecode::Create(be, shape, max_batch, context, 1);
    if (!d.ok()) return Fail(d.status().message());
    std::fprintf(stderr, "%s: %s shape, %.2f GB of bf16 weights set up in %.1f s; copy %.0f GB/s\n",
                 be.Describe().c_str(), shape_name.c_str(), double(shape.weight_bytes()) / 1e9,
                 std::chrono::duration<double>(Clock::now() - t_load).count(), bw / 1e9);
    // Per-op times at batch 8 (or the first batch given): where a step's time goes.
    {
        const int64_t op_batch =
            std::find(batches.begin(), batches.end(), 8) != batches.end() ? 8 : batches.front();
        std::printf("ops at batch %lld (ms per call, layer 0):", static_cast<long long>(op_batch));
        for (const auto& [name, ms] : d->OpTimes(op_batch, 20)) std::printf(" %s %.4f", name.c_str(), ms);
        std::printf("\n");
    }
    std::string rows;
    for (int64_t batch : batches) {
        for (int i = 0; i < 2; ++i) d->Step(batch);  // warm-up: plans, module load
        if (auto st = be.Synchronize(); !st.ok()) return Fail(st.message());
        std::vector<double> t;
        for (int64_t i = 0; i < steps; ++i) {
            const auto t0 = Clock::now();
            d->Step(batch);
            if (auto st = be.Synchronize(); !st.ok()) return Fail(st.message());
            t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        }
        auto logits = d->Logits(batch);
        if (!logits.ok()) return Fail(logits.status().message());
        for (float x : *logits) {
            if (!std::isfinite(x)) return Fail("a logit is not finite at batch " + std::to_string(batch));
        }
        // The same step captured once and replayed.
        double graph_sec = 0.0;
        if (auto* cuda = dynamic_cast<kvshard::cuda::CudaBackend*>(&be)) {
            if (auto st = cuda->BeginCapture(); !st.ok()) return Fail(st.message());
            d->Step(batch);
            auto graph = cuda->EndCapture();
            if (!graph.ok()) return Fail(graph.status().message());
            std::vector<double> g;
            for (int64_t i = 0; i < steps + 2; ++i) {
                const auto t0 = Clock::now();
                if (auto st = cuda->Replay(*graph); !st.ok()) return Fail(st.message());
                if (auto st = be.Synchronize(); !st.ok()) return Fail(st.message());
                if (i >= 2) g.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
            }
            graph_sec = Median(g);
            auto replayed = d->Logits(batch);
            if (!replayed.ok()) return Fail(replayed.status().message());
            if (*replayed != *logits) {
                return Fail("graph replay gave other logits than eager at batch " + std::to_string(batch));
            }
        }
        const double sec = Median(t);
        const double kv_bytes =
            double(batch) * double(context + 1) * double(shape.layers) *
            double(2 * shape.kv_heads * kvshard::KvRowBytes(shape.kv_dtype, shape.head_dim));
        const double floor_s = bw > 0 ? (double(shape.weight_bytes()) + kv_bytes) / bw : 0.0;
        std::printf("batch %4lld  context %lld  %8.3f ms/step  %9.1f tok/s  %5.1f%% of roofline"
                    "  graph %8.3f ms/step\n",
                    static_cast<long long>(batch), static_cast<long long>(context), sec * 1e3,
                    double(batch) / sec, floor_s > 0 ? 100.0 * floor_s / sec : 0.0,
                    graph_sec * 1e3);
        char row[256];
        std::snprintf(row, sizeof(row),
                      "%s{\"batch\":%lld,\"ms_per_step\":%.4f,\"tok_per_s\":%.2f,"
                      "\"roofline_pct\":%.2f,\"graph_ms_per_step\":%.4f}",
                      rows.empty() ? "" : ",", static_cast<long long>(batch), sec * 1e3,
                      double(batch) / sec, floor_s > 0 ? 100.0 * floor_s / sec : 0.0,
                      graph_sec * 1e3);
        rows += row;
    }
    if (json) {
        std::printf("{\"backend\":\"%s\",\"shape\":\"%s\",\"context\":%lld,\"copy_gbps\":%.1f,"
                    "\"matmul_tflops\":%.2f,\"weight_bytes\":%lld,\"batches\":[%s]}\n",
                    backend.c_str(), shape_name.c_str(), static_cast<long long>(context), bw / 1e9,
                    tflops, static_cast<long long>(shape.weight_bytes()), rows.c_str());
    }
    return 0;
}
