// The flags kvshard_cuda_decode_bench, kvshard_cuda_op_bench and kvshard_cuda_prefill_step_bench
// share, parsed with CLI11 as the kvshard CLI parses its own: --backend, --shape, --batches and
// --json, their checks, and what they name (a backend kind, a DecodeShape). A bad value is refused by CLI11 in one line naming
// the flag, exit code non-zero, before any device is touched.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/synthetic_decode.h"

namespace kvshard::bench {

struct CudaBenchFlags {
    std::string backend = "cuda";  // cuda or cpu
    std::string shape = "8b";      // 8b (Llama-3-8B) or tiny
    std::vector<int64_t> batches;  // the caller's default until --batches is given
    bool json = false;
};

// Adds the shared flags to `app`, writing into *flags (which must outlive the parse); --batches
// only where `batches` (a bench without batches has no such flag).
inline void AddCudaBenchFlags(CLI::App& app, CudaBenchFlags* flags, bool batches = true) {
    app.add_option("--backend", flags->backend, "The backend to time")
        ->check(CLI::IsMember({"cuda", "cpu"}))
        ->capture_default_str();
    app.add_option("--shape", flags->shape, "Model shape: 8b (Llama-3-8B) or tiny")
        ->check(CLI::IsMember({"8b", "tiny"}))
        ->capture_default_str();
    if (batches) {
        app.add_option("--batches", flags->batches, "Batch sizes, comma-separated")
            ->delimiter(',')
            ->check(CLI::PositiveNumber)
            ->capture_default_str();
    }
    app.add_flag("--json", flags->json, "Also print one JSON object");
}

inline BackendKind BackendOf(const CudaBenchFlags& flags) {
    return flags.backend == "cuda" ? BackendKind::kCuda : BackendKind::kCpu;
}

// The synthetic model of --shape: the 8B shape (DecodeShape's defaults) or a tiny one for
// trying a bench on the CPU.
inline cuda::DecodeShape ShapeOf(const CudaBenchFlags& flags) {
    if (flags.shape == "tiny") {
        return {.layers = 2,
                .hidden = 256,
                .heads = 4,
                .kv_heads = 2,
                .head_dim = 64,
                .ffn = 512,
                .vocab = 1000};
    }
    return {};
}

// Parses argv into `app`; returns -1 when the run goes on, else the exit code (a usage error's,
// printed by CLI11 in one line; 0 after --help).
inline int ParseCudaBenchFlags(CLI::App& app, int argc, char** argv) {
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    }
    return -1;
}

}  // namespace kvshard::bench
