// The register-blocked batched-decode product of kernels/cpu_gemm.h (AVX-512). Compiled for any
// x86-64 target: every function that uses AVX-512 carries the target attribute, and
// kernels/cpu_matmul.cc calls GemmAvx512 only after cpuid and xgetbv said the CPU and the OS
// support the registers.
#include "kernels/cpu_gemm.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/check.h"
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

std::atomic<GemmMode> g_mode{GemmMode::kAuto};

}  // namespace

bool UsesGemm(KernelIsa isa, DType dtype, int64_t m) {
    if (isa != KernelIsa::kAvx512 || !GemmReads(dtype)) return false;
    switch (g_mode.load(std::memory_order_relaxed)) {
        case GemmMode::kAuto:
            return m >= kMinGemmRows && m <= kMaxGemmRows;
        case GemmMode::kOff:
            return false;
        case GemmMode::kOn:
            return true;
    }
    return false;
}

void ForceGemmMode(GemmMode mode) { g_mode.store(mode, std::memory_order_relaxed); }

void ResetGemmMode() { g_mode.store(GemmMode::kAuto, std::memory_order_relaxed); }

bool GemmReads(DType dtype) {
    switch (dtype) {
        case DType::kF16:
        case DType::kBF16:
        case DType::kQ8_0:
        case DType::kQ4_0:
        case DType::kQ4_1:
        case DType::kQ5_0:
        case DType::kQ5_1:
        case DType::kQ4_K:
        case DType::kQ5_K:
        case DType::kQ6_K:
            return true;
        default:
            return false;
    }
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
    // x^T: k rows of ld floats, the activation rows past m zero.
    const int64_t ld = (m + kLanes - 1) / kLanes * kLanes;
    float* xt = Scratch<Use::kTransposed>(static_cast<size_t>(ld * k));
    const int64_t strips = (n + kGemmStripRows - 1) / kGemmStripRows;
    const bool parallel = strips > 1 && m * n * k >= kMinParallelMacs;
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t p0 = 0; p0 < k; p0 += kLanes) {
            const int64_t p1 = std::min(k, p0 + kLanes);
            for (int64_t i = 0; i < ld; ++i) {
                for (int64_t p = p0; p < p1; ++p) xt[p * ld + i] = i < m ? x[i * k + p] : 0.0f;
            }
        }
        // (The loop's closing barrier publishes x^T to the team.)
        float* wb = Scratch<Use::kStrip>(static_cast<size_t>(kGemmStripRows * k));
        alignas(64) float out[kGemmStripRows * kTileRows];
#pragma omp for schedule(dynamic, 2) nowait
        for (int64_t s = 0; s < strips; ++s) {
            const int64_t j0 = s * kGemmStripRows;
            const int64_t rows = std::min(kGemmStripRows, n - j0);
            matmul_internal::DequantizeRowsAvx512(w, j0, j0 + rows, wb);
            if (rows < kGemmStripRows) {
                std::memset(wb + rows * k, 0,
                            static_cast<size_t>((kGemmStripRows - rows) * k) * sizeof(float));
            }
            for (int64_t i0 = 0; i0 < ld; i0 += kTileRows) {
                const int64_t tile = std::min(kTileRows, ld - i0);
                if (tile == kTileRows) {
                    Tile<2>(xt + i0, ld, wb, k, out);
                } else {
                    Tile<1>(xt + i0, ld, wb, k, out);
                }
                const int64_t valid = std::min(tile, m - i0);
                for (int64_t i = 0; i < valid; ++i) {
                    float* yi = y + (i0 + i) * n + j0;
                    for (int64_t j = 0; j < rows; ++j) yi[j] = out[j * tile + i];
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
