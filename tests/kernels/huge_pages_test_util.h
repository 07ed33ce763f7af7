// What the CPU backend's memory tests read back from /proc: whether a mapping is advised for
// transparent huge pages (the "hg" VmFlag of /proc/self/smaps, which records MADV_HUGEPAGE whether
// or not the kernel then finds huge pages to give), and whether this kernel has them at all.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace kvshard {

// Whether the mapping that holds `address` is advised for huge pages; nullopt if none holds it.
inline std::optional<bool> AdvisedHuge(const void* address) {
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

inline bool KernelHasTransparentHugePages() {
    return ::access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0;
}

}  // namespace kvshard
