// cuBLAS and cuBLASLt, opened with dlopen when the CUDA backend first needs them instead of linked
// into every kvshard binary. Loading libcublasLt costs ~210 MB of resident memory before main()
// runs (its initializers touch its kernel tables), which every kvshard process paid: a CPU-only
// `kvshard generate`, each worker process, `kvshard --version`. Linked lazily, only a process
// that creates a CUDA backend pays it.
//
// The entry points are those the backend calls, each with the type its header declares (so a
// call through the table is checked as a direct call would be), resolved by their real symbol
// names (cublas_v2.h maps cublasCreate to cublasCreate_v2 and the like). Private to kernels/cuda/.
//
// Thread-safety: LoadCublas may be called from any thread; the table never changes once loaded.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include "common/status.h"

namespace kvshard::cuda {

#define KVSHARD_CUBLAS_FUNCTIONS(X)                                              \
    X(cublasCreate)                                                              \
    X(cublasDestroy)                                                             \
    X(cublasSetStream) X(cublasSetMathMode) X(cublasSetWorkspace) X(cublasSgemm) \
        X(cublasGetStatusName) X(cublasGetStatusString)
#define KVSHARD_CUBLASLT_FUNCTIONS(X)                                                      \
    X(cublasLtCreate)                                                                      \
    X(cublasLtDestroy)                                                                     \
    X(cublasLtMatmul) X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy)             \
        X(cublasLtMatmulDescSetAttribute) X(cublasLtMatrixLayoutCreate)                    \
            X(cublasLtMatrixLayoutDestroy) X(cublasLtMatmulPreferenceCreate)               \
                X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute) \
                    X(cublasLtMatmulAlgoGetHeuristic)

struct CublasLibrary {
#define KVSHARD_CUBLAS_MEMBER(name) decltype(&::name) name = nullptr;
    KVSHARD_CUBLAS_FUNCTIONS(KVSHARD_CUBLAS_MEMBER)
    KVSHARD_CUBLASLT_FUNCTIONS(KVSHARD_CUBLAS_MEMBER)
#undef KVSHARD_CUBLAS_MEMBER
};

// Opens libcublas.so.<major> and libcublasLt.so.<major> of the toolkit kvshard was built with
// (the loader's search path first, then the build's toolkit folder) and resolves every entry
// point, once per process. Unavailable naming the library and what the loader said, or the
// missing symbol; the same answer on every later call.
Result<const CublasLibrary*> LoadCublas();

// The loaded table. REQUIRES: LoadCublas() succeeded (the CUDA backend loads it at creation);
// aborts naming the loader's error otherwise.
const CublasLibrary& Cublas();

}  // namespace kvshard::cuda
