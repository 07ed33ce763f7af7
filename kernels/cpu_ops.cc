// CPU ops: BLAS for the matmuls, OpenMP across heads for attention, plain loops the compiler
// vectorizes (-O3 -march=native, `omp simd` where a float reduction would otherwise stay scalar)
// for everything else.
#include "kernels/cpu_ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>

#include "common/check.h"
#include "kernels/vec_math.h"

namespace kvshard::cpu {
namespace {

// Below this many floats an elementwise op is faster on one thread than the fork/join of an
// OpenMP team (measured on 2 cores: RmsNorm of 64 × 576 floats takes ~7 µs on one).
constexpr int64_t kMinParallelFloats = 1 << 18;

// fn(r) for r < n, over the OpenMP team when `parallel`. A serial call never enters a region: even
// an `omp parallel for if (false)` sets up a team of one, 0.38-0.45 µs a call on this 2-core
// machine against 0.03-0.04 µs for the loop alone over 576 floats, and a batch-1 decode step runs
// the row ops below ~150 times on a few hundred floats each.
template <typename Fn>
inline void ForRows(int64_t n, bool parallel, const Fn& fn) {
    if (parallel) {
#pragma omp parallel for
        for (int64_t r = 0; r < n; ++r) fn(r);
    } else {
        for (int64_t r = 0; r < n; ++r) fn(r);
    }
}

// cos and sin of one position for every frequency, then the rotation of each head of row r
// (interleaved pairs).
inline void RopeRow(float* x, const int32_t* positions, int64_t r, int64_t num_heads,
                    int64_t head_dim, const float* inv_freq, int64_t row_floats, float* cos_v,
                    float* sin_v) {
    const int64_t half = head_dim / 2;
    // Angle in float, as llama2.c and HF transformers compute it.
    const float pos = static_cast<float>(positions[r]);
    for (int64_t i = 0; i < half; ++i) {
        const float angle = pos * inv_freq[i];
        cos_v[i] = std::cos(angle);
        sin_v[i] = std::sin(angle);
    }
    float* xr = x + r * row_floats;
    for (int64_t h = 0; h < num_heads; ++h) {
        float* v = xr + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float a = v[2 * i];
            const float b = v[2 * i + 1];
            v[2 * i] = a * cos_v[i] - b * sin_v[i];
            v[2 * i + 1] = a * sin_v[i] + b * cos_v[i];
        }
    }
}

}  // namespace

void SetNumThreads(int num_threads) {
    if (num_threads <= 0) return;
    // The matrix products call BLAS from inside their OpenMP team, one BLAS thread each
    // (kernels/cpu_matmul.cc); BLAS's own pool would fight the team for the cores.
    openblas_set_num_threads(1);
    omp_set_num_threads(num_threads);
}

int NumThreads() { return omp_get_max_threads(); }

void SetThisThreadNumThreads(int num_threads) {
    if (num_threads > 0) omp_set_num_threads(num_threads);
}

void SetBlasNumThreads(int num_threads) {
    if (num_threads > 0) openblas_set_num_threads(num_threads);
}

int BlasNumThreads() { return openblas_get_num_threads(); }

std::string BlasCoreName() {
    const char* name = openblas_get_corename();
    return name != nullptr ? name : "";
}

std::string SuggestedBlasCoreType() {
    const std::string core = BlasCoreName();
    const auto is_one_of = [&core](std::initializer_list<std::string_view> names) {
        return std::find(names.begin(), names.end(), core) != names.end();
    };
    // Kernel sets at least as good as the suggestion (OpenBLAS spells some in lower case).
    const bool has_avx512 = is_one_of({"SkylakeX", "Skylakex", "skylakex", "Cooperlake",
                                       "cooperlake", "SapphireRapids", "sapphirerapids"});
    const bool has_avx2 =
        has_avx512 || is_one_of({"Haswell", "haswell", "Zen", "zen", "Skylake", "skylake"});
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && !has_avx512) {
        return "SkylakeX";
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !has_avx2) {
        return "Haswell";
    }
    return "";
}

void MatMulWT(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k,
              bool accumulate) {
    constexpr int64_t kMaxBlasInt = std::numeric_limits<blasint>::max();
    KV_CHECK(m >= 0 && n >= 0 && k >= 0 && m <= kMaxBlasInt && n <= kMaxBlasInt && k <= kMaxBlasInt)
        << "m=" << m << " n=" << n << " k=" << k;
    if (m == 0 || n == 0) return;
    const float beta = accumulate ? 1.0f : 0.0f;
    if (m == 1) {
        // y[n] = w[n, k] · x[k]: a matrix-vector product, which sgemm handles less well.
        cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(k),
                    1.0f, w, static_cast<blasint>(k), x, 1, beta, y, 1);
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
                static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, x, static_cast<blasint>(k),
                w, static_cast<blasint>(k), beta, y, static_cast<blasint>(n));
}

void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim,
             float eps) {
    ForRows(rows, rows * dim >= kMinParallelFloats && rows > 1, [&](int64_t r) {
        const float* xr = x + r * dim;
        float* outr = out + r * dim;
        const float ss = Dot(xr, xr, dim);
        const float scale = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) outr[i] = xr[i] * scale * weight[i];
    });
}

void AddRmsNorm(float* residual, const float* delta, const float* weight, float* out, int64_t rows,
                int64_t dim, float eps) {
    ForRows(rows, rows * dim >= kMinParallelFloats && rows > 1, [&](int64_t r) {
        float* xr = residual + r * dim;
        const float* dr = delta + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) xr[i] += dr[i];
        const float ss = Dot(xr, xr, dim);
        const float scale = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
        float* outr = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) outr[i] = xr[i] * scale * weight[i];
    });
}

void SiluMulFused(const float* gate_up, float* out, int64_t rows, int64_t dim) {
    ForRows(rows, rows * dim >= kMinParallelFloats / 8 && rows > 1, [&](int64_t r) {
        const float* g = gate_up + r * 2 * dim;
        const float* u = g + dim;
        float* o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) o[i] = g[i] / (1.0f + ExpFast(-g[i])) * u[i];
    });
}

void GeluTanhMulFused(const float* gate_up, float* out, int64_t rows, int64_t dim) {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    ForRows(rows, rows * dim >= kMinParallelFloats / 8 && rows > 1, [&](int64_t r) {
        const float* g = gate_up + r * 2 * dim;
        const float* u = g + dim;
        float* o = out + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
            const float x = g[i];
            const float inner = kSqrt2OverPi * (x + 0.044715f * x * x * x);
            o[i] = 0.5f * x * (1.0f + std::tanh(inner)) * u[i];
        }
    });
}

void AddBias(float* x, const float* bias, int64_t rows, int64_t dim) {
    ForRows(rows, rows * dim >= kMinParallelFloats && rows > 1, [&](int64_t r) {
        float* xr = x + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) xr[i] += bias[i];
    });
}

void HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads, int64_t head_dim,
                 const float* weight, float eps) {
    ForRows(rows, rows * num_heads * head_dim >= kMinParallelFloats && rows > 1, [&](int64_t r) {
        for (int64_t h = 0; h < num_heads; ++h) {
            float* xh = x + r * row_stride + h * head_dim;
            const float ss = Dot(xh, xh, head_dim);
            const float scale = 1.0f / std::sqrt(ss / static_cast<float>(head_dim) + eps);
#pragma omp simd
            for (int64_t i = 0; i < head_dim; ++i) xh[i] = xh[i] * scale * weight[i];
        }
    });
}

void Scale(float* x, float s, int64_t n) {
    if (n >= kMinParallelFloats) {
#pragma omp parallel for simd
        for (int64_t i = 0; i < n; ++i) x[i] *= s;
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) x[i] *= s;
    }
}

void Rope(float* x, const int32_t* positions, int64_t rows, int64_t num_heads, int64_t head_dim,
          const float* inv_freq, int64_t row_stride) {
    KV_CHECK_EQ(head_dim % 2, 0);
    const int64_t half = head_dim / 2;
    const int64_t row_floats = row_stride > 0 ? row_stride : num_heads * head_dim;
    // A row costs head_dim/2 cos/sin pairs (~1 µs at head_dim 64) plus its rotations.
    if (rows >= 32) {
#pragma omp parallel
        {
            // cos and sin of one position, shared by all heads of its row.
            std::vector<float> cos_sin(static_cast<size_t>(2 * half));
#pragma omp for
            for (int64_t r = 0; r < rows; ++r) {
                RopeRow(x, positions, r, num_heads, head_dim, inv_freq, row_floats,
                        cos_sin.data(), cos_sin.data() + half);
            }
        }
        return;
    }
    // A few rows (decode): on this thread, with the cos/sin on its stack up to head_dim 512.
    constexpr int64_t kStackHalf = 256;
    float stack[2 * kStackHalf];
    std::vector<float> heap(half > kStackHalf ? static_cast<size_t>(2 * half) : 0);
    float* cos_sin = half > kStackHalf ? heap.data() : stack;
    for (int64_t r = 0; r < rows; ++r) {
        RopeRow(x, positions, r, num_heads, head_dim, inv_freq, row_floats, cos_sin,
                cos_sin + half);
    }
}

void SiluMul(const float* gate, const float* up, float* out, int64_t rows, int64_t dim) {
    const int64_t n = rows * dim;
    if (n >= kMinParallelFloats / 8) {
#pragma omp parallel for simd
        for (int64_t i = 0; i < n; ++i) {
            const float g = gate[i];
            out[i] = g / (1.0f + ExpFast(-g)) * up[i];
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float g = gate[i];
            out[i] = g / (1.0f + ExpFast(-g)) * up[i];
        }
    }
}

void Softmax(float* x, int64_t n) {
    // The same arithmetic, in the same order, as llama2.c's softmax (glibc expf, a sequential
    // float sum, a division per element), for bit-level comparisons with it. Attention uses its
    // own vectorized softmax.
    if (n <= 0) return;
    float max_val = x[0];
    for (int64_t i = 1; i < n; ++i) max_val = std::max(max_val, x[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        x[i] = std::exp(x[i] - max_val);
        sum += x[i];
    }
    for (int64_t i = 0; i < n; ++i) x[i] /= sum;
}

void Add(const float* x, const float* y, float* out, int64_t n) {
    if (n >= kMinParallelFloats) {
#pragma omp parallel for simd
        for (int64_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
    }
}

void RopeInvFreq(int64_t head_dim, float theta, const RopeScalingParams& scaling, float* inv_freq) {
    KV_CHECK(head_dim > 0 && head_dim % 2 == 0) << "head_dim=" << head_dim;
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        inv_freq[i] =
            1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
    }
    switch (scaling.type) {
        case RopeScalingParams::kNone:
            return;
        case RopeScalingParams::kLinear:
            KV_CHECK_GT(scaling.factor, 0.0f);
            for (int64_t i = 0; i < half; ++i) inv_freq[i] /= scaling.factor;
            return;
        case RopeScalingParams::kLlama3: {
            KV_CHECK_GT(scaling.factor, 0.0f);
            KV_CHECK_GT(scaling.high_freq_factor, scaling.low_freq_factor);
            const double orig = static_cast<double>(scaling.original_max_position);
            const double factor = scaling.factor;
            const double low = scaling.low_freq_factor;
            const double high = scaling.high_freq_factor;
            const double low_freq_wavelen = orig / low;    // longer than this: fully scaled
            const double high_freq_wavelen = orig / high;  // shorter than this: kept
            for (int64_t i = 0; i < half; ++i) {
                const double freq = inv_freq[i];
                const double wavelen = 2.0 * std::numbers::pi / freq;
                double scaled;
                if (wavelen < high_freq_wavelen) {
                    scaled = freq;
                } else if (wavelen > low_freq_wavelen) {
                    scaled = freq / factor;
                } else {
                    const double smooth = (orig / wavelen - low) / (high - low);
                    scaled = (1.0 - smooth) * freq / factor + smooth * freq;
                }
                inv_freq[i] = static_cast<float>(scaled);
            }
            return;
        }
    }
    KV_CHECK(false) << "unknown RoPE scaling type " << scaling.type;
}

}  // namespace kvshard::cpu
