#include "kernels/cuda/cublas_library.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "common/check.h"

namespace kvshard::cuda {
namespace {

// After macro expansion, so that cublasCreate names the symbol cublasCreate_v2.
#define KVSHARD_STRINGIZE_EXPANDED(x) KVSHARD_STRINGIZE(x)
#define KVSHARD_STRINGIZE(x) #x

struct Loaded {
    CublasLibrary table;
    Status status;
};

Result<void*> Open(const std::string& soname) {
    void* handle = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
#ifdef KVSHARD_CUDA_LIBRARY_DIR
    if (handle == nullptr) {
        handle = ::dlopen((std::string(KVSHARD_CUDA_LIBRARY_DIR) + "/" + soname).c_str(),
                          RTLD_NOW | RTLD_LOCAL);
    }
#endif
    if (handle == nullptr) {
        const char* error = ::dlerror();
        return Unavailable("cuBLAS: cannot load " + soname + ": " +
                           (error != nullptr ? error : "unknown loader error"));
    }
    return handle;
}

template <typename Fn>
Status Resolve(void* handle, const char* symbol, const std::string& library, Fn* out) {
    void* address = ::dlsym(handle, symbol);
    if (address == nullptr) {
        return Unavailable("cuBLAS: " + library + " has no symbol " + symbol +
                           " (a toolkit older than the one kvshard was built with?)");
    }
    *out = reinterpret_cast<Fn>(address);
    return Status::Ok();
}

Loaded LoadOnce() {
    Loaded loaded;
    const std::string major = std::to_string(CUBLAS_VER_MAJOR);
    const std::string cublas = "libcublas.so." + major;
    const std::string cublas_lt = "libcublasLt.so." + major;
    // libcublas needs libcublasLt: opened first, it is found by the one already loaded.
    Result<void*> lt = Open(cublas_lt);
    if (!lt.ok()) return {{}, lt.status()};
    Result<void*> blas = Open(cublas);
    if (!blas.ok()) return {{}, blas.status()};
#define KVSHARD_CUBLAS_BIND(name)                                                                \
    if (Status s = Resolve(*blas, KVSHARD_STRINGIZE_EXPANDED(name), cublas, &loaded.table.name); \
        !s.ok())                                                                                 \
        return {{}, s};
#define KVSHARD_CUBLASLT_BIND(name)                                                               \
    if (Status s = Resolve(*lt, KVSHARD_STRINGIZE_EXPANDED(name), cublas_lt, &loaded.table.name); \
        !s.ok())                                                                                  \
        return {{}, s};
    KVSHARD_CUBLAS_FUNCTIONS(KVSHARD_CUBLAS_BIND)
    KVSHARD_CUBLASLT_FUNCTIONS(KVSHARD_CUBLASLT_BIND)
#undef KVSHARD_CUBLAS_BIND
#undef KVSHARD_CUBLASLT_BIND
    // The libraries stay loaded for the process's life (the table points into them).
    return loaded;
}

const Loaded& Instance() {
    static const Loaded loaded = LoadOnce();
    return loaded;
}

}  // namespace

Result<const CublasLibrary*> LoadCublas() {
    const Loaded& loaded = Instance();
    if (!loaded.status.ok()) return loaded.status;
    return &loaded.table;
}

const CublasLibrary& Cublas() {
    Result<const CublasLibrary*> lib = LoadCublas();
    KV_CHECK(lib.ok()) << lib.status().ToString();
    return **lib;
}

}  // namespace kvshard::cuda
