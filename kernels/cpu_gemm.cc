// The register-blocked batched-decode product of kernels/cpu_gemm.h (AVX-512). Compiled for any
// x86-64 target: every function that uses AVX-512 carries the target attribute, and
// kernels/cpu_matmul.cc calls GemmAvx512 only after cpuid and xgetbv said the CPU and the OS
// support the registers.
#include "kernels/cpu_gemm.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "common/check.h"
#include "kernels/cpu_matmul_batch_copy.h"
#include "kernels/cpu_matmul_internal.h"

#if defined(__x86_64__)
// GCC 12 reports the deliberately undefined pass-through operand of many AVX-512 intrinsics as
// uninitialized once they are inlined (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define KV_GEMM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#endif

namespace kvshard::cpu::gemm {
namespace {

constexpr int64_t kLanes = 16;
// Activation rows of the widest tile: two zmm columns.
constexpr int64_t kTileRows = 2 * kLanes;
// A quarter of the 1 MiB L2 of the cores this was tuned on (Zen 4; 1-2 MiB on current x86).
constexpr int64_t kL2QuarterBytes = int64_t{256} << 10;
// Below this many multiply-adds a product runs on the calling thread (as in cpu_matmul.cc).
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;

// 64-byte aligned room for `floats` floats, kept by the calling thread between calls (its pages
// are faulted in once); one buffer per Use.
enum class Use { kTransposed, kStrip };
template <Use U>
float* Scratch(size_t floats) {
    thread_local std::vector<float> buffer;
    constexpr size_t kAlignFloats = 64 / sizeof(float);
    if (buffer.size() < floats + kAlignFloats) buffer.resize(floats + kAlignFloats);
    float* p = buffer.data();
    const size_t misaligned = reinterpret_cast<uintptr_t>(p) % 64;
    return misaligned == 0 ? p : p + (64 - misaligned) / sizeof(float);
}

// KVSHARD_MATMUL_GEMM=auto|off|on, read once; unset means auto. A pinned mode overrides it.
GemmMode EnvironmentMode() {
    static const GemmMode mode = [] {
        const char* env = std::getenv("KVSHARD_MATMUL_GEMM");
        if (env == nullptr || std::string_view(env) == "auto") return GemmMode::kAuto;
        if (std::string_view(env) == "off") return GemmMode::kOff;
        if (std::string_view(env) == "on") return GemmMode::kOn;
        std::fprintf(stderr, "kvshard: KVSHARD_MATMUL_GEMM=%s is not auto, off or on; using auto\n",
                     env);
        return GemmMode::kAuto;
    }();
    return mode;
}

constexpr int kNotPinned = -1;
std::atomic<int> g_pinned{kNotPinned};

}  // namespace

bool UsesGemm(KernelIsa isa, DType dtype, int64_t m) {
    if (isa != KernelIsa::kAvx512 || !GemmReads(dtype)) return false;
    const int pinned = g_pinned.load(std::memory_order_relaxed);
    switch (pinned == kNotPinned ? EnvironmentMode() : static_cast<GemmMode>(pinned)) {
        case GemmMode::kAuto:
            return m >= kMinGemmRows && m <= kMaxGemmRows;
        case GemmMode::kOff:
            return false;
        case GemmMode::kOn:
            return true;
    }
    return false;
}

void ForceGemmMode(GemmMode mode) {
    g_pinned.store(static_cast<int>(mode), std::memory_order_relaxed);
}

void ResetGemmMode() { g_pinned.store(kNotPinned, std::memory_order_relaxed); }

bool GemmReads(DType dtype) {
    return dtype != DType::kF32 && matmul_internal::HasSimdKernel(dtype);
}

#if defined(__x86_64__)
namespace {

// out[j, i] (kGemmStripRows rows of V·16 floats) = sum over p of xt[p, i] · wb[j, p] for the
// V·16 activation rows whose column starts at xt (stride ld) and the strip's weight rows wb
// (stride k): one FMA per (i, j, p) in order of p, from zero.
template <int V>
KV_GEMM_AVX512 inline __attribute__((always_inline)) void Tile(const float* xt, int64_t ld,
                                                               const float* wb, int64_t k,
                                                               float* out) {
    constexpr int kJ = static_cast<int>(kGemmStripRows);
    __m512 acc[V][kJ];
#pragma GCC unroll 12
    for (int j = 0; j < kJ; ++j) {
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) acc[v][j] = _mm512_setzero_ps();
    }
    const float* w[kJ];
#pragma GCC unroll 12
    for (int j = 0; j < kJ; ++j) w[j] = wb + j * k;
    for (int64_t p = 0; p < k; ++p) {
        __m512 a[V];
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) a[v] = _mm512_load_ps(xt + p * ld + v * kLanes);
#pragma GCC unroll 12
        for (int j = 0; j < kJ; ++j) {
            const __m512 b = _mm512_set1_ps(w[j][p]);
#pragma GCC unroll 2
            for (int v = 0; v < V; ++v) acc[v][j] = _mm512_fmadd_ps(a[v], b, acc[v][j]);
        }
    }
#pragma GCC unroll 12
    for (int j = 0; j < kJ; ++j) {
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) _mm512_store_ps(out + (j * V + v) * kLanes, acc[v][j]);
    }
}

}  // namespace

KV_GEMM_AVX512 void GemmAvx512(const float* x, int64_t m, const StoredMatrix& w, float* y) {
    KV_CHECK(m >= 1 && GemmReads(w.dtype)) << "m=" << m << " dtype=" << DTypeName(w.dtype);
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    const int64_t ld = (m + kLanes - 1) / kLanes * kLanes;  // activation rows, zero-padded
    // Blocks of activation rows (whole tiles) whose x^T fits in a quarter of L2, and chunks of
    // strips whose dequantized weights fit in another quarter: a chunk is dequantized once and
    // multiplied by every block while both stay in L2 (the whole x^T of a 512-row prefill
    // chunk does not).
    const int64_t row_block =
        std::max(kTileRows, kL2QuarterBytes / (k * int64_t{sizeof(float)}) / kTileRows * kTileRows);
    const int64_t strip_floats = kGemmStripRows * k;
    const int64_t chunk_strips =
        std::max<int64_t>(1, kL2QuarterBytes / (strip_floats * int64_t{sizeof(float)}));
    // x^T by blocks: block b holds rows [b·row_block, +rb) as k rows of rb floats (rb = row_block
    // but for the last block), the rows past m zero.
    float* xt = Scratch<Use::kTransposed>(static_cast<size_t>(ld * k));
    const int64_t strips = (n + kGemmStripRows - 1) / kGemmStripRows;
    const int64_t chunks = (strips + chunk_strips - 1) / chunk_strips;
    const bool parallel = strips > 1 && m * n * k >= kMinParallelMacs;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t p0 = 0; p0 < k; p0 += kLanes) {
            const int64_t p1 = std::min(k, p0 + kLanes);
            for (int64_t r0 = 0; r0 < ld; r0 += row_block) {
                const int64_t rb = std::min(row_block, ld - r0);
                float* block = xt + r0 * k;
                for (int64_t i = r0; i < r0 + rb; ++i) {
                    for (int64_t p = p0; p < p1; ++p) {
                        block[p * rb + (i - r0)] = i < m ? x[i * k + p] : 0.0f;
                    }
                }
            }
        }
        // (The loop's closing barrier publishes x^T to the team.)
        float* wb = Scratch<Use::kStrip>(static_cast<size_t>(chunk_strips * strip_floats));
        alignas(64) float out[kGemmStripRows * kTileRows];
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t s0 = c * chunk_strips;
            const int64_t s1 = std::min(strips, s0 + chunk_strips);
            for (int64_t s = s0; s < s1; ++s) {
                const int64_t j0 = s * kGemmStripRows;
                const int64_t rows = std::min(kGemmStripRows, n - j0);
                float* strip = wb + (s - s0) * strip_floats;
                matmul_internal::DequantizeRowsPreferCopyAvx512(w, j0, j0 + rows, strip);
                if (rows < kGemmStripRows) {
                    std::memset(strip + rows * k, 0,
                                static_cast<size_t>((kGemmStripRows - rows) * k) * sizeof(float));
                }
            }
            for (int64_t r0 = 0; r0 < ld; r0 += row_block) {
                const int64_t rb = std::min(row_block, ld - r0);
                const float* block = xt + r0 * k;
                for (int64_t s = s0; s < s1; ++s) {
                    const int64_t j0 = s * kGemmStripRows;
                    const int64_t rows = std::min(kGemmStripRows, n - j0);
                    const float* strip = wb + (s - s0) * strip_floats;
                    for (int64_t t0 = 0; t0 < rb; t0 += kTileRows) {
                        const int64_t tile = std::min(kTileRows, rb - t0);
                        if (tile == kTileRows) {
                            Tile<2>(block + t0, rb, strip, k, out);
                        } else {
                            Tile<1>(block + t0, rb, strip, k, out);
                        }
                        const int64_t valid = std::min(tile, m - r0 - t0);
                        for (int64_t i = 0; i < valid; ++i) {
                            float* yi = y + (r0 + t0 + i) * n + j0;
                            for (int64_t j = 0; j < rows; ++j) yi[j] = out[j * tile + i];
                        }
                    }
                }
            }
        }
    }
}
#else
void GemmAvx512(const float*, int64_t, const StoredMatrix&, float*) {
    KV_CHECK(false) << "GemmAvx512 on a CPU without AVX-512";
}
#endif

}  // namespace kvshard::cpu::gemm
