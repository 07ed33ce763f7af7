// MatMulStored and EmbeddingRows (kernels/cpu_matmul.h): ISA detection and dispatch, the portable
// kernels, and the large-m path (dequantized panels of weight rows fed to OpenBLAS sgemm).
//
// Two regimes:
//  - m <= kMaxTiledRows (decode, small batches): weights are read once, in their stored format,
//    by the register-tiled kernels of cpu_matmul_avx512.cc / cpu_matmul_avx2.cc (or the portable
//    loop here); the product is bound by the weight bytes streamed, which quantization shrinks.
//  - larger m (prefill): dequantizing a weight row costs O(k) and sgemm amortizes it over m rows
//    at near-peak FLOP rate, so a panel of rows is dequantized to fp32 and handed to sgemm; with
//    KVSHARD_MATMUL_PREFILL=bf16, m >= 49 takes the bf16 kernel of kernels/cpu_gemm_bf16.h.
#include "kernels/cpu_matmul.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "common/check.h"
#include "kernels/cpu_gemm.h"
#include "kernels/cpu_gemm_bf16.h"
#include "kernels/cpu_matmul_batch_copy.h"
#include "kernels/cpu_matmul_internal.h"
#include "kernels/cpu_ops.h"
#include "kernels/cpu_strip_ranges.h"

namespace kvshard::cpu {

namespace matmul_internal {

// Whether the AVX2/AVX-512 kernels read `dtype`. The others (Q2_K, Q3_K, Q8_K) are multiplied by
// the portable kernel: a weight row dequantized once into fp32 by common/dtype.cc, then dotted
// with every activation row (so still read in their stored format, once per product).
bool HasSimdKernel(DType dtype) {
    switch (dtype) {
        case DType::kF32:
        case DType::kF16:
        case DType::kBF16:
        case DType::kQ8_0:
        case DType::kQ4_0:
        case DType::kQ4_1:
        case DType::kQ5_0:
        case DType::kQ5_1:
        case DType::kQ4_K:
        case DType::kQ5_K:
        case DType::kQ6_K:
            return true;
        default:
            return false;
    }
}

}  // namespace matmul_internal

namespace {

using matmul_internal::HasSimdKernel;
using matmul_internal::StripRanges;

using matmul_internal::DequantizeRowsAvx2;
using matmul_internal::DequantizeRowsPreferCopyAvx512;
using matmul_internal::MatMulRowsAvx2;
using matmul_internal::MatMulRowsAvx512;
using matmul_internal::MatMulRowsInt8Avx2;
using matmul_internal::MatMulRowsInt8Avx512;

// Above this many activation rows the panel + sgemm path wins over the register-tiled kernels.
// kvshard_matmul_bench, 1 thread, SmolLM2-135M shapes, Q4_1/Q8_0 (GFLOP/s): tiled 50-64 flat in
// m; panels 23-35 at m = 16-32, 52-68 at m = 64, 65-90 at m = 128.
constexpr int64_t kMaxTiledRows = 48;
// Weight rows of the kernels' strip (cpu_matmul_avx512.cc: a tile reads 4 weight rows at once);
// the tiled path gives each thread whole strips.
constexpr int64_t kStripRows = 4;
// Weights per block of the formats with an interleaved kernel (Q4_1, Q8_0).
constexpr int64_t kBlockElements32 = 32;
// Weight rows per panel granule in the sgemm path.
constexpr int64_t kChunkRows = 16;
// Activation rows per block of the tiled path (64 rows of 576 floats: 147 KB, inside L2).
constexpr int64_t kRowBlock = 64;
// Below this many multiply-adds a product runs on the calling thread: the fork/join of a team
// (~2-5 µs on 2 cores) would cost more than it saves.
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;
// Bound of the fp32 panel of dequantized weight rows in the sgemm path.
constexpr size_t kMaxPanelBytes = size_t{8} << 20;

constexpr int kNotForced = -1;
std::atomic<int> g_forced_isa{kNotForced};
std::atomic<int> g_forced_activations{kNotForced};

#if defined(__x86_64__)
uint64_t ReadXcr0() {
    uint32_t eax;
    uint32_t edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return (static_cast<uint64_t>(edx) << 32) | eax;
}

KernelIsa Detect() {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return KernelIsa::kPortable;
    const bool fma = ecx & (1u << 12);
    const bool osxsave = ecx & (1u << 27);
    const bool avx = ecx & (1u << 28);
    const bool f16c = ecx & (1u << 29);
    // Without OSXSAVE, xgetbv faults; without the OS saving ymm/zmm state the registers are
    // unusable even if cpuid lists the instructions.
    if (!osxsave || !avx || !fma || !f16c) return KernelIsa::kPortable;
    const uint64_t xcr0 = ReadXcr0();
    const bool ymm_state = (xcr0 & 0x6) == 0x6;    // SSE and AVX state
    const bool zmm_state = (xcr0 & 0xE6) == 0xE6;  // + opmask, ZMM_Hi256, Hi16_ZMM
    if (!ymm_state || __get_cpuid_max(0, nullptr) < 7) return KernelIsa::kPortable;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    const bool avx2 = ebx & (1u << 5);
    const bool avx512f = ebx & (1u << 16);
    const bool avx512dq = ebx & (1u << 17);
    const bool avx512bw = ebx & (1u << 30);
    const bool avx512vl = ebx & (1u << 31);
    if (zmm_state && avx2 && avx512f && avx512dq && avx512bw && avx512vl) return KernelIsa::kAvx512;
    if (avx2) return KernelIsa::kAvx2;
    return KernelIsa::kPortable;
}

// AVX512_VNNI (vpdpbusd) and AVX512_VBMI (vpermb), which the AVX-512 int8 kernels need beyond
// kAvx512 (Ice Lake and later; Skylake-X and Cascade Lake take the AVX2 int8 kernels).
bool DetectVnni() {
    if (Detect() != KernelIsa::kAvx512) return false;
    unsigned eax, ebx, ecx, edx;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    return (ecx & (1u << 1)) && (ecx & (1u << 11));
}
#else
KernelIsa Detect() { return KernelIsa::kPortable; }
bool DetectVnni() { return false; }
#endif

bool HasAvx512Vnni() {
    static const bool vnni = DetectVnni();
    return vnni;
}

// KVSHARD_MATMUL_ACTIVATIONS=fp32|int16|int8, read once; unset means fp32.
ActivationFormat DefaultActivationFormat() {
    static const ActivationFormat format = [] {
        const char* env = std::getenv("KVSHARD_MATMUL_ACTIVATIONS");
        if (env == nullptr || std::string_view(env) == "fp32") return ActivationFormat::kFp32;
        if (std::string_view(env) == "int16") {
            if (!HasAvx512Vnni()) {
                std::fprintf(stderr,
                             "kvshard: KVSHARD_MATMUL_ACTIVATIONS=int16 needs AVX512-VNNI, which "
                             "this CPU lacks; single-row products keep fp32 activations\n");
            }
            return ActivationFormat::kInt16;
        }
        if (std::string_view(env) == "int8") return ActivationFormat::kInt8;
        std::fprintf(stderr,
                     "kvshard: KVSHARD_MATMUL_ACTIVATIONS=%s is not fp32, int16 or int8; using "
                     "fp32\n",
                     env);
        return ActivationFormat::kFp32;
    }();
    return format;
}

// Whether the int8 kernels read `dtype`.
bool HasInt8Kernel(DType dtype) {
    return dtype == DType::kQ8_0 || dtype == DType::kQ4_0 || dtype == DType::kQ4_1;
}

// Rows [r0, r1) of `w` dequantized to fp32 (stride w.cols).
void DequantizeRows(KernelIsa isa, const StoredMatrix& w, int64_t r0, int64_t r1, float* out) {
#if defined(__x86_64__)
    switch (isa) {
        case KernelIsa::kAvx512:
            return DequantizeRowsPreferCopyAvx512(w, r0, r1, out);
        case KernelIsa::kAvx2:
            return DequantizeRowsAvx2(w, r0, r1, out);
        case KernelIsa::kPortable:
            break;
    }
#endif
    const size_t row_bytes = RowBytes(w.dtype, w.cols);
    for (int64_t r = r0; r < r1; ++r) {
        DequantizeRow(w.dtype, w.data + r * row_bytes, w.cols, out + (r - r0) * w.cols);
    }
}

float DotPortable(const float* a, const float* b, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

// The portable tiled kernel: each weight row dequantized once into `row` (w.cols floats), then
// dotted with every activation row.
void MatMulRowsPortable(const float* x, int64_t m, const StoredMatrix& w, int64_t n0, int64_t n1,
                        float* y, float* row) {
    const int64_t k = w.cols;
    const int64_t n = w.rows;
    for (int64_t j = n0; j < n1; ++j) {
        DequantizeRows(KernelIsa::kPortable, w, j, j + 1, row);
        for (int64_t i = 0; i < m; ++i) y[i * n + j] = DotPortable(x + i * k, row, k);
    }
}

void MatMulRowsIsa(KernelIsa isa, const float* x, int64_t m, const StoredMatrix& w, int64_t n0,
                   int64_t n1, float* y, float* row) {
    switch (isa) {
#if defined(__x86_64__)
        case KernelIsa::kAvx512:
            return MatMulRowsAvx512(x, m, w, n0, n1, y);
        case KernelIsa::kAvx2:
            return MatMulRowsAvx2(x, m, w, n0, n1, y);
#else
        case KernelIsa::kAvx512:  // never active off x86-64
        case KernelIsa::kAvx2:
#endif
        case KernelIsa::kPortable:
            return MatMulRowsPortable(x, m, w, n0, n1, y, row);
    }
}

void MatMulTiled(KernelIsa isa, const float* x, int64_t m, const StoredMatrix& w, float* y) {
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    const bool parallel = n > kStripRows && m * n * k >= kMinParallelMacs;
    StripRanges ranges(n, parallel ? omp_get_max_threads() : 1, kStripRows);
#pragma omp parallel if (parallel)
    {
        std::vector<float> row(isa == KernelIsa::kPortable ? static_cast<size_t>(k) : 0);
        // Blocks of activation rows that stay in L2 while the thread streams its weights past
        // them once per block (the weights of one matrix stay in the last-level cache). The
        // threads write disjoint columns of y, so the region's closing barrier is the only one.
        ranges.Run(omp_get_thread_num(), [&](int64_t n0, int64_t n1) {
            for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
                const int64_t rows = std::min(kRowBlock, m - i0);
                MatMulRowsIsa(isa, x + i0 * k, rows, w, n0, n1, y + i0 * n, row.data());
            }
        });
    }
}

// A buffer of the calling thread, kept between calls so that its pages are faulted in once (a
// fresh 8 MB allocation per call costs ~0.5 ms of page faults); one per Use.
enum class Scratch { kPanel, kInt8, kRounded, kBlockSums, kInt16, kTailRow };
template <Scratch Use, typename T>
T* ThreadScratch(size_t count) {
    thread_local std::unique_ptr<T[]> buffer;
    thread_local size_t capacity = 0;
    if (count > capacity) {
        buffer.reset(new T[count]);
        capacity = count;
    }
    return buffer.get();
}

// 64-byte aligned room for the quantized activations of one product.
uint8_t* Int8Scratch(size_t bytes) {
    uint8_t* p = ThreadScratch<Scratch::kInt8, uint8_t>(bytes + 64);
    return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
}

// The int8-activation path: the activations quantized once on the calling thread, then the team
// streams the weights past them, its columns split as in MatMulTiled.
void MatMulInt8(KernelIsa isa, const float* x, int64_t m, const StoredMatrix& w, float* y) {
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    const bool avx512 = isa == KernelIsa::kAvx512 && HasAvx512Vnni();
    uint8_t* xq;
    if (avx512) {
        xq = Int8Scratch(matmul_internal::Int8Avx512Bytes(m, k));
        matmul_internal::QuantizeRowsAvx512(w.dtype, x, m, k, xq);
    } else {
        xq = Int8Scratch(matmul_internal::Int8Avx2Bytes(m, k));
        matmul_internal::QuantizeRowsAvx2(w.dtype, x, m, k, xq);
    }
    const bool parallel = n > kStripRows && m * n * k >= kMinParallelMacs;
    StripRanges ranges(n, parallel ? omp_get_max_threads() : 1, kStripRows);
#pragma omp parallel if (parallel)
    ranges.Run(omp_get_thread_num(), [&](int64_t n0, int64_t n1) {
        if (avx512) {
            MatMulRowsInt8Avx512(xq, m, w, n0, n1, y);
        } else {
            MatMulRowsInt8Avx2(xq, m, w, n0, n1, y);
        }
    });
}

// A single activation row prepared for the interleaved kernels by the thread that multiplies it
// (Q4_1: int16 blocks when RoundsToInt16, else the block sums of the fp32 row), in its own
// scratch. Deterministic: every thread prepares the same values from the same row.
struct PreparedRow {
    const float* sums = nullptr;  // Q4_1 fp32: the block sums
    matmul_internal::ActivationsInt16 xi;
    const float* tail_x = nullptr;  // the row for the stored-layout kernel past the last group
};

PreparedRow PrepareRow(const float* x, const StoredMatrix& w, bool int16, bool tail) {
    const int64_t k = w.cols;
    const int64_t blocks = k / kBlockElements32;
    float* sums = ThreadScratch<Scratch::kBlockSums, float>(static_cast<size_t>(2 * blocks));
    PreparedRow row{.sums = sums, .xi = {}, .tail_x = x};
    if (int16) {
#if defined(__x86_64__)
        // 64 bytes of room to align the values (their dword pairs are broadcast from memory).
        auto* raw = ThreadScratch<Scratch::kInt16, int16_t>(static_cast<size_t>(k + 32));
        auto* values = raw + (64 - reinterpret_cast<uintptr_t>(raw) % 64) % 64 / sizeof(int16_t);
        matmul_internal::QuantizeRowInt16Avx512(x, k, values, sums + blocks, sums);
        row.xi = {.values = values, .scales = sums + blocks, .sums = sums};
        if (tail) {
            float* rounded = ThreadScratch<Scratch::kTailRow, float>(static_cast<size_t>(k));
            matmul_internal::RoundRowsInt16Avx512(x, k, rounded);
            row.tail_x = rounded;
        }
#endif
    } else {
        for (int64_t b = 0; w.dtype == DType::kQ4_1 && b < blocks; ++b) {
            float s = 0.0f;
            for (int64_t i = 0; i < kBlockElements32; ++i) s += x[b * kBlockElements32 + i];
            sums[b] = s;
        }
    }
    return row;
}

// A single activation row against the interleaved copy of a matrix (cpu_matmul.h): the team
// streams the groups, split in whole groups; the rows past the last whole group
// (n % kInterleaveRows) take the stored-layout kernel with the same row (rounded back to fp32
// when RoundsToInt16), always as one strip, so every row's arithmetic is the same whichever
// thread takes it. Each thread prepares the row itself inside the region (PrepareRow): the
// preparation (0.1-0.4 µs at SmolLM2's shapes) then overlaps the other thread's wake-up instead
// of preceding the fork on the calling thread, for two threads doing it once each.
void MatMulInterleaved(const float* x, const StoredMatrix& w, float* y) {
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    const bool int16 = RoundsToInt16(w.dtype);
    const int64_t whole = n / kInterleaveRows * kInterleaveRows;
    const bool parallel = n > kInterleaveRows && n * k >= kMinParallelMacs;
    StripRanges ranges(n, parallel ? omp_get_max_threads() : 1, kInterleaveRows);
#pragma omp parallel if (parallel)
    {
        // Prepared at the first range this thread takes: a thread that finds no work left (it
        // woke after the others took every group) skips it.
        PreparedRow row;
        ranges.Run(omp_get_thread_num(), [&](int64_t n0, int64_t n1) {
            if (row.tail_x == nullptr) row = PrepareRow(x, w, int16, n > whole);
            const int64_t end = std::min(n1, whole);
#if defined(__x86_64__)
            if (n0 < end && int16) {
                matmul_internal::MatMulInterleavedInt16Avx512(row.xi, w, n0 / kInterleaveRows,
                                                              end / kInterleaveRows, y);
            } else if (n0 < end) {
                matmul_internal::MatMulInterleavedAvx512(x, row.sums, w, n0 / kInterleaveRows,
                                                         end / kInterleaveRows, y);
            }
#else
            KV_CHECK(n0 >= end) << "no interleaved kernel off x86-64";
#endif
            if (n1 > whole) {
                MatMulRowsIsa(KernelIsa::kAvx512, row.tail_x, 1, w, std::max(n0, whole), n1, y,
                              nullptr);
            }
        });
    }
}

// Panels of weight rows, one per work item of the calling thread's OpenMP team: each thread
// dequantizes its panel into its own scratch and multiplies it with a single-threaded sgemm
// (OpenBLAS runs one thread: its own pool would fight the team for the cores).
void MatMulPanels(KernelIsa isa, const float* x, int64_t m, const StoredMatrix& w, float* y) {
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    const int64_t row_floats_bytes = k * static_cast<int64_t>(sizeof(float));
    const int64_t threads = std::max(1, omp_get_max_threads());
    // At most the panel bound, and small enough that every thread gets a share.
    const int64_t share = ((n + threads - 1) / threads + kChunkRows - 1) / kChunkRows * kChunkRows;
    const int64_t panel_rows = std::clamp<int64_t>(
        std::min<int64_t>(static_cast<int64_t>(kMaxPanelBytes) / row_floats_bytes, share), 1, n);
    const int64_t panels = (n + panel_rows - 1) / panel_rows;
    const bool direct = w.dtype == DType::kF32 && reinterpret_cast<uintptr_t>(w.data) % 4 == 0;
    if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
#pragma omp parallel for schedule(dynamic, 1) if (panels > 1 && m * n * k >= kMinParallelMacs)
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t p0 = p * panel_rows;
        const int64_t rows = std::min(panel_rows, n - p0);
        const float* panel;
        if (direct) {
            panel = reinterpret_cast<const float*>(w.data) + p0 * k;
        } else {
            float* scratch =
                ThreadScratch<Scratch::kPanel, float>(static_cast<size_t>(panel_rows * k));
            DequantizeRows(isa, w, p0, p0 + rows, scratch);
            panel = scratch;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
                    static_cast<blasint>(rows), static_cast<blasint>(k), 1.0f, x,
                    static_cast<blasint>(k), panel, static_cast<blasint>(k), 0.0f, y + p0,
                    static_cast<blasint>(n));
    }
}

}  // namespace

std::string_view KernelIsaName(KernelIsa isa) {
    switch (isa) {
        case KernelIsa::kPortable:
            return "portable";
        case KernelIsa::kAvx2:
            return "avx2";
        case KernelIsa::kAvx512:
            return "avx512";
    }
    return "?";
}

KernelIsa DetectedKernelIsa() {
    static const KernelIsa detected = Detect();
    return detected;
}

KernelIsa ActiveKernelIsa() {
    const KernelIsa detected = DetectedKernelIsa();
    const int forced = g_forced_isa.load(std::memory_order_relaxed);
    if (forced == kNotForced) return detected;
    // The ISAs are ordered: a pinned one the CPU lacks falls back to the best it has.
    return static_cast<KernelIsa>(std::min(forced, static_cast<int>(detected)));
}

void ForceKernelIsa(KernelIsa isa) {
    g_forced_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

void ResetKernelIsa() { g_forced_isa.store(kNotForced, std::memory_order_relaxed); }

std::string_view ActivationFormatName(ActivationFormat format) {
    switch (format) {
        case ActivationFormat::kFp32:
            return "fp32";
        case ActivationFormat::kInt16:
            return "int16";
        case ActivationFormat::kInt8:
            return "int8";
    }
    return "?";
}

ActivationFormat ActiveActivationFormat() {
    const int forced = g_forced_activations.load(std::memory_order_relaxed);
    return forced == kNotForced ? DefaultActivationFormat() : static_cast<ActivationFormat>(forced);
}

void ForceActivationFormat(ActivationFormat format) {
    g_forced_activations.store(static_cast<int>(format), std::memory_order_relaxed);
}

void ResetActivationFormat() { g_forced_activations.store(kNotForced, std::memory_order_relaxed); }

bool QuantizesActivations(DType dtype) {
    return HasInt8Kernel(dtype) && ActiveActivationFormat() == ActivationFormat::kInt8;
}

bool UsesInt8Kernels(DType dtype, int64_t m) {
    return m <= kMaxInt8KernelRows && QuantizesActivations(dtype) &&
           ActiveKernelIsa() != KernelIsa::kPortable;
}

namespace {

// Whether the active ISA multiplies a row by an interleaved copy of `dtype` weights.
bool HasInterleavedKernel(DType dtype) {
    return (dtype == DType::kQ4_1 || dtype == DType::kQ8_0) &&
           ActiveKernelIsa() == KernelIsa::kAvx512;
}

}  // namespace

bool RoundsToInt16(DType dtype) {
    return dtype == DType::kQ4_1 && HasInterleavedKernel(dtype) &&
           ActiveActivationFormat() == ActivationFormat::kInt16 && HasAvx512Vnni();
}

size_t InterleavedBytes(const StoredMatrix& w) {
    if (!HasInterleavedKernel(w.dtype) || w.cols % kBlockElements32 != 0) return 0;
    return static_cast<size_t>(w.rows / kInterleaveRows * kInterleaveRows) *
           RowBytes(w.dtype, w.cols);
}

void InterleaveRows(const StoredMatrix& w, uint8_t* out) {
    KV_CHECK((w.dtype == DType::kQ4_1 || w.dtype == DType::kQ8_0) && w.cols % kBlockElements32 == 0)
        << DTypeName(w.dtype);
    // A block: the fp16 scale (and Q4_1's fp16 min), then the quant bytes (Q4_1: 16 bytes of
    // nibbles, Q8_0: 32 signed bytes).
    const int64_t halves = w.dtype == DType::kQ4_1 ? 2 : 1;
    const int64_t quant_bytes = w.dtype == DType::kQ4_1 ? 16 : 32;
    const int64_t block_bytes = 2 * halves + quant_bytes;
    const size_t row_bytes = RowBytes(w.dtype, w.cols);
    const int64_t blocks = w.cols / kBlockElements32;
    const int64_t groups = w.rows / kInterleaveRows;
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t* o = out + (g * blocks + b) * kInterleaveRows * block_bytes;
            uint8_t* quants = o + 2 * halves * kInterleaveRows;
            for (int64_t r = 0; r < kInterleaveRows; ++r) {
                const uint8_t* src =
                    w.data + (g * kInterleaveRows + r) * row_bytes + b * block_bytes;
                for (int64_t h = 0; h < halves; ++h) {
                    std::memcpy(o + 2 * (h * kInterleaveRows + r), src + 2 * h, 2);
                }
                // Unit t (32 bytes): quant bytes 2t and 2t + 1 of each of the 16 rows.
                for (int64_t t = 0; t < quant_bytes / 2; ++t) {
                    std::memcpy(quants + 2 * (kInterleaveRows * t + r), src + 2 * halves + 2 * t, 2);
                }
            }
        }
    }
}

void MatMulStored(const float* x, int64_t m, const StoredMatrix& w, float* y) {
    constexpr int64_t kMaxBlasInt = std::numeric_limits<blasint>::max();
    KV_CHECK(m >= 1 && w.rows >= 0 && w.cols >= 0 && m <= kMaxBlasInt && w.rows <= kMaxBlasInt &&
             w.cols <= kMaxBlasInt)
        << "m=" << m << " n=" << w.rows << " k=" << w.cols;
    KV_CHECK(w.cols % BlockElements(w.dtype) == 0)
        << DTypeName(w.dtype) << " matrix of " << w.cols << " columns";
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    if (n == 0) return;
    if (k == 0) {
        std::fill(y, y + m * n, 0.0f);
        return;
    }
    const KernelIsa isa = ActiveKernelIsa();
    if (m == 1 && w.interleaved != nullptr && HasInterleavedKernel(w.dtype) &&
        !QuantizesActivations(w.dtype)) {
        return MatMulInterleaved(x, w, y);
    }
#if defined(__x86_64__)
    if (RoundsToInt16(w.dtype)) {
        // Any other product of a row that int16 rounds (batches, prefill, no copy): the same
        // rounded values for the fp32 kernels, so a row's product is the same in any batch.
        float* rounded = ThreadScratch<Scratch::kRounded, float>(static_cast<size_t>(m * k));
        matmul_internal::RoundRowsInt16Avx512(x, m * k, rounded);
        x = rounded;
    }
#endif
    if (UsesInt8Kernels(w.dtype, m)) {
        return MatMulInt8(isa, x, m, w, y);
    }
    if (QuantizesActivations(w.dtype)) {
        // Larger m, or the portable ISA: the same 8-bit activations, rounded back to fp32 for
        // the fp32 kernels, so that a row's product does not depend on the batch it came in.
        float* rounded = ThreadScratch<Scratch::kRounded, float>(static_cast<size_t>(m * k));
        for (int64_t b = 0; b < m * k / matmul_internal::kInt8Block; ++b) {
            matmul_internal::RoundTripBlock32(x + b * matmul_internal::kInt8Block,
                                              rounded + b * matmul_internal::kInt8Block);
        }
        x = rounded;
    }
    if (gemm_bf16::UsesGemmBf16(isa, w.dtype, m)) {
        // Prefill-sized products in bf16 when chosen (kernels/cpu_gemm_bf16.h).
        gemm_bf16::GemmBf16(x, m, w, y);
    } else if (gemm::UsesGemm(isa, w.dtype, m)) {
        // Batched decode (kernels/cpu_gemm.h): each weight strip dequantized once for all rows.
        gemm::GemmAvx512(x, m, w, y);
    } else if (w.dtype == DType::kF32 || m > kMaxTiledRows) {
        // F32 rows go to sgemm as they are (unaligned ones through a panel copy).
        MatMulPanels(isa, x, m, w, y);
    } else if (m <= kMaxTiledRows) {
        MatMulTiled(HasSimdKernel(w.dtype) ? isa : KernelIsa::kPortable, x, m, w, y);
    }
}

void EmbeddingRows(const StoredMatrix& table, int64_t row_offset, const int32_t* ids, int64_t n,
                   float* out) {
    const int64_t cols = table.cols;
    const KernelIsa isa = ActiveKernelIsa();
#pragma omp parallel for schedule(static) if (n * cols >= kMinParallelMacs)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = static_cast<int64_t>(ids[i]) - row_offset;
        float* o = out + i * cols;
        if (r < 0 || r >= table.rows) {
            std::fill(o, o + cols, 0.0f);
        } else {
            DequantizeRows(isa, table, r, r + 1, o);
        }
    }
}

}  // namespace kvshard::cpu
