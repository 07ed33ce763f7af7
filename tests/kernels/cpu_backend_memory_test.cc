// Where the CPU backend puts its buffers: resident buffers (weights, KV pool) on transparent huge
// pages over their whole 2 MiB pages, scratch (the step workspace) on 4 KiB pages. Read back
// from the VmFlags of /proc/self/smaps ("hg": MADV_HUGEPAGE), which record the advice whether
// or not the kernel then finds huge pages to give.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "kernels/backend.h"

namespace kvshard {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kHuge = 2 * kMiB;

// Whether the mapping that holds `address` is advised for huge pages; nullopt if none holds it.
std::optional<bool> AdvisedHuge(const void* address) {
    const auto a = reinterpret_cast<uintptr_t>(address);
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    bool inside = false;
    while (std::getline(smaps, line)) {
        uintptr_t begin = 0, end = 0;
        char dash = 0;
        std::istringstream head(line);
        if (head >> std::hex >> begin >> dash >> end && dash == '-') {
            inside = a >= begin && a < end;
        } else if (inside && line.rfind("VmFlags:", 0) == 0) {
            return line.find(" hg") != std::string::npos;
        }
    }
    return std::nullopt;
}

bool KernelHasTransparentHugePages() {
    return ::access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0;
}

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
