// MatMulStored and EmbeddingRows on Q5_0, Q5_1 and K-quant weights (kernels/cpu_matmul.h): the
// product in the stored format equals x · dequantize(W)^T in double precision, at the decode
// (tiled) and prefill (panel + sgemm) sizes, under every kernel ISA the CPU has.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_matmul.h"
#include "tests/kernels/quant_scale_offsets.h"

namespace kvshard::cpu {
namespace {

using test::HalfScaleOffsets;

// Random blocks of `dtype` with small finite scales, at byte 3 of the buffer (unaligned).
struct RandomMatrix {
    RandomMatrix(DType dtype, int64_t rows, int64_t cols, uint32_t seed)
        : dtype(dtype), rows(rows), cols(cols) {
        std::mt19937 gen(seed);
        std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
        const size_t bytes = static_cast<size_t>(rows) * RowBytes(dtype, cols);
        buffer.resize(bytes + 3);
        for (auto& b : buffer) b = static_cast<uint8_t>(gen());
        const size_t block_bytes = BlockBytes(dtype);
        for (size_t at = 0; at < bytes; at += block_bytes) {
            uint8_t* blk = buffer.data() + 3 + at;
            if (dtype == DType::kQ8_K) {
                const float d = scale(gen);
                std::memcpy(blk, &d, 4);
            }
            for (size_t off : HalfScaleOffsets(dtype)) {
                const uint16_t h = FloatToHalf(scale(gen));
                std::memcpy(blk + off, &h, 2);
            }
        }
    }
    StoredMatrix matrix() const { return {dtype, buffer.data() + 3, rows, cols}; }
    std::vector<float> Dequantized() const {
        std::vector<float> out(static_cast<size_t>(rows * cols));
        const size_t rb = RowBytes(dtype, cols);
        for (int64_t r = 0; r < rows; ++r) {
            DequantizeRow(dtype, buffer.data() + 3 + r * rb, cols, out.data() + r * cols);
        }
        return out;
    }

    DType dtype;
    int64_t rows;
    int64_t cols;
    std::vector<uint8_t> buffer;
};

struct IsaScope {
    explicit IsaScope(KernelIsa isa) { ForceKernelIsa(isa); }
    ~IsaScope() { ResetKernelIsa(); }
};

class KQuantMatMulTest : public ::testing::TestWithParam<DType> {};

TEST_P(KQuantMatMulTest, MatchesTheDequantizedReference) {
    const DType dtype = GetParam();
    const int64_t k = BlockElements(dtype) == 256 ? 768 : 576;
    const int64_t n = 70;  // not a multiple of the kernels' chunks
    const RandomMatrix w(dtype, n, k, 17);
    const std::vector<float> wf = w.Dequantized();
    for (int64_t m : {1, 5, 64}) {  // 64 > the tiled limit: the panel + sgemm path
        std::mt19937 gen(static_cast<uint32_t>(m));
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::vector<float> x(static_cast<size_t>(m * k));
        for (float& v : x) v = u(gen);
        std::vector<double> want(static_cast<size_t>(m * n));
        double scale = 0;
        for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < n; ++j) {
                double s = 0;
                double a = 0;
                for (int64_t c = 0; c < k; ++c) {
                    s += static_cast<double>(x[i * k + c]) * wf[j * k + c];
                    a += std::fabs(static_cast<double>(x[i * k + c]) * wf[j * k + c]);
                }
                want[i * n + j] = s;
                scale = std::max(scale, a);
            }
        }
        ASSERT_GT(scale, 0.0);
        for (KernelIsa isa : {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
            const IsaScope scope(isa);
            if (ActiveKernelIsa() != isa) continue;
            std::vector<float> y(static_cast<size_t>(m * n), std::nanf(""));
            MatMulStored(x.data(), m, w.matrix(), y.data());
            for (int64_t i = 0; i < m * n; ++i) {
                ASSERT_NEAR(y[i], want[i], 1e-5 * scale)
                    << DTypeName(dtype) << " " << KernelIsaName(isa) << " m=" << m << " at " << i;
            }
        }
    }
}

TEST_P(KQuantMatMulTest, EmbeddingRowsAreTheDequantizedRows) {
    const DType dtype = GetParam();
    const int64_t cols = BlockElements(dtype) == 256 ? 512 : 96;
    const RandomMatrix table(dtype, 12, cols, 5);
    const std::vector<float> wf = table.Dequantized();
    const std::vector<int32_t> ids = {0, 11, 3, 20, -1};
    for (KernelIsa isa : {KernelIsa::kPortable, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
        const IsaScope scope(isa);
        if (ActiveKernelIsa() != isa) continue;
        std::vector<float> out(ids.size() * cols, std::nanf(""));
        EmbeddingRows(table.matrix(), 0, ids.data(), static_cast<int64_t>(ids.size()), out.data());
        for (size_t i = 0; i < ids.size(); ++i) {
            for (int64_t c = 0; c < cols; ++c) {
                const float want = ids[i] >= 0 && ids[i] < 12 ? wf[ids[i] * cols + c] : 0.0f;
                ASSERT_EQ(out[i * cols + c], want) << KernelIsaName(isa) << " id " << ids[i];
            }
        }
    }
}

INSTANTIATE_TEST_SUITE_P(QuantTypes, KQuantMatMulTest,
                         ::testing::Values(DType::kQ5_0, DType::kQ5_1, DType::kQ2_K, DType::kQ3_K,
                                           DType::kQ4_K, DType::kQ5_K, DType::kQ6_K, DType::kQ8_K),
                         [](const ::testing::TestParamInfo<DType>& info) {
                             return std::string(DTypeName(info.param));
                         });

}  // namespace
}  // namespace kvshard::cpu
