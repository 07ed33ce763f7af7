// Where the CPU backend puts its buffers: resident buffers (weights, KV pool) on transparent huge
// pages over their whole 2 MiB pages, scratch (the step workspace) on 4 KiB pages. Read back
// from the VmFlags of /proc/self/smaps ("hg": MADV_HUGEPAGE), which record the advice whether
// or not the kernel then finds huge pages to give.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/backend.h"
#include "tests/kernels/huge_pages_test_util.h"

namespace kvshard {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kHuge = 2 * kMiB;

std::unique_ptr<Backend> Cpu() {
    Result<std::unique_ptr<Backend>> b = MakeBackend(BackendConfig{.kind = BackendKind::kCpu});
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    return b.ok() ? std::move(*b) : nullptr;
}

TEST(CpuBackendMemory, ResidentBuffersAreAdvisedForHugePagesOverTheirWholeHugePages) {
    if (!KernelHasTransparentHugePages()) GTEST_SKIP() << "no transparent huge pages here";
    std::unique_ptr<Backend> b = Cpu();
    ASSERT_NE(b, nullptr);
    // 5 MiB: two whole huge pages, then a 1 MiB tail that a huge page would overshoot by 1 MiB.
    Result<BackendBuffer> buf = b->Allocate(5 * kMiB, Backend::BufferUse::kResident);
    ASSERT_TRUE(buf.ok()) << buf.status().ToString();
    const auto* p = buf->As<uint8_t>();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kHuge, 0u);
    EXPECT_EQ(AdvisedHuge(p), true);
    EXPECT_EQ(AdvisedHuge(p + 2 * kHuge - 1), true);
    EXPECT_EQ(AdvisedHuge(p + 2 * kHuge), false);  // the tail
    EXPECT_EQ(AdvisedHuge(p + 5 * kMiB - 1), false);
}

TEST(CpuBackendMemory, ScratchAndSmallBuffersKeepSmallPages) {
    std::unique_ptr<Backend> b = Cpu();
    ASSERT_NE(b, nullptr);
    Result<BackendBuffer> scratch = b->Allocate(8 * kMiB);  // kScratch by default
    ASSERT_TRUE(scratch.ok()) << scratch.status().ToString();
    EXPECT_EQ(AdvisedHuge(scratch->data()), false);
    EXPECT_EQ(AdvisedHuge(scratch->As<uint8_t>() + 8 * kMiB - 1), false);
    Result<BackendBuffer> small = b->Allocate(kHuge - 64, Backend::BufferUse::kResident);
    ASSERT_TRUE(small.ok()) << small.status().ToString();
    EXPECT_EQ(AdvisedHuge(small->data()), false);
}

}  // namespace
}  // namespace kvshard
