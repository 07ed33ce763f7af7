// The CPU backend's decode copies (CpuBackend::PackForDecode) share chunks advised for huge pages:
// copies smaller than a huge page (a SmolLM2 layer's 0.2-1.1 MB) sit side by side in one advised
// mapping instead of each in 4 KiB pages, multiply as a copy of their own would, and the chunk
// goes when its last copy does (a later copy starts a new chunk). The advice is read back from
// the VmFlags of /proc/self/smaps ("hg"), as in cpu_backend_memory_test.cc.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/backend.h"
#include "kernels/cpu_matmul.h"
#include "tests/kernels/huge_pages_test_util.h"

namespace kvshard {
namespace {

// A Q4_1 matrix of random blocks.
std::vector<uint8_t> RandomQ41(int64_t rows, int64_t cols, uint32_t seed) {
    std::vector<uint8_t> bytes(RowBytes(DType::kQ4_1, cols) * static_cast<size_t>(rows));
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> scale(0.002f, 0.05f);
    std::uniform_int_distribution<int> byte(0, 255);
    for (size_t at = 0; at < bytes.size(); at += BlockBytes(DType::kQ4_1)) {
        const uint16_t d = FloatToHalf(scale(gen));
        const uint16_t m = FloatToHalf(-scale(gen));
        std::memcpy(&bytes[at], &d, 2);
        std::memcpy(&bytes[at + 2], &m, 2);
        for (size_t i = 4; i < BlockBytes(DType::kQ4_1); ++i) bytes[at + i] = uint8_t(byte(gen));
    }
    return bytes;
}

TEST(CpuBackendDecodeArena, SmallCopiesShareAHugePageChunkAndMultiplyAsTheirOwnCopy) {
    Result<std::unique_ptr<Backend>> made = MakeBackend(BackendConfig{.kind = BackendKind::kCpu});
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    Backend& b = **made;
    auto* packer = dynamic_cast<DecodeWeightPacker*>(&b);
    ASSERT_NE(packer, nullptr);
    constexpr int64_t kRows = 576;
    constexpr int64_t kCols = 576;  // 207 KB of Q4_1: a tenth of a huge page
    const std::vector<uint8_t> a = RandomQ41(kRows, kCols, 1);
    const std::vector<uint8_t> c = RandomQ41(kRows, kCols, 2);
    WeightView wa{.dtype = DType::kQ4_1, .data = a.data(), .rows = kRows, .cols = kCols};
    WeightView wc{.dtype = DType::kQ4_1, .data = c.data(), .rows = kRows, .cols = kCols};
    Result<BackendBuffer> copy_a = packer->PackForDecode(&wa);
    Result<BackendBuffer> copy_c = packer->PackForDecode(&wc);
    ASSERT_TRUE(copy_a.ok() && copy_c.ok());
    if (copy_a->data() == nullptr) GTEST_SKIP() << "no interleaved copies on this CPU";
    const cpu::StoredMatrix stored_a{.dtype = DType::kQ4_1, .data = a.data(), .rows = kRows,
                                     .cols = kCols};
    ASSERT_EQ(copy_a->bytes(), cpu::InterleavedBytes(stored_a));
    // Side by side in one chunk, 64-byte aligned, not overlapping.
    const auto pa = reinterpret_cast<uintptr_t>(copy_a->data());
    const auto pc = reinterpret_cast<uintptr_t>(copy_c->data());
    EXPECT_EQ(pa % 64, 0u);
    EXPECT_EQ(pc, pa + (copy_a->bytes() + 63) / 64 * 64);
    if (KernelHasTransparentHugePages()) {
        EXPECT_EQ(AdvisedHuge(copy_a->data()), true);
        EXPECT_EQ(AdvisedHuge(copy_c->As<uint8_t>() + copy_c->bytes() - 1), true);
    }
    // The arena copy multiplies as a copy in its own vector does, bit for bit.
    std::vector<uint8_t> own(cpu::InterleavedBytes(stored_a));
    cpu::InterleaveRows(stored_a, own.data());
    ASSERT_EQ(std::memcmp(own.data(), copy_a->data(), own.size()), 0);
    std::vector<float> x(kCols);
    std::mt19937 gen(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : x) v = normal(gen);
    std::vector<float> y_arena(kRows), y_own(kRows);
    b.MatMul(x.data(), 1, wa, y_arena.data());
    cpu::StoredMatrix with_own = stored_a;
    with_own.interleaved = own.data();
    cpu::MatMulStored(x.data(), 1, with_own, y_own.data());
    EXPECT_EQ(std::memcmp(y_arena.data(), y_own.data(), y_own.size() * sizeof(float)), 0);
    // The chunk is freed with its last copy: a copy made after both are gone starts a chunk of
    // its own (2 MiB-aligned), not the old chunk's next free byte.
    *copy_a = BackendBuffer();
    *copy_c = BackendBuffer();
    Result<BackendBuffer> again = packer->PackForDecode(&wa);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(again->data()) % (size_t{2} << 20), 0u);
}

}  // namespace
}  // namespace kvshard
