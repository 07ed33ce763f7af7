// CPU compute ops of the forward pass. fp32 activations and weights, row-major.
// These are the reference the CUDA ops (kernels/cuda_ops.h) are checked against.
// Thread-safety: ops are pure functions of their arguments; some use OpenMP/BLAS threads inside.
#pragma once

#include <cstdint>
#include <string>

namespace kvshard::cpu {

// Number of threads OpenMP loops use (0: leave the library's default); BLAS is set to one
// thread, since the matrix products call it from inside their OpenMP teams.
void SetNumThreads(int num_threads);
int NumThreads();
// The two halves of SetNumThreads, for the worker threads of a tensor-parallel group: OpenMP's
// team size is a setting of the calling thread (each rank thread takes its share of the cores),
// BLAS's thread count is one for the whole process. Non-positive values are ignored.
void SetThisThreadNumThreads(int num_threads);
void SetBlasNumThreads(int num_threads);
int BlasNumThreads();

// The kernel set OpenBLAS chose when it loaded (openblas_get_corename), e.g. "Haswell".
std::string BlasCoreName();

// OpenBLAS 0.3.21 (Debian 12) does not recognize some newer CPUs, or CPUs behind some
// hypervisors, and falls back to its SSE3 "Prescott" kernels: sgemm at m=64 runs at half speed.
// The environment variable OPENBLAS_CORETYPE, read only when the library loads, overrides the
// choice. Returns the value this CPU supports ("SkylakeX" with AVX-512, "Haswell" with AVX2 and
// FMA) when OpenBLAS chose a weaker kernel set, else "" (nothing to gain). A launcher sets the
// variable and re-executes itself, or a script exports it.
std::string SuggestedBlasCoreType();

// y[m, n] = x[m, k] · w[n, k]^T (w is a Linear weight {out_features, in_features}).
// When accumulate is true, y += x · w^T.
void MatMulWT(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k,
              bool accumulate = false);

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight, for `rows` rows of `dim`.
// out may equal x.
void RmsNorm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps);

// Rotary embedding on interleaved pairs (v[2i], v[2i+1]) of every head of every row, in place.
// x: rows of num_heads × head_dim floats, `row_stride` floats apart (0: dense rows; a larger
// stride rotates the leading heads of a fused QKV row); positions[r] is the position of row r.
// inv_freq has head_dim/2 entries (theta^(-2i/head_dim), already adjusted for RoPE scaling).
void Rope(float* x, const int32_t* positions, int64_t rows, int64_t num_heads, int64_t head_dim,
          const float* inv_freq, int64_t row_stride = 0);

// out[r, i] = silu(gate[r, i]) * up[r, i]. out may equal gate.
void SiluMul(const float* gate, const float* up, float* out, int64_t rows, int64_t dim);

// residual[r, :] += delta[r, :], then out[r, :] = RmsNorm(residual[r, :]) with the arithmetic of
// RmsNorm: the residual add of a layer fused with the next norm.
void AddRmsNorm(float* residual, const float* delta, const float* weight, float* out, int64_t rows,
                int64_t dim, float eps);

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, dim + i]: gate and up side by side in one row (the
// output of the fused gate|up projection).
void SiluMulFused(const float* gate_up, float* out, int64_t rows, int64_t dim);

// out[r, i] = gelu(gate_up[r, i]) * gate_up[r, dim + i] with the tanh approximation of GELU,
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): Gemma's GeGLU over the fused gate|up row.
void GeluTanhMulFused(const float* gate_up, float* out, int64_t rows, int64_t dim);

// x[r, :] += bias for `rows` rows of `dim` floats.
void AddBias(float* x, const float* bias, int64_t rows, int64_t dim);

// RmsNorm of each of the `num_heads` heads (head_dim floats, one weight of head_dim for all) that
// start every row of x, rows `row_stride` floats apart, in place: the q/k norms of Qwen 3 and
// Gemma 3 inside a fused QKV row.
void HeadRmsNorm(float* x, int64_t row_stride, int64_t rows, int64_t num_heads, int64_t head_dim,
                 const float* weight, float eps);

// x[i] *= s over n floats.
void Scale(float* x, float s, int64_t n);

// In-place softmax over n values.
void Softmax(float* x, int64_t n);

// Causal grouped-query attention of `num_q` query rows of one sequence against its KV.
// q: num_q × num_heads × head_dim, the query at row i sits at position q_pos0 + i.
// k, v: num_kv × num_kv_heads × head_dim for positions 0..num_kv-1 (row stride kv_stride floats).
// out: num_q × num_heads × head_dim. Query head h uses KV head kv_head_of_q[h] when the map is
// given (num_heads entries in [0, num_kv_heads): a tensor-parallel rank whose query heads do not
// split evenly into groups), else h / (num_heads / num_kv_heads) (REQUIRES: divisible).
// A query at position p attends to positions 0..p. REQUIRES: q_pos0 + num_q <= num_kv.
void Attention(const float* q, const float* k, const float* v, float* out, int64_t num_q,
               int64_t q_pos0, int64_t num_kv, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, int64_t kv_stride, const int32_t* kv_head_of_q = nullptr);

// out[r, :] = x[r, :] + y[r, :] over n floats.
void Add(const float* x, const float* y, float* out, int64_t n);

// RoPE frequency scaling (a plain copy of the model's rope_scaling; kernels do not see config/).
struct RopeScalingParams {
    enum Type : int { kNone = 0, kLinear = 1, kLlama3 = 2 };
    int type = kNone;
    float factor = 1.0f;  // linear and llama3: long wavelengths are stretched by this factor
    float low_freq_factor = 1.0f;          // llama3 only
    float high_freq_factor = 4.0f;         // llama3 only
    int64_t original_max_position = 8192;  // llama3 only: the pre-training context length
};

// inv_freq[i] = theta^(-2i/head_dim) for i < head_dim/2, then scaled:
//   linear: inv_freq / factor;
//   llama3 (Llama 3.1): with wavelen = 2π/inv_freq, keep it when wavelen < orig/high_freq_factor,
//   divide by factor when wavelen > orig/low_freq_factor, else interpolate linearly between the
//   two with smooth = (orig/wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor).
// The unscaled frequencies are computed in float exactly as llama2.c does.
// REQUIRES: head_dim even; factor > 0; for llama3 high_freq_factor > low_freq_factor.
void RopeInvFreq(int64_t head_dim, float theta, const RopeScalingParams& scaling, float* inv_freq);

}  // namespace kvshard::cpu
