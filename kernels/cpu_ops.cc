// CPU ops: BLAS for the matmuls, OpenMP across heads for attention, plain loops the compiler
// vectorizes (-O3 -march=native, `omp simd` where a float reduction would otherwise stay scalar)
// for everything else.
#include "kernels/cpu_ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "common/check.h"

namespace kvshard::cpu {
namespace {

// Below this many floats of work an OpenMP team costs more than it saves.
constexpr int64_t kMinParallelFloats = 1 << 15;

float Dot(const float* a, const float* b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

// y += alpha * x over n floats.
void Axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

void SetNumThreads(int num_threads) {
    if (num_threads <= 0) return;
    openblas_set_num_threads(num_threads);
    omp_set_num_threads(num_threads);
}

int NumThreads() { return omp_get_max_threads(); }

void MatMulWT(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k,
              bool accumulate) {
    KV_CHECK(m >= 0 && n >= 0 && k >= 0) << "m=" << m << " n=" << n << " k=" << k;
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
#pragma omp parallel for if (rows * dim >= kMinParallelFloats && rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * dim;
        float* outr = out + r * dim;
        const float ss = Dot(xr, xr, dim);
        const float scale = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) outr[i] = xr[i] * scale * weight[i];
    }
}

void Rope(float* x, const int32_t* positions, int64_t rows, int64_t num_heads, int64_t head_dim,
          const float* inv_freq) {
    KV_CHECK_EQ(head_dim % 2, 0);
    const int64_t half = head_dim / 2;
    const int64_t row_floats = num_heads * head_dim;
#pragma omp parallel if (rows * row_floats >= kMinParallelFloats && rows > 1)
    {
        // cos and sin of one position, shared by all heads of its row.
        std::vector<float> cos_sin(2 * half);
        float* cos_v = cos_sin.data();
        float* sin_v = cos_sin.data() + half;
#pragma omp for
        for (int64_t r = 0; r < rows; ++r) {
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
    }
}

void SiluMul(const float* gate, const float* up, float* out, int64_t rows, int64_t dim) {
    const int64_t n = rows * dim;
#pragma omp parallel for simd if (n >= kMinParallelFloats)
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        out[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
}

void Softmax(float* x, int64_t n) {
    // The same arithmetic, in the same order, as llama2.c's softmax: the sampler's golden tests
    // depend on it.
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

void Attention(const float* q, const float* k, const float* v, float* out, int64_t num_q,
               int64_t q_pos0, int64_t num_kv, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, int64_t kv_stride) {
    KV_CHECK_LE(q_pos0 + num_q, num_kv);
    KV_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0)
        << "num_heads=" << num_heads << " num_kv_heads=" << num_kv_heads;
    KV_CHECK_GE(kv_stride, num_kv_heads * head_dim);
    const int64_t group = num_heads / num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
    const int64_t num_tasks = num_heads * num_q;
    const bool parallel = num_tasks > 1 && num_tasks * (q_pos0 + num_q) * head_dim >= 4096;
#pragma omp parallel if (parallel)
    {
        // Scores of one query row; a row attends to at most num_kv positions.
        std::vector<float> scores(static_cast<size_t>(num_kv));
        // Rows attend to different numbers of positions (causal), hence dynamic scheduling.
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; ++task) {
            const int64_t h = task % num_heads;
            const int64_t i = task / num_heads;
            const int64_t kv_head_offset = (h / group) * head_dim;
            const float* qv = q + (i * num_heads + h) * head_dim;
            const int64_t len = q_pos0 + i + 1;
            for (int64_t t = 0; t < len; ++t) {
                scores[t] = Dot(qv, k + t * kv_stride + kv_head_offset, head_dim) * scale;
            }
            Softmax(scores.data(), len);
            float* o = out + (i * num_heads + h) * head_dim;
            std::fill(o, o + head_dim, 0.0f);
            for (int64_t t = 0; t < len; ++t) {
                Axpy(scores[t], v + t * kv_stride + kv_head_offset, o, head_dim);
            }
        }
    }
}

void Add(const float* x, const float* y, float* out, int64_t n) {
#pragma omp parallel for simd if (n >= 4 * kMinParallelFloats)
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

void RopeInvFreq(int64_t head_dim, float theta, const RopeScalingParams& scaling,
                 float* inv_freq) {
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
