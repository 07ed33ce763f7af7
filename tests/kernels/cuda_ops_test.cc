// CUDA ops against the CPU reference (kernels/cpu_ops.h). Suites carry "Gpu" in their names; tests
// that need a device skip without one, so the binary runs everywhere.
#include "common/build_config.h"

#if KVSHARD_WITH_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "kernels/cpu_ops.h"
#include "kernels/cuda_ops.h"

namespace kvshard::cuda {
namespace {

#define KV_REQUIRE_GPU()                                                          \
    do {                                                                          \
        if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine"; \
    } while (0)

std::vector<float> RandomVector(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(gen);
    return v;
}

// The device layer's calls (common/device.h) return a Status; here a failure is a broken test
// machine, not a result, so it stops the test binary with the error.
void Check(const Status& status) { KV_CHECK(status.ok()) << status.ToString(); }

DeviceBuffer Allocate(size_t bytes) {
    Result<DeviceBuffer> buffer = DeviceBuffer::Allocate(bytes);
    Check(buffer.status());
    return std::move(buffer).value();
}

DeviceBuffer Upload(const std::vector<float>& host) {
    DeviceBuffer buffer = Allocate(host.size() * sizeof(float));
    Check(buffer.CopyFromHost(host.data(), host.size() * sizeof(float)));
    return buffer;
}

std::vector<float> Download(const DeviceBuffer& buffer, size_t n) {
    std::vector<float> host(n);
    Check(buffer.CopyToHost(host.data(), n * sizeof(float)));
    return host;
}

// These run on every machine: they need the libraries, not a device (the device count itself is
// tested with the device layer, tests/common/device_test.cc).
TEST(NcclGpuTest, ReportsVersion) {
    const int version = NcclVersion();
    EXPECT_GE(version, 20000) << "NCCL 2.x encodes versions as major*10000 + minor*100 + patch";
}

TEST(NcclGpuTest, SingleRankAllReduceWithoutDeviceIsUnavailable) {
    if (DeviceCount() > 0) GTEST_SKIP() << "a device is present";
    std::vector<float> data = {1.0f, 2.0f};
    const Status status = AllReduceSumSingleRank(data.data(), 2);
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << status.ToString();
}

// RMSNorm: |gpu - cpu| <= 1e-5 · |cpu| (+1e-7 absolute for values near zero).
struct RmsNormCase {
    int64_t rows, dim;
};

class RmsNormGpuTest : public ::testing::TestWithParam<RmsNormCase> {};

TEST_P(RmsNormGpuTest, MatchesCpuWithin1e5Relative) {
    KV_REQUIRE_GPU();
    Check(SetDevice(0));
    const RmsNormCase c = GetParam();
    const auto x = RandomVector(c.rows * c.dim, 1, -3.0f, 3.0f);
    const auto weight = RandomVector(c.dim, 2, 0.5f, 1.5f);
    std::vector<float> want(x.size());
    cpu::RmsNorm(x.data(), weight.data(), want.data(), c.rows, c.dim, 1e-5f);

    DeviceBuffer dx = Upload(x), dw = Upload(weight);
    DeviceBuffer dout = Allocate(x.size() * sizeof(float));
    RmsNorm(dx.floats(), dw.floats(), dout.floats(), c.rows, c.dim, 1e-5f);
    Check(SynchronizeDevice());
    const auto got = Download(dout, x.size());
    for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-5f * std::abs(want[i]) + 1e-7f) << "at " << i;
    }
    // In place.
    RmsNorm(dx.floats(), dw.floats(), dx.floats(), c.rows, c.dim, 1e-5f);
    Check(SynchronizeDevice());
    EXPECT_EQ(Download(dx, x.size()), got);
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormGpuTest,
                         ::testing::Values(RmsNormCase{1, 1}, RmsNormCase{3, 33},
                                           RmsNormCase{7, 576}, RmsNormCase{64, 4096},
                                           RmsNormCase{2, 8192}));

// MatMulWT: |gpu - cpu| <= 1e-4 · Σ_l |x_l · w_l| (relative to the magnitude of the terms, so that
// sums that cancel to near zero are judged fairly).
struct MatMulCase {
    int64_t m, n, k;
    bool accumulate;
};

class MatMulWTGpuTest : public ::testing::TestWithParam<MatMulCase> {};

TEST_P(MatMulWTGpuTest, MatchesCpuWithin1e4Relative) {
    KV_REQUIRE_GPU();
    Check(SetDevice(0));
    const MatMulCase c = GetParam();
    const auto x = RandomVector(c.m * c.k, 3);
    const auto w = RandomVector(c.n * c.k, 4);
    const auto y0 = RandomVector(c.m * c.n, 5);
    std::vector<float> want = y0;
    cpu::MatMulWT(x.data(), w.data(), want.data(), c.m, c.n, c.k, c.accumulate);

    DeviceBuffer dx = Upload(x), dw = Upload(w), dy = Upload(y0);
    CublasHandle handle;
    MatMulWT(handle, dx.floats(), dw.floats(), dy.floats(), c.m, c.n, c.k, c.accumulate);
    Check(SynchronizeDevice());
    const auto got = Download(dy, want.size());
    for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
            double magnitude = c.accumulate ? std::abs(y0[i * c.n + j]) : 0.0;
            for (int64_t l = 0; l < c.k; ++l) {
                magnitude += std::abs(double{x[i * c.k + l]} * w[j * c.k + l]);
            }
            ASSERT_NEAR(got[i * c.n + j], want[i * c.n + j], 1e-4 * magnitude)
                << "(" << i << ", " << j << ")";
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MatMulWTGpuTest,
                         ::testing::Values(MatMulCase{1, 1, 1, false}, MatMulCase{7, 33, 17, false},
                                           MatMulCase{7, 33, 17, true},
                                           MatMulCase{1, 576, 1536, false},
                                           MatMulCase{64, 576, 1536, false},
                                           MatMulCase{64, 1536, 576, true}));

TEST(NcclGpuTest, SingleRankAllReduceReturnsTheInput) {
    KV_REQUIRE_GPU();
    const auto data = RandomVector(1000, 6);
    std::vector<float> reduced = data;
    const Status status = AllReduceSumSingleRank(reduced.data(), static_cast<int64_t>(data.size()));
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_EQ(reduced, data);  // the sum over one rank is the rank's own data
}

}  // namespace
}  // namespace kvshard::cuda

#endif  // KVSHARD_WITH_CUDA
