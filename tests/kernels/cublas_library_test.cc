// cuBLAS is opened at run time (kernels/cuda/cublas_library.h), not linked: every entry point the
// CUDA backend calls resolves from the toolkit's libraries, and a call through the table works.
// cuBLAS's status names need no device, so this runs on every CUDA build, GPU or not.
#include "common/build_config.h"

#if KVSHARD_WITH_CUDA

#include <gtest/gtest.h>

#include <string>

#include "kernels/cuda/cublas_library.h"

namespace kvshard::cuda {
namespace {

TEST(CublasLibrary, EveryEntryPointResolvesAndACallGoesThroughTheTable) {
    Result<const CublasLibrary*> lib = LoadCublas();
    ASSERT_TRUE(lib.ok()) << lib.status().ToString();
#define KVSHARD_EXPECT_RESOLVED(name) EXPECT_NE((*lib)->name, nullptr) << #name;
    KVSHARD_CUBLAS_FUNCTIONS(KVSHARD_EXPECT_RESOLVED)
    KVSHARD_CUBLASLT_FUNCTIONS(KVSHARD_EXPECT_RESOLVED)
#undef KVSHARD_EXPECT_RESOLVED
    EXPECT_EQ(std::string((*lib)->cublasGetStatusName(CUBLAS_STATUS_NOT_INITIALIZED)),
              "CUBLAS_STATUS_NOT_INITIALIZED");
    // Loaded once: the same table on every call.
    Result<const CublasLibrary*> again = LoadCublas();
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(*again, *lib);
    EXPECT_EQ(&Cublas(), *lib);
}

}  // namespace
}  // namespace kvshard::cuda

#endif  // KVSHARD_WITH_CUDA
