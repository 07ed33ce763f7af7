// Helpers shared by the tests that need a CUDA device (KVSHARD_WITH_CUDA builds only).
#pragma once

#include <cuda_runtime.h>

namespace kvshard::testing {

// How many CUDA devices are visible: 0 when there is no driver or no device (the error is
// cleared, so later CUDA calls do not see it).
inline int CudaDevices() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count;
}

}  // namespace kvshard::testing
