// What kvshard's CUDA benches (kvshard_cuda_decode_bench, kvshard_cuda_op_bench,
// kvshard_cuda_prefill_bench) time the same way: medians, seconds of a queued op waited for,
// random operands, and the backend's bf16 matrix-product rate that their ceilings come from.
// A plain host header; every function takes the Backend, so the benches also run on the CPU.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/backend.h"

namespace kvshard::bench {

inline double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

// Seconds of one queued `op`, waited for; 0 when the backend reports an error.
template <typename Op>
double TimeOnce(Backend& b, Op op) {
    const auto t0 = std::chrono::steady_clock::now();
    op();
    if (!b.Synchronize().ok()) return 0.0;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The median of `reps` timings of `op` after one warm-up; 0 on an error.
template <typename Op>
double TimeMedian(Backend& b, int reps, Op op) {
    std::vector<double> t;
    for (int i = 0; i <= reps; ++i) {
        const double s = TimeOnce(b, op);
        if (s <= 0) return 0.0;
        if (i > 0) t.push_back(s);
    }
    return Median(t);
}

// n values uniform in [-scale, scale], the same for the same seed.
inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return v;
}

// TFLOP/s of y[m, n] = x[m, k] · w[n, k]^T through the backend's MatMul with bf16 weights (on
// CUDA: the fp32 activations converted to bf16, cuBLASLt, fp32 compute and out), random data,
// median of 5 after a warm-up; 0 when an allocation, copy or product fails.
inline double Bf16MatMulTflops(Backend& b, int64_t m, int64_t n, int64_t k) {
    auto w = b.Allocate(size_t(n * k) * 2), x = b.Allocate(size_t(m * k) * 4),
         y = b.Allocate(size_t(m * n) * 4);
    if (!w.ok() || !x.ok() || !y.ok()) return 0.0;
    const std::vector<float> wf = RandomFloats(size_t(n * k), 3, 0.01f);
    std::vector<uint16_t> wh(wf.size());
    for (size_t i = 0; i < wf.size(); ++i) wh[i] = FloatToBF16(wf[i]);
    const std::vector<float> xh = RandomFloats(size_t(m * k), 4, 1.0f);
    if (!b.CopyToDevice(w->data(), wh.data(), wh.size() * 2).ok() ||
        !b.CopyToDevice(x->data(), xh.data(), xh.size() * 4).ok() || !b.Synchronize().ok()) {
        return 0.0;
    }
    const WeightView view{.dtype = DType::kBF16, .data = w->data(), .rows = n, .cols = k};
    const double sec =
        TimeMedian(b, 5, [&] { b.MatMul(x->As<float>(), m, view, y->As<float>()); });
    return sec > 0 ? 2.0 * double(m) * double(n) * double(k) / sec / 1e12 : 0.0;
}

}  // namespace kvshard::bench
