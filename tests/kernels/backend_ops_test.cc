// One table of {op, shapes, dtype}, run on every backend this build and machine have, each
// compared with a plain double-precision reference written here under a normalized error bound
// (max |got - want| / max |want|), as llama.cpp's test-backend-ops does. The CPU backend is also
// run with its kernels pinned to AVX2 (a CPU without AVX-512) and to the portable ISA (the
// fallback a CPU without AVX takes). The CUDA backend adds its rows by being constructible
// (MakeBackend).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/backend.h"
#include "kernels/cpu_matmul.h"
#include "kernels/paged_attention.h"

namespace kvshard {
namespace {

struct BackendCase {
    std::string name;
    BackendConfig config;
    // The CPU kernels pinned to this ISA (or the best the machine has below it); none: detected.
    std::optional<cpu::KernelIsa> isa;
};

std::vector<BackendCase> Backends() {
    return {{"cpu", {.kind = BackendKind::kCpu}, std::nullopt},
            {"cpu_avx2", {.kind = BackendKind::kCpu}, cpu::KernelIsa::kAvx2},
            {"cpu_portable", {.kind = BackendKind::kCpu}, cpu::KernelIsa::kPortable},
            {"cuda", {.kind = BackendKind::kCuda}, std::nullopt}};
}

// Host vectors moved to and from backend memory.
class Device {
  public:
    explicit Device(Backend& b) : b_(b) {}
    template <typename T>
    T* Put(const std::vector<T>& host) {
        Result<BackendBuffer> buf = b_.Allocate(std::max<size_t>(1, host.size() * sizeof(T)));
        KV_CHECK(buf.ok()) << buf.status().ToString();
        KV_CHECK(b_.CopyToDevice(buf->data(), host.data(), host.size() * sizeof(T)).ok());
        buffers_.push_back(std::move(*buf));
        return buffers_.back().As<T>();
    }
    template <typename T>
    std::vector<T> Get(const T* dev, size_t n) {
        std::vector<T> out(n);
        KV_CHECK(b_.CopyToHost(out.data(), dev, n * sizeof(T)).ok());
        KV_CHECK(b_.Synchronize().ok());
        return out;
    }

  private:
    Backend& b_;
    std::vector<BackendBuffer> buffers_;
};

double NormalizedError(const std::vector<float>& got, const std::vector<double>& want) {
    EXPECT_EQ(got.size(), want.size());
    double max_diff = 0, max_ref = 1e-30;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
        max_diff = std::max(max_diff, std::fabs(double(got[i]) - want[i]));
        max_ref = std::max(max_ref, std::fabs(want[i]));
    }
    return max_diff / max_ref;
}

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return v;
}

// Rows of `cols` elements in `dtype` with random contents (finite scales).
std::vector<uint8_t> RandomStored(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> bytes(RowBytes(dtype, cols) * static_cast<size_t>(rows));
    auto put16 = [&](size_t at, uint16_t v) { std::memcpy(&bytes[at], &v, 2); };
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const size_t block = BlockBytes(dtype);
    for (size_t at = 0; at < bytes.size(); at += block) {
        switch (dtype) {
            case DType::kF32: {
                const float f = u(rng);
                std::memcpy(&bytes[at], &f, 4);
                break;
            }
            case DType::kF16:
                put16(at, FloatToHalf(u(rng)));
                break;
            case DType::kBF16:
                put16(at, FloatToBF16(u(rng)));
                break;
            case DType::kQ8_0:
            case DType::kQ4_0:
            case DType::kQ4_1: {
                for (size_t i = 0; i < block; ++i) bytes[at + i] = uint8_t(rng());
                put16(at, FloatToHalf(0.01f + 0.05f * std::fabs(u(rng))));
                if (dtype == DType::kQ4_1) put16(at + 2, FloatToHalf(0.1f * u(rng)));
                break;
            }
            default: {
                // Q5_0/Q5_1, the K-quants: random quants and sub-block scales, finite fp16 scales.
                for (size_t i = 0; i < block; ++i) bytes[at + i] = uint8_t(rng());
                const size_t d_at = dtype == DType::kQ6_K ? 208 : 0;
                put16(at + d_at, FloatToHalf(0.01f + 0.05f * std::fabs(u(rng))));
                if (dtype == DType::kQ5_1 || dtype == DType::kQ4_K || dtype == DType::kQ5_K) {
                    put16(at + 2, FloatToHalf(dtype == DType::kQ5_1 ? 0.1f * u(rng)
                                                                    : 0.01f * std::fabs(u(rng))));
                }
                break;
            }
        }
    }
    return bytes;
}

std::vector<double> DequantizedRows(DType dtype, const std::vector<uint8_t>& bytes, int64_t rows,
                                    int64_t cols) {
    std::vector<float> f(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
        DequantizeRow(dtype, bytes.data() + r * RowBytes(dtype, cols), cols, &f[r * cols]);
    }
    return std::vector<double>(f.begin(), f.end());
}

class BackendOps : public ::testing::TestWithParam<BackendCase> {
  protected:
    void SetUp() override {
        Result<std::unique_ptr<Backend>> b = MakeBackend(GetParam().config);
        if (!b.ok()) GTEST_SKIP() << GetParam().name << ": " << b.status().message();
        backend_ = std::move(*b);
        if (GetParam().isa) cpu::ForceKernelIsa(*GetParam().isa);
    }
    void TearDown() override { cpu::ResetKernelIsa(); }
    std::unique_ptr<Backend> backend_;
};

struct MatMulRow {
    DType dtype;
    int64_t m, n, k;
};

TEST_P(BackendOps, MatMulAgainstTheDequantizedWeight) {
    const std::vector<MatMulRow> rows = {
        {DType::kF32, 1, 64, 128},    {DType::kF32, 70, 33, 64},   {DType::kF16, 1, 40, 96},
        {DType::kF16, 17, 40, 96},    {DType::kBF16, 3, 24, 64},   {DType::kBF16, 64, 24, 64},
        {DType::kQ8_0, 1, 960, 576},  {DType::kQ8_0, 16, 37, 128}, {DType::kQ8_0, 100, 64, 64},
        {DType::kQ4_0, 1, 50, 256},   {DType::kQ4_0, 9, 50, 256},  {DType::kQ4_1, 1, 960, 576},
        {DType::kQ4_1, 16, 3072, 64}, {DType::kQ4_1, 130, 48, 96}, {DType::kQ5_0, 1, 960, 576},
        {DType::kQ5_0, 9, 50, 64},    {DType::kQ5_1, 1, 70, 576},  {DType::kQ5_1, 100, 33, 96},
        {DType::kQ4_K, 1, 1536, 512}, {DType::kQ4_K, 7, 50, 256},  {DType::kQ4_K, 64, 48, 512},
        {DType::kQ5_K, 1, 70, 1536},  {DType::kQ5_K, 16, 37, 256}, {DType::kQ6_K, 1, 577, 768},
        {DType::kQ6_K, 5, 70, 256},   {DType::kQ6_K, 130, 24, 512}};
    for (const MatMulRow& r : rows) {
        Device dev(*backend_);
        const std::vector<uint8_t> w = RandomStored(r.dtype, r.n, r.k, 7);
        const std::vector<float> x = Random(static_cast<size_t>(r.m * r.k), 3);
        const WeightView view{.dtype = r.dtype, .data = dev.Put(w), .rows = r.n, .cols = r.k};
        float* y = dev.Put(std::vector<float>(static_cast<size_t>(r.m * r.n)));
        const float* xd = dev.Put(x);
        backend_->MatMul(xd, r.m, view, y);
        const std::vector<double> wd = DequantizedRows(r.dtype, w, r.n, r.k);
        std::vector<double> want(static_cast<size_t>(r.m * r.n));
        for (int64_t i = 0; i < r.m; ++i) {
            for (int64_t j = 0; j < r.n; ++j) {
                double s = 0;
                for (int64_t c = 0; c < r.k; ++c) s += double(x[i * r.k + c]) * wd[j * r.k + c];
                want[i * r.n + j] = s;
            }
        }
        // The CUDA backend multiplies non-F32 weights in bf16 (fp32 accumulation): bf16's
        // rounding of both operands bounds it; F32 weights take its pedantic fp32 path.
        const bool bf16 = backend_->kind() == BackendKind::kCuda && r.dtype != DType::kF32;
        EXPECT_LE(NormalizedError(dev.Get(y, want.size()), want), bf16 ? 1e-2 : 2e-5)
            << DTypeName(r.dtype) << " m=" << r.m << " n=" << r.n << " k=" << r.k;
        // Again with the backend's single-row copy of the weight, where it makes one.
        if (auto* packer = dynamic_cast<DecodeWeightPacker*>(backend_.get())) {
            WeightView packed = view;
            Result<BackendBuffer> copy = packer->PackForDecode(&packed);
            ASSERT_TRUE(copy.ok()) << copy.status().ToString();
            EXPECT_EQ(copy->data() != nullptr, packed.decode_copy != nullptr);
            backend_->MatMul(xd, r.m, packed, y);
            EXPECT_LE(NormalizedError(dev.Get(y, want.size()), want), 2e-5)
                << DTypeName(r.dtype) << " m=" << r.m << " n=" << r.n << " k=" << r.k
                << " with the decode copy";
        }
    }
}

TEST_P(BackendOps, EmbeddingOfAVocabularySlice) {
    for (DType dtype : {DType::kF32, DType::kF16, DType::kQ8_0, DType::kQ4_1}) {
        Device dev(*backend_);
        const int64_t rows = 20, cols = 64, offset = 10;
        const std::vector<uint8_t> table = RandomStored(dtype, rows, cols, 11);
        const std::vector<int32_t> ids = {10, 29, 3, 15, 30};  // 3 and 30 lie outside the slice
        float* out = dev.Put(std::vector<float>(ids.size() * cols));
        backend_->Embedding({.dtype = dtype, .data = dev.Put(table), .rows = rows, .cols = cols},
                            offset, dev.Put(ids), int64_t(ids.size()), out);
        const std::vector<double> t = DequantizedRows(dtype, table, rows, cols);
        std::vector<double> want(ids.size() * cols, 0.0);
        for (size_t i = 0; i < ids.size(); ++i) {
            const int64_t r = ids[i] - offset;
            if (r < 0 || r >= rows) continue;
            for (int64_t c = 0; c < cols; ++c) want[i * cols + c] = t[r * cols + c];
        }
        EXPECT_LE(NormalizedError(dev.Get(out, want.size()), want), 1e-7) << DTypeName(dtype);
    }
}

TEST_P(BackendOps, NormsRopeAndSiluMul) {
    Device dev(*backend_);
    const int64_t rows = 7, dim = 96;
    const float eps = 1e-5f;
    const std::vector<float> x = Random(rows * dim, 1), d = Random(rows * dim, 2),
                             w = Random(dim, 3);
    auto rms = [&](const std::vector<double>& v) {
        std::vector<double> out(v.size());
        for (int64_t r = 0; r < rows; ++r) {
            double ss = 0;
            for (int64_t i = 0; i < dim; ++i) ss += v[r * dim + i] * v[r * dim + i];
            const double s = 1.0 / std::sqrt(ss / dim + eps);
            for (int64_t i = 0; i < dim; ++i) out[r * dim + i] = v[r * dim + i] * s * w[i];
        }
        return out;
    };
    float* dw = dev.Put(w);
    {
        float* out = dev.Put(std::vector<float>(rows * dim));
        backend_->RmsNorm(dev.Put(x), dw, out, rows, dim, eps);
        EXPECT_LE(NormalizedError(dev.Get(out, rows * dim), rms({x.begin(), x.end()})), 1e-6);
    }
    {
        float* residual = dev.Put(x);
        float* out = dev.Put(std::vector<float>(rows * dim));
        backend_->AddRmsNorm(residual, dev.Put(d), dw, out, rows, dim, eps);
        std::vector<double> sum(rows * dim);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] = double(x[i]) + d[i];
        EXPECT_LE(NormalizedError(dev.Get(residual, sum.size()), sum), 1e-7) << "residual";
        EXPECT_LE(NormalizedError(dev.Get(out, sum.size()), rms(sum)), 1e-6) << "norm";
    }
    {
        // Strided RoPE: 3 heads of 32 at the start of rows of 160 floats; the rest untouched.
        const int64_t heads = 3, hd = 32, stride = 160;
        const std::vector<float> q = Random(rows * stride, 4);
        std::vector<int32_t> pos(rows);
        for (int64_t r = 0; r < rows; ++r) pos[r] = int32_t(r * 37 + 5);
        std::vector<float> inv(hd / 2);
        for (int64_t i = 0; i < hd / 2; ++i) inv[i] = std::pow(10000.0f, -2.0f * i / hd);
        float* dq = dev.Put(q);
        backend_->Rope(dq, stride, dev.Put(pos), rows, heads, hd, dev.Put(inv));
        std::vector<double> want(q.begin(), q.end());
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t h = 0; h < heads; ++h) {
                for (int64_t i = 0; i < hd / 2; ++i) {
                    const double a = double(float(pos[r]) * inv[i]);
                    double* v = &want[r * stride + h * hd + 2 * i];
                    const double x0 = v[0], x1 = v[1];
                    v[0] = x0 * std::cos(a) - x1 * std::sin(a);
                    v[1] = x0 * std::sin(a) + x1 * std::cos(a);
                }
            }
        }
        EXPECT_LE(NormalizedError(dev.Get(dq, q.size()), want), 2e-6) << "rope";
    }
    {
        const std::vector<float> gu = Random(rows * 2 * dim, 5, 4.0f);
        float* out = dev.Put(std::vector<float>(rows * dim));
        backend_->SiluMul(dev.Put(gu), rows, dim, out);
        std::vector<double> want(rows * dim);
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t i = 0; i < dim; ++i) {
                const double g = gu[r * 2 * dim + i];
                want[r * dim + i] = g / (1.0 + std::exp(-g)) * gu[r * 2 * dim + dim + i];
            }
        }
        EXPECT_LE(NormalizedError(dev.Get(out, want.size()), want), 1e-6) << "silu";
    }
}

// The ops of the architectures past Llama: GeGLU (Gemma), the fused QKV bias (Qwen 2), per-head
// q/k norms inside a strided row (Qwen 3, Gemma 3) and the embedding scale (Gemma).
TEST_P(BackendOps, GeluBiasHeadNormAndScale) {
    Device dev(*backend_);
    const int64_t rows = 5, dim = 80;
    {
        const std::vector<float> gu = Random(rows * 2 * dim, 11, 4.0f);
        float* out = dev.Put(std::vector<float>(rows * dim));
        backend_->GeluTanhMul(dev.Put(gu), rows, dim, out);
        std::vector<double> want(rows * dim);
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t i = 0; i < dim; ++i) {
                const double g = gu[r * 2 * dim + i];
                const double gelu =
                    0.5 * g * (1 + std::tanh(std::sqrt(2 / M_PI) * (g + 0.044715 * g * g * g)));
                want[r * dim + i] = gelu * gu[r * 2 * dim + dim + i];
            }
        }
        EXPECT_LE(NormalizedError(dev.Get(out, want.size()), want), 1e-6) << "gelu_tanh";
    }
    {
        const std::vector<float> x = Random(rows * dim, 12), b = Random(dim, 13);
        float* dx = dev.Put(x);
        backend_->AddBias(dx, dev.Put(b), rows, dim);
        std::vector<double> want(x.size());
        for (size_t i = 0; i < x.size(); ++i) want[i] = double(x[i]) + b[i % dim];
        EXPECT_LE(NormalizedError(dev.Get(dx, x.size()), want), 1e-7) << "bias";
    }
    {
        // 3 heads of 16 at offset 0 of rows of 80 floats; the rest of each row is untouched.
        const int64_t heads = 3, hd = 16;
        const float eps = 1e-6f;
        const std::vector<float> x = Random(rows * dim, 14), w = Random(hd, 15);
        float* dx = dev.Put(x);
        backend_->HeadRmsNorm(dx, dim, rows, heads, hd, dev.Put(w), eps);
        std::vector<double> want(x.begin(), x.end());
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t h = 0; h < heads; ++h) {
                double* v = &want[r * dim + h * hd];
                double ss = 0;
                for (int64_t i = 0; i < hd; ++i) ss += v[i] * v[i];
                const double s = 1.0 / std::sqrt(ss / hd + eps);
                for (int64_t i = 0; i < hd; ++i) v[i] = v[i] * s * w[i];
            }
        }
        EXPECT_LE(NormalizedError(dev.Get(dx, x.size()), want), 1e-6) << "head norm";
    }
    {
        const std::vector<float> x = Random(rows * dim, 16);
        float* dx = dev.Put(x);
        backend_->Scale(dx, 25.3f, rows * dim);
        std::vector<double> want(x.size());
        for (size_t i = 0; i < x.size(); ++i) want[i] = double(x[i]) * 25.3f;
        EXPECT_LE(NormalizedError(dev.Get(dx, x.size()), want), 1e-7) << "scale";
    }
}

// KV written at slots of scattered blocks, then the step's attention (a prefill chunk that
// starts mid-sequence, a decode row, a fresh prompt), against a double-precision causal softmax
// over the same K/V (unrounded), with and without a sliding window; then block copies and row
// gathers. Every storage but fp32 carries its rounding into the bound: bf16 keeps 8 significant
// bits (2^-9 relative), fp16 11 (2^-12), int8 about 1/127 of each head's range.
TEST_P(BackendOps, KvWriteAttentionCopiesAndGathers) {
    for (KvDtype storage : {KvDtype::kFp32, KvDtype::kInt8, KvDtype::kBf16, KvDtype::kFp16}) {
        Device dev(*backend_);
        const int64_t bs = 4, heads = 6, kv_heads = 2, hd = 16, layers = 2, num_blocks = 24;
        const int64_t layer_bytes = cpu::PagedLayerBytes(storage, bs, kv_heads, hd);
        const int64_t block_bytes = layers * layer_bytes;
        auto* pool = reinterpret_cast<uint8_t*>(
            dev.Put(std::vector<uint8_t>(static_cast<size_t>(num_blocks * block_bytes))));
        const PagedKvLayer kv =
            cpu::MakePagedKvLayer(pool, block_bytes, 1, storage, bs, kv_heads, hd);
        // Sequences: lengths after the step and new rows.
        const std::vector<int32_t> ctx = {11, 6, 3}, news = {5, 1, 3};
        const std::vector<std::vector<int32_t>> tables = {{7, 2, 19}, {0, 11}, {5}};
        const int64_t total_pos = 11 + 6 + 3;
        const int64_t kvw = kv_heads * hd;
        const std::vector<float> k = Random(total_pos * kvw, 8), v = Random(total_pos * kvw, 9);
        std::vector<int64_t> slots;
        for (size_t s = 0, r = 0; s < ctx.size(); ++s) {
            for (int32_t p = 0; p < ctx[s]; ++p, ++r) {
                slots.push_back(int64_t(tables[s][p / bs]) * bs + p % bs);
            }
        }
        backend_->KvWrite(kv, dev.Put(k), dev.Put(v), kvw, dev.Put(slots), total_pos);
        if (storage != KvDtype::kInt8) {
            // fp32 and the 16-bit storages are exact functions of each value: the pool holds the
            // bytes cpu::PagedKvWrite writes (round to nearest even), on every backend.
            std::vector<uint8_t> host(static_cast<size_t>(num_blocks * block_bytes), 0);
            const PagedKvLayer hkv =
                cpu::MakePagedKvLayer(host.data(), block_bytes, 1, storage, bs, kv_heads, hd);
            cpu::PagedKvWrite(hkv, k.data(), v.data(), kvw, slots.data(), total_pos);
            EXPECT_EQ(dev.Get(pool, host.size()), host) << "KV write " << KvDtypeName(storage);
        }
        // Queries of the new rows, at row stride 120 (a fused QKV row).
        const int64_t q_stride = 120, rows = 5 + 1 + 3;
        const std::vector<float> q = Random(rows * q_stride, 10);
        std::vector<int32_t> qs = {0}, ts = {0}, flat;
        for (size_t s = 0; s < ctx.size(); ++s) {
            qs.push_back(qs.back() + news[s]);
            flat.insert(flat.end(), tables[s].begin(), tables[s].end());
            ts.push_back(int32_t(flat.size()));
        }
        const std::vector<int32_t> kv_of_q = {0, 0, 0, 1, 1, 1};
        // Full causal attention, then a sliding window of 4 (a layer of a windowed model).
        float* out = nullptr;
        std::vector<double> want;
        for (int64_t window : {4, 0}) {
            if (window > 0 && !backend_->SupportsSlidingWindow()) continue;
            const PagedAttentionBatch batch{.num_seqs = 3,
                                            .query_starts = dev.Put(qs),
                                            .context_lens = dev.Put(ctx),
                                            .block_table_starts = dev.Put(ts),
                                            .block_tables = dev.Put(flat),
                                            .window = window};
            out = dev.Put(std::vector<float>(rows * heads * hd));
            backend_->PagedAttention(dev.Put(q), q_stride, kv, batch, out, heads,
                                     dev.Put(kv_of_q));
            want.assign(rows * heads * hd, 0.0);
            for (size_t s = 0, pos0 = 0; s < ctx.size(); pos0 += ctx[s], ++s) {
                for (int32_t i = 0; i < news[s]; ++i) {
                    const int64_t row = qs[s] + i, p = ctx[s] - news[s] + i;
                    const int64_t first = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
                    for (int64_t h = 0; h < heads; ++h) {
                        const int64_t g = kv_of_q[h];
                        std::vector<double> sc(p + 1 - first);
                        double mx = -1e300, sum = 0;
                        for (int64_t t = first; t <= p; ++t) {
                            double dot = 0;
                            for (int64_t c = 0; c < hd; ++c) {
                                dot += double(q[row * q_stride + h * hd + c]) *
                                       k[(pos0 + t) * kvw + g * hd + c];
                            }
                            sc[t - first] = dot / std::sqrt(double(hd));
                            mx = std::max(mx, sc[t - first]);
                        }
                        for (double& e : sc) sum += (e = std::exp(e - mx));
                        for (int64_t c = 0; c < hd; ++c) {
                            double o = 0;
                            for (int64_t t = first; t <= p; ++t)
                                o += sc[t - first] * v[(pos0 + t) * kvw + g * hd + c];
                            want[(row * heads + h) * hd + c] = o / sum;
                        }
                    }
                }
            }
            const double bound = storage == KvDtype::kFp32   ? 1e-5
                                 : storage == KvDtype::kFp16 ? 2e-3
                                 : storage == KvDtype::kBf16 ? 1e-2
                                                             : 2e-2;
            EXPECT_LE(NormalizedError(dev.Get(out, want.size()), want), bound)
                << "storage " << KvDtypeName(storage) << " window " << window;
        }

        // Block copies: block 7 -> 20 and 0 -> 21 carry every byte.
        const std::vector<int32_t> pairs = {7, 20, 0, 21};
        backend_->CopyBlocks(pool, block_bytes, dev.Put(pairs), 2);
        const std::vector<uint8_t> all = dev.Get(pool, size_t(num_blocks * block_bytes));
        EXPECT_EQ(0, std::memcmp(&all[20 * block_bytes], &all[7 * block_bytes], block_bytes));
        EXPECT_EQ(0, std::memcmp(&all[21 * block_bytes], &all[0 * block_bytes], block_bytes));

        // GatherRows: the last row of each sequence.
        const std::vector<int32_t> last = {4, 5, 8};
        float* gathered = dev.Put(std::vector<float>(3 * heads * hd));
        backend_->GatherRows(out, heads * hd, dev.Put(last), 3, gathered);
        const std::vector<float> o = dev.Get(out, want.size());
        const std::vector<float> g = dev.Get(gathered, 3 * heads * hd);
        for (int i = 0; i < 3; ++i) {
            EXPECT_EQ(0, std::memcmp(&g[i * heads * hd], &o[last[i] * heads * hd], heads * hd * 4));
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendOps, ::testing::ValuesIn(Backends()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kvshard
