// Where the fp16 scales of a Q5_0/Q5_1/K-quant block lie (common/dtype.h has the layouts), for
// the kernel tests that fill blocks with random quants and need the scales small and finite.
#pragma once

#include <cstddef>
#include <vector>

#include "common/dtype.h"

namespace kvshard::test {

// Byte offsets of the fp16 fields inside one block (Q8_K's d is an f32 at 0, not listed).
inline std::vector<size_t> HalfScaleOffsets(DType dtype) {
    switch (dtype) {
        case DType::kQ5_0:
            return {0};
        case DType::kQ5_1:
        case DType::kQ4_K:
        case DType::kQ5_K:
            return {0, 2};
        case DType::kQ2_K:
            return {80, 82};
        case DType::kQ3_K:
            return {108};
        case DType::kQ6_K:
            return {208};
        default:
            return {};
    }
}

}  // namespace kvshard::test
