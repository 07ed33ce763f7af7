// kvshard_matmul_bench: MatMulStored (kernels/cpu_matmul.h) on the default model's matrices
// (SmolLM2-135M: hidden 576, fused qkv n=960, o n=576, fused gate|up n=3072, down k=1536 n=576,
// classifier n=49152; and wide_1536, n=3072 k=1536, for the K-quants, whose 256-weight
// super-blocks do not divide 576), printing GFLOP/s and the weight bytes streamed per second.
// A matrix whose k is not a multiple of the type's block is skipped.
//
//   kvshard_matmul_bench [--dtypes Q4_1,Q8_0,F32] [--m 1,16,128] [--threads 1,2]
//                        [--isa portable|avx2|avx512] [--activations fp32,int8,int16] [--hot]
//                        [--min-ms N] [--gemm auto,off,on] [--interleaved]
//                        [--prefill fp32,bf16,bf16-avx512]
//
// --gemm lists the modes of the batched-decode kernel (kernels/cpu_gemm.h) each case runs with:
// auto (MatMulStored's own choice), off (the register-tiled kernels or sgemm panels) and on (the
// kernel at any m); the "gemm" column says whether it ran.
// --prefill lists the modes of prefill-sized products (kernels/cpu_gemm_bf16.h; default: the
// process's, KVSHARD_MATMUL_PREFILL) each case runs with: fp32, bf16 (AMX tiles where the CPU has
// them), bf16-avx512 (vdpbf16ps even with AMX); the "pre" column says which ran (amx or bf16 at
// m >= 49 on a CPU with AVX512-BF16, else fp32).
// --interleaved gives each Q4_1 and Q8_0 matrix its interleaved copy (kernels/cpu_matmul.h), which
// single-row products read on AVX-512 (batch-1 decode's layout; the runner makes it).
// --activations lists the activation formats (kernels/cpu_matmul.h; default fp32,int8) each case
// runs with, in the same process one after the other; "vs fp32" is the fp32 time over this one
// (above 1: faster). cpu-us is the least CPU time per call and thread over the 5 runs, and "cpu vs"
// the same ratio on it: on a shared machine, where the wall time counts the other processes' turns,
// it is the steadier figure (at 1 thread; at 2 an idle team member's spin-wait counts too). The
// "act" column says what ran: int8 (the int8 dot-product kernels), rnd8 (activations rounded to 8
// bits, then the fp32 kernels: m > 16 or the portable ISA), i16 (a single row rounded to int16
// against the interleaved copy, AVX512_VNNI) or fp32 (the exact kernels).
//
// Decode reads every layer's weights once per step from DRAM, so by default each matrix is
// replicated into copies totalling at least twice the last-level cache and the calls cycle through
// them (--hot: one copy, cache-resident when it fits). A figure is the best of 5 timed runs that
// together last at least --min-ms (default 150), after a warm-up. cpu% is the process's CPU time
// over wall time × threads in that run: below 100 the machine was shared and the figure is low.
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_gemm.h"
#include "kernels/cpu_gemm_bf16.h"
#include "kernels/cpu_matmul.h"
#include "kernels/cpu_ops.h"

namespace {

using kvshard::DType;
using kvshard::cpu::StoredMatrix;

struct Shape {
    const char* name;
    int64_t n, k;
};

constexpr Shape kShapes[] = {{"qkv", 960, 576},
                             {"o", 576, 576},
                             {"gate_up", 3072, 576},
                             {"down", 576, 1536},
                             {"classifier", 49152, 576},
                             // k = 1536: a multiple of the K-quants' 256-weight super-block (the
                             // k = 576 matrices are Q5_0/Q8_0 in a K-quant file of this model).
                             {"wide_1536", 3072, 1536}};

std::vector<std::string> Split(const std::string& s) {
    std::vector<std::string> out;
    size_t start = 0;
    while (start <= s.size()) {
        const size_t comma = s.find(',', start);
        const size_t end = comma == std::string::npos ? s.size() : comma;
        if (end > start) out.push_back(s.substr(start, end - start));
        start = end + 1;
    }
    return out;
}

bool ParseDType(const std::string& name, DType* out) {
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0,
                    DType::kQ4_1, DType::kQ5_0, DType::kQ5_1, DType::kQ2_K, DType::kQ3_K,
                    DType::kQ4_K, DType::kQ5_K, DType::kQ6_K, DType::kQ8_K}) {
        if (kvshard::DTypeName(d) == name) {
            *out = d;
            return true;
        }
    }
    return false;
}

// Random weights with finite values: floats in [-1, 1], quantized blocks with random quants and
// small fp16 scales (random bytes as scales could be NaN or inf and slow the FPU down).
void FillRandom(DType dtype, uint8_t* p, size_t bytes, std::mt19937& gen) {
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    const size_t block = kvshard::BlockBytes(dtype);
    for (size_t at = 0; at + block <= bytes; at += block) {
        uint8_t* b = p + at;
        switch (dtype) {
            case DType::kF32: {
                const float f = unit(gen);
                std::memcpy(b, &f, sizeof(f));
                break;
            }
            case DType::kF16:
            case DType::kBF16: {
                const uint16_t h = dtype == DType::kF16 ? kvshard::FloatToHalf(unit(gen))
                                                        : kvshard::FloatToBF16(unit(gen));
                std::memcpy(b, &h, sizeof(h));
                break;
            }
            case DType::kQ8_0:
            case DType::kQ4_0:
            case DType::kQ4_1: {
                const size_t scales = dtype == DType::kQ4_1 ? 2 : 1;
                for (size_t s = 0; s < scales; ++s) {
                    const uint16_t h = kvshard::FloatToHalf(0.02f * unit(gen));
                    std::memcpy(b + 2 * s, &h, sizeof(h));
                }
                for (size_t i = 2 * scales; i < block; ++i) b[i] = static_cast<uint8_t>(gen());
                break;
            }
            default: {
                // Q5_0/Q5_1 and the K-quants: random quants and sub-block scales, small fp16
                // (Q8_K: f32) super-block scales at their offsets (common/dtype.h).
                for (size_t i = 0; i < block; ++i) b[i] = static_cast<uint8_t>(gen());
                std::vector<size_t> halves;
                switch (dtype) {
                    case DType::kQ5_0:
                        halves = {0};
                        break;
                    case DType::kQ5_1:
                    case DType::kQ4_K:
                    case DType::kQ5_K:
                        halves = {0, 2};
                        break;
                    case DType::kQ2_K:
                        halves = {80, 82};
                        break;
                    case DType::kQ3_K:
                        halves = {108};
                        break;
                    case DType::kQ6_K:
                        halves = {208};
                        break;
                    default: {
                        const float d = 0.02f * unit(gen);  // Q8_K
                        std::memcpy(b, &d, sizeof(d));
                    }
                }
                for (size_t at : halves) {
                    const uint16_t h = kvshard::FloatToHalf(0.02f * unit(gen));
                    std::memcpy(b + at, &h, sizeof(h));
                }
                break;
            }
        }
    }
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// CPU seconds used by the process: against the wall time it shows how much of the cores the
// benchmark got on a shared machine.
double ProcessCpuSeconds() {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Every (a, b) with a from `as` and b from `bs`, a the outer.
template <typename A, typename B>
std::vector<std::pair<A, B>> Pairs(const std::vector<A>& as, const std::vector<B>& bs) {
    std::vector<std::pair<A, B>> out;
    for (const A& a : as) {
        for (const B& b : bs) out.emplace_back(a, b);
    }
    return out;
}

}  // namespace

int main(int argc, char** argv) {
    std::vector<std::string> dtype_names = {"Q4_1", "Q8_0", "F32"};
    std::vector<std::string> m_values = {"1", "16", "128"};
    std::vector<std::string> thread_values = {"1", "2"};
    std::string isa_name;
    std::vector<std::string> activation_names = {"fp32", "int8"};
    bool hot = false;
    bool interleaved = false;
    double min_ms = 150;
    std::vector<std::string> gemm_names = {"auto"};
    std::vector<std::string> prefill_names;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const bool has_value = i + 1 < argc;
        if (arg == "--dtypes" && has_value) {
            dtype_names = Split(argv[++i]);
        } else if (arg == "--m" && has_value) {
            m_values = Split(argv[++i]);
        } else if (arg == "--threads" && has_value) {
            thread_values = Split(argv[++i]);
        } else if (arg == "--isa" && has_value) {
            isa_name = argv[++i];
        } else if (arg == "--activations" && has_value) {
            activation_names = Split(argv[++i]);
        } else if (arg == "--hot") {
            hot = true;
        } else if (arg == "--interleaved") {
            interleaved = true;
        } else if (arg == "--min-ms" && has_value) {
            min_ms = std::atof(argv[++i]);
        } else if (arg == "--gemm" && has_value) {
            gemm_names = Split(argv[++i]);
        } else if (arg == "--prefill" && has_value) {
            prefill_names = Split(argv[++i]);
        } else {
            std::fprintf(stderr,
                         "usage: %s [--dtypes Q4_1,Q8_0,F32] [--m 1,16,128] [--threads 1,2] "
                         "[--isa portable|avx2|avx512] [--activations fp32,int8,int16] [--hot] "
                         "[--min-ms N] [--gemm auto,off,on] [--interleaved] "
                         "[--prefill fp32,bf16,bf16-avx512]\n",
                         argv[0]);
            return 2;
        }
    }
    std::vector<DType> dtypes;
    for (const std::string& name : dtype_names) {
        DType d;
        if (!ParseDType(name, &d)) {
            std::fprintf(stderr, "kvshard_matmul_bench: unknown dtype %s\n", name.c_str());
            return 2;
        }
        dtypes.push_back(d);
    }
    if (!isa_name.empty()) {
        bool found = false;
        for (auto isa : {kvshard::cpu::KernelIsa::kPortable, kvshard::cpu::KernelIsa::kAvx2,
                         kvshard::cpu::KernelIsa::kAvx512}) {
            if (kvshard::cpu::KernelIsaName(isa) == isa_name) {
                kvshard::cpu::ForceKernelIsa(isa);
                found = true;
            }
        }
        if (!found) {
            std::fprintf(stderr, "kvshard_matmul_bench: unknown isa %s\n", isa_name.c_str());
            return 2;
        }
    }
    std::vector<kvshard::cpu::ActivationFormat> formats;
    for (const std::string& name : activation_names) {
        bool found = false;
        for (auto f : {kvshard::cpu::ActivationFormat::kFp32, kvshard::cpu::ActivationFormat::kInt8,
                       kvshard::cpu::ActivationFormat::kInt16}) {
            if (kvshard::cpu::ActivationFormatName(f) == name) {
                formats.push_back(f);
                found = true;
            }
        }
        if (!found) {
            std::fprintf(stderr, "kvshard_matmul_bench: unknown activation format %s\n",
                         name.c_str());
            return 2;
        }
    }
    std::vector<kvshard::cpu::gemm::GemmMode> gemm_modes;
    for (const std::string& name : gemm_names) {
        using kvshard::cpu::gemm::GemmMode;
        if (name == "auto" || name == "off" || name == "on") {
            gemm_modes.push_back(name == "auto"  ? GemmMode::kAuto
                                 : name == "off" ? GemmMode::kOff
                                                 : GemmMode::kOn);
        } else {
            std::fprintf(stderr, "kvshard_matmul_bench: unknown --gemm mode %s\n", name.c_str());
            return 2;
        }
    }
    namespace bf16 = kvshard::cpu::gemm_bf16;
    for (const std::string& name : prefill_names) {
        if (name != "fp32" && name != "bf16" && name != "bf16-avx512") {
            std::fprintf(stderr, "kvshard_matmul_bench: unknown --prefill mode %s\n", name.c_str());
            return 2;
        }
    }
    if (prefill_names.empty())
        prefill_names.push_back(std::string(bf16::PrefillModeName(bf16::ActivePrefillMode())));
    const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    const size_t cold_bytes = 2 * static_cast<size_t>(llc > 0 ? llc : 64 << 20);
    std::printf("isa %s (detected %s), blas core %s, weights %s\n",
                std::string(kvshard::cpu::KernelIsaName(kvshard::cpu::ActiveKernelIsa())).c_str(),
                std::string(kvshard::cpu::KernelIsaName(kvshard::cpu::DetectedKernelIsa())).c_str(),
                kvshard::cpu::BlasCoreName().c_str(),
                hot ? "hot (one copy)" : "cold (copies > 2x LLC)");
    std::printf("%-10s %-5s %4s %3s %-4s %-4s %-4s %10s %9s %10s %7s %5s %10s %7s\n", "matrix",
                "dtype", "m", "thr", "act", "gemm", "pre", "us/call", "GFLOP/s", "weightGB/s",
                "vs fp32", "cpu%", "cpu-us", "cpu vs");
    std::mt19937 gen(1);
    for (const Shape& shape : kShapes) {
        for (DType dtype : dtypes) {
            if (shape.k % kvshard::BlockElements(dtype) != 0) continue;  // not storable
            const size_t matrix_bytes = kvshard::RowBytes(dtype, shape.k) * shape.n;
            const size_t copies = hot ? 1 : std::max<size_t>(2, cold_bytes / matrix_bytes + 1);
            // 64-byte aligned copies, as GGUF tensor data are (32-byte) aligned in a mapping.
            const size_t stride = (matrix_bytes + 63) / 64 * 64;
            std::vector<uint8_t> storage(stride * copies + 64);
            uint8_t* base =
                storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64);
            FillRandom(dtype, base, matrix_bytes, gen);
            for (size_t c = 1; c < copies; ++c) {
                std::memcpy(base + c * stride, base, matrix_bytes);
            }
            const StoredMatrix first{dtype, base, shape.n, shape.k};
            const size_t packed_bytes = interleaved ? kvshard::cpu::InterleavedBytes(first) : 0;
            std::vector<uint8_t> packed_storage(packed_bytes > 0 ? stride * copies + 64 : 0);
            uint8_t* packed = nullptr;
            if (packed_bytes > 0) {
                packed = packed_storage.data() +
                         (64 - reinterpret_cast<uintptr_t>(packed_storage.data()) % 64);
                kvshard::cpu::InterleaveRows(first, packed);
                for (size_t c = 1; c < copies; ++c) {
                    std::memcpy(packed + c * stride, packed, packed_bytes);
                }
            }
            for (const std::string& m_text : m_values) {
                const int64_t m = std::atoll(m_text.c_str());
                if (m <= 0) continue;
                std::vector<float> x(static_cast<size_t>(m * shape.k));
                std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
                for (float& v : x) v = unit(gen);
                std::vector<float> y(static_cast<size_t>(m * shape.n));
                for (const std::string& t_text : thread_values) {
                    const int threads = std::atoi(t_text.c_str());
                    if (threads <= 0) continue;
                    kvshard::cpu::SetNumThreads(threads);
                    for (const auto& [prefill_name, gemm_mode] : Pairs(prefill_names, gemm_modes)) {
                        bf16::ForcePrefillMode(prefill_name == "fp32" ? bf16::PrefillMode::kFp32
                                                                      : bf16::PrefillMode::kBf16);
                        if (prefill_name == "bf16-avx512") {
                            bf16::ForceBf16Unit(bf16::Bf16Unit::kAvx512Bf16);
                        } else {
                            bf16::ResetBf16Unit();
                        }
                        kvshard::cpu::gemm::ForceGemmMode(gemm_mode);
                        const char* prefill_used =
                            !bf16::UsesGemmBf16(kvshard::cpu::ActiveKernelIsa(), dtype, m) ? "fp32"
                            : bf16::ActiveBf16Unit() == bf16::Bf16Unit::kAmx               ? "amx"
                                                                                           : "bf16";
                        // (The bf16 kernel, when it runs, comes before the batched one.)
                        const char* gemm_used = kvshard::cpu::gemm::UsesGemm(
                                                    kvshard::cpu::ActiveKernelIsa(), dtype, m) &&
                                                        prefill_used[0] == 'f'
                                                    ? "on"
                                                    : "off";
                        double fp32_best = 0;
                        double fp32_cpu_us = 0;
                        for (const kvshard::cpu::ActivationFormat format : formats) {
                            kvshard::cpu::ForceActivationFormat(format);
                            const char* act = kvshard::cpu::UsesInt8Kernels(dtype, m)     ? "int8"
                                              : kvshard::cpu::QuantizesActivations(dtype) ? "rnd8"
                                              : kvshard::cpu::RoundsToInt16(dtype)        ? "i16"
                                                                                          : "fp32";
                            size_t next = 0;
                            const auto call = [&] {
                                const StoredMatrix w{dtype, base + next * stride, shape.n, shape.k,
                                                     packed ? packed + next * stride : nullptr};
                                next = (next + 1) % copies;
                                kvshard::cpu::MatMulStored(x.data(), m, w, y.data());
                            };
                            for (size_t c = 0; c < std::min<size_t>(copies, 4); ++c)
                                call();  // warm-up
                            double best = 1e30;
                            double best_cpu_share = 0;
                            double best_cpu_us = 1e30;
                            for (int run = 0; run < 5; ++run) {
                                int64_t calls = 0;
                                const double cpu0 = ProcessCpuSeconds();
                                const auto t0 = std::chrono::steady_clock::now();
                                double secs = 0;
                                do {
                                    call();
                                    ++calls;
                                    secs = SecondsSince(t0);
                                } while (secs * 1e3 < min_ms / 5);
                                if (secs / static_cast<double>(calls) < best) {
                                    best = secs / static_cast<double>(calls);
                                    best_cpu_share = (ProcessCpuSeconds() - cpu0) / secs / threads;
                                }
                                const double cpu_us = (ProcessCpuSeconds() - cpu0) /
                                                      static_cast<double>(calls) / threads * 1e6;
                                if (cpu_us < best_cpu_us) {
                                    best_cpu_us = cpu_us;
                                }
                            }
                            const double flops = 2.0 * static_cast<double>(m * shape.n * shape.k);
                            if (format == kvshard::cpu::ActivationFormat::kFp32) {
                                fp32_best = best;
                                fp32_cpu_us = best_cpu_us;
                            }
                            char ratio[16] = "-";
                            char cpu_ratio[16] = "-";
                            if (fp32_best > 0) {
                                std::snprintf(ratio, sizeof(ratio), "%.2f", fp32_best / best);
                                std::snprintf(cpu_ratio, sizeof(cpu_ratio), "%.2f",
                                              fp32_cpu_us / best_cpu_us);
                            }
                            std::printf(
                                "%-10s %-5s %4lld %3d %-4s %-4s %-4s %10.1f %9.1f %10.2f %7s %5.0f "
                                "%10.1f "
                                "%7s\n",
                                shape.name, std::string(kvshard::DTypeName(dtype)).c_str(),
                                static_cast<long long>(m), threads, act, gemm_used, prefill_used,
                                best * 1e6, flops / best / 1e9,
                                static_cast<double>(matrix_bytes) / best / 1e9, ratio,
                                100 * best_cpu_share, best_cpu_us, cpu_ratio);
                            std::fflush(stdout);
                        }
                        kvshard::cpu::ResetActivationFormat();
                    }
                    kvshard::cpu::gemm::ResetGemmMode();
                    bf16::ResetPrefillMode();
                    bf16::ResetBf16Unit();
                }
            }
        }
    }
    return 0;
}
