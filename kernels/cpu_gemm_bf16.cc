// The bf16 prefill product of kernels/cpu_gemm_bf16.h (AMX-BF16 tiles, else AVX512-BF16
// registers). Compiled for any x86-64 target: every function that uses AVX-512 or AMX carries the
// target attribute, and kernels/cpu_matmul.cc calls GemmBf16 only after cpuid and xgetbv said the
// CPU and the OS support it (UsesGemmBf16; AMX also after Linux granted the tile data).
#include "kernels/cpu_gemm_bf16.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "common/check.h"
#include "kernels/cpu_matmul_batch_copy.h"
#include "kernels/cpu_matmul_internal.h"

#if defined(__x86_64__)
// GCC 12 reports the deliberately undefined pass-through operand of many AVX-512 intrinsics as
// uninitialized once they are inlined (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <cpuid.h>
#include <immintrin.h>
#define KV_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define KV_AMX                                                                    \
    __attribute__((                                                               \
        target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile," \
               "amx-bf16")))
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvshard::cpu::gemm_bf16 {
namespace {

constexpr int kNotPinned = -1;
std::atomic<int> g_pinned{kNotPinned};
std::atomic<int> g_pinned_unit{kNotPinned};

PrefillMode EnvironmentMode() {
    static const PrefillMode mode = [] {
        std::string warning;
        const PrefillMode m =
            PrefillModeFromSetting(std::getenv("KVSHARD_MATMUL_PREFILL"), &warning);
        if (!warning.empty()) std::fprintf(stderr, "kvshard: %s\n", warning.c_str());
        if (m == PrefillMode::kBf16 && !CpuHasAvx512Bf16()) {
            std::fprintf(stderr,
                         "kvshard: KVSHARD_MATMUL_PREFILL=bf16 needs AVX512-BF16, which this CPU "
                         "lacks; prefill products stay fp32\n");
        }
        return m;
    }();
    return mode;
}

#if defined(__x86_64__)
bool DetectAvx512Bf16() {
    if (DetectedKernelIsa() != KernelIsa::kAvx512) return false;  // also checks the OS's zmm state
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    unsigned eax, ebx, ecx, edx;
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    return (eax & (1u << 5)) != 0;
}

// AMX-TILE and AMX-BF16 (cpuid leaf 7: edx bits 24 and 22), the OS's tile state in XCR0 (bits 17
// and 18), and Linux's permission for this process to use the tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; asked once, it holds for every thread).
bool DetectAmxBf16() {
#if defined(__linux__)
    if (!DetectAvx512Bf16()) return false;
    unsigned eax, ebx, ecx, edx;
    __cpuid_count(7, 0, eax, ebx, ecx, edx);
    if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return false;
    uint32_t xcr0_lo;
    uint32_t xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
}
#else
bool DetectAvx512Bf16() { return false; }
bool DetectAmxBf16() { return false; }
#endif

}  // namespace

std::string_view PrefillModeName(PrefillMode mode) {
    switch (mode) {
        case PrefillMode::kFp32:
            return "fp32";
        case PrefillMode::kBf16:
            return "bf16";
    }
    return "?";
}

PrefillMode PrefillModeFromSetting(const char* value, std::string* warning) {
    warning->clear();
    if (value == nullptr) return kDefaultPrefillMode;
    const std::string_view v(value);
    if (v == "fp32") return PrefillMode::kFp32;
    if (v == "bf16") return PrefillMode::kBf16;
    *warning = "KVSHARD_MATMUL_PREFILL=" + std::string(v) + " is not fp32 or bf16; using " +
               std::string(PrefillModeName(kDefaultPrefillMode));
    return kDefaultPrefillMode;
}

PrefillMode ActivePrefillMode() {
    const int pinned = g_pinned.load(std::memory_order_relaxed);
    return pinned == kNotPinned ? EnvironmentMode() : static_cast<PrefillMode>(pinned);
}

void ForcePrefillMode(PrefillMode mode) {
    g_pinned.store(static_cast<int>(mode), std::memory_order_relaxed);
}

void ResetPrefillMode() { g_pinned.store(kNotPinned, std::memory_order_relaxed); }

bool CpuHasAvx512Bf16() {
    static const bool has = DetectAvx512Bf16();
    return has;
}

bool CpuHasAmxBf16() {
    static const bool has = DetectAmxBf16();
    return has;
}

std::string_view Bf16UnitName(Bf16Unit unit) {
    switch (unit) {
        case Bf16Unit::kAvx512Bf16:
            return "avx512bf16";
        case Bf16Unit::kAmx:
            return "amx";
    }
    return "?";
}

Bf16Unit ActiveBf16Unit() {
    const Bf16Unit best = CpuHasAmxBf16() ? Bf16Unit::kAmx : Bf16Unit::kAvx512Bf16;
    const int pinned = g_pinned_unit.load(std::memory_order_relaxed);
    if (pinned == kNotPinned) return best;
    return static_cast<Bf16Unit>(std::min(pinned, static_cast<int>(best)));
}

void ForceBf16Unit(Bf16Unit unit) {
    g_pinned_unit.store(static_cast<int>(unit), std::memory_order_relaxed);
}

void ResetBf16Unit() { g_pinned_unit.store(kNotPinned, std::memory_order_relaxed); }

bool GemmBf16Reads(DType dtype) {
    return dtype != DType::kF32 && matmul_internal::HasSimdKernel(dtype);
}

bool UsesGemmBf16(KernelIsa isa, DType dtype, int64_t m) {
    return m >= kMinBf16Rows && isa == KernelIsa::kAvx512 && GemmBf16Reads(dtype) &&
           ActivePrefillMode() == PrefillMode::kBf16 && CpuHasAvx512Bf16();
}

#if defined(__x86_64__)
namespace {

constexpr int64_t kLanes = 16;
// Activation rows of a tile: 12 rows × 2 zmm of weight rows = 24 accumulators, with the two
// weight operands and a broadcast 27 of the 32 zmm registers.
constexpr int kTileRows = 12;
// Elements of a zmm of bf16: k is padded to a multiple of it (zeros in x and w).
constexpr int64_t kBf16PerZmm = 32;
// Below this many multiply-adds a product runs on the calling thread (as in cpu_matmul.cc).
constexpr int64_t kMinParallelMacs = int64_t{1} << 18;

// 64-byte aligned room for `count` T, kept by the calling thread between calls; one per Use.
enum class Use { kActivations, kRow, kStripF32, kStripBf16, kPacked };
template <Use U, typename T>
T* Scratch(size_t count) {
    thread_local std::vector<uint8_t> buffer;
    const size_t bytes = count * sizeof(T) + 64;
    if (buffer.size() < bytes) buffer.resize(bytes);
    uint8_t* p = buffer.data();
    return reinterpret_cast<T*>(p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64);
}

__mmask16 LowLanes(int64_t count) {
    return count >= kLanes ? __mmask16{0xFFFF}
           : count <= 0    ? __mmask16{0}
                           : static_cast<__mmask16>((1u << count) - 1);
}

// out[0, kpad) = bf16(x[0, k)) (round to nearest even), then zeros. REQUIRES: kpad the multiple
// of kBf16PerZmm at or above k.
KV_BF16 void RoundRow(const float* x, int64_t k, int64_t kpad, uint16_t* out) {
    for (int64_t p = 0; p < kpad; p += kBf16PerZmm) {
        const __m512 lo = _mm512_maskz_loadu_ps(LowLanes(k - p), x + p);
        const __m512 hi = _mm512_maskz_loadu_ps(LowLanes(k - p - kLanes), x + p + kLanes);
        _mm512_storeu_si512(out + p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
}

// Weight rows [j0, j0 + kBf16StripRows) of w (rows at or past n as zeros) in the strip layout:
// pair p at packed + p * kBf16StripRows dwords, dword r holding (bf16 w[j0 + r, 2p],
// bf16 w[j0 + r, 2p + 1]). Half h (rows 16h .. 16h + 15) is dequantized into rows_f32 (16 × k),
// rounded into rows_bf16 (16 × kpad) and gathered a pair at a time.
KV_BF16 void PackStrip(const StoredMatrix& w, int64_t j0, int64_t kpad, float* rows_f32,
                       uint16_t* rows_bf16, uint32_t* packed) {
    const int64_t k = w.cols;
    const int64_t kp = kpad / 2;
    const __m512i index =
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32(static_cast<int>(kp)));
    for (int64_t h = 0; h < kBf16StripRows / kLanes; ++h) {
        const int64_t r0 = j0 + h * kLanes;
        const int64_t rows = std::clamp<int64_t>(w.rows - r0, 0, kLanes);
        if (rows > 0) matmul_internal::DequantizeRowsPreferCopyAvx512(w, r0, r0 + rows, rows_f32);
        for (int64_t r = 0; r < rows; ++r)
            RoundRow(rows_f32 + r * k, k, kpad, rows_bf16 + r * kpad);
        if (rows < kLanes) {
            std::memset(rows_bf16 + rows * kpad, 0,
                        static_cast<size_t>((kLanes - rows) * kpad) * sizeof(uint16_t));
        }
        const auto* base = reinterpret_cast<const int*>(rows_bf16);
        for (int64_t p = 0; p < kp; ++p) {
            _mm512_store_si512(packed + p * kBf16StripRows + h * kLanes,
                               _mm512_i32gather_epi32(index, base + p, 4));
        }
    }
}

// y[j, c] for the tile's J activation rows j (xt: pair p of row j at xt[p * J + j]) and the
// strip's columns c < 32 (stores masked by m0, m1 for columns 0-15, 16-31; y rows of stride ldy):
// the fp32 sum over p of the pair products, in order of p, from zero.
template <int J>
KV_BF16 inline __attribute__((always_inline)) void Tile(const uint32_t* xt, const uint32_t* packed,
                                                        int64_t kp, float* y, int64_t ldy,
                                                        __mmask16 m0, __mmask16 m1) {
    __m512 acc[J][2];
#pragma GCC unroll 12
    for (int j = 0; j < J; ++j) {
        acc[j][0] = _mm512_setzero_ps();
        acc[j][1] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < kp; ++p) {
        const auto b0 = reinterpret_cast<__m512bh>(_mm512_load_si512(packed + p * kBf16StripRows));
        const auto b1 =
            reinterpret_cast<__m512bh>(_mm512_load_si512(packed + p * kBf16StripRows + kLanes));
#pragma GCC unroll 12
        for (int j = 0; j < J; ++j) {
            const auto a =
                reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xt[p * J + j])));
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], a, b0);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], a, b1);
        }
    }
#pragma GCC unroll 12
    for (int j = 0; j < J; ++j) {
        _mm512_mask_storeu_ps(y + j * ldy, m0, acc[j][0]);
        _mm512_mask_storeu_ps(y + j * ldy + kLanes, m1, acc[j][1]);
    }
}

template <int... Js>
KV_BF16 void TileOf(int rows, const uint32_t* xt, const uint32_t* packed, int64_t kp, float* y,
                    int64_t ldy, __mmask16 m0, __mmask16 m1,
                    std::integer_sequence<int, Js...> /*unused*/) {
    // One instantiation per tile height 1 .. kTileRows (the last tile of a product may be short).
    ((rows == Js + 1 ? Tile<Js + 1>(xt, packed, kp, y, ldy, m0, m1) : void()), ...);
}

// The vdpbf16ps kernel (Bf16Unit::kAvx512Bf16).
KV_BF16 void GemmVdpbf16ps(const float* x, int64_t m, const StoredMatrix& w, float* y) {
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    const int64_t kpad = (k + kBf16PerZmm - 1) / kBf16PerZmm * kBf16PerZmm;
    const int64_t kp = kpad / 2;
    const int64_t tiles = (m + kTileRows - 1) / kTileRows;
    const int64_t strips = (n + kBf16StripRows - 1) / kBf16StripRows;
    // The activations in tiles: tile t (rows 12t .. 12t + J - 1) at t * 12 * kp dwords, pair p of
    // its row j at p * J + j: a tile's broadcasts walk one stream.
    auto* xt = Scratch<Use::kActivations, uint32_t>(static_cast<size_t>(tiles * kTileRows * kp));
    const bool parallel = strips > 1 && m * n * k >= kMinParallelMacs;
#pragma omp parallel if (parallel)
    {
        auto* row = Scratch<Use::kRow, uint16_t>(static_cast<size_t>(kpad));
        const auto* row_pairs = reinterpret_cast<const uint32_t*>(row);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t rows = std::min<int64_t>(kTileRows, m - t * kTileRows);
            uint32_t* tile = xt + t * kTileRows * kp;
            for (int64_t j = 0; j < rows; ++j) {
                RoundRow(x + (t * kTileRows + j) * k, k, kpad, row);
                for (int64_t p = 0; p < kp; ++p) tile[p * rows + j] = row_pairs[p];
            }
        }
        // (The loop's closing barrier publishes the activations to the team.)
        auto* rows_f32 = Scratch<Use::kStripF32, float>(static_cast<size_t>(kLanes * k));
        auto* rows_bf16 = Scratch<Use::kStripBf16, uint16_t>(static_cast<size_t>(kLanes * kpad));
        auto* packed = Scratch<Use::kPacked, uint32_t>(static_cast<size_t>(kBf16StripRows * kp));
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t s = 0; s < strips; ++s) {
            const int64_t j0 = s * kBf16StripRows;
            const __mmask16 m0 = LowLanes(n - j0);
            const __mmask16 m1 = LowLanes(n - j0 - kLanes);
            PackStrip(w, j0, kpad, rows_f32, rows_bf16, packed);
            for (int64_t t = 0; t < tiles; ++t) {
                const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - t * kTileRows));
                TileOf(rows, xt + t * kTileRows * kp, packed, kp, y + t * kTileRows * n + j0, n, m0,
                       m1, std::make_integer_sequence<int, kTileRows>{});
            }
        }
    }
}

// The AMX tile configuration of GemmAmx: palette 1, eight tiles of 16 rows × 64 bytes (tmm0-3
// the 2 × 2 fp32 accumulators of 32 activation rows × 32 weight rows, tmm4-5 the activation rows'
// 16 × 32 bf16, tmm6-7 the strip's two halves, 16 pairs × 16 weight rows).
struct alignas(64) TileConfig {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// The tdpbf16ps kernel (Bf16Unit::kAmx): the activations rounded once into row-major bf16 rows
// (padded with zeros to a multiple of 32 rows and of kBf16PerZmm columns), which are the A tiles
// as they lie; the strip of PackStrip is the B tiles' layout (16 pairs × 16 dwords, rows 128
// bytes apart). Each output is the fp32 sum of the pair products in order of k, as in
// GemmVdpbf16ps.
KV_AMX void GemmAmx(const float* x, int64_t m, const StoredMatrix& w, float* y) {
    constexpr int64_t kBlockRows = 2 * kLanes;  // activation rows of the 2 × 2 accumulator tiles
    const int64_t n = w.rows;
    const int64_t k = w.cols;
    const int64_t kpad = (k + kBf16PerZmm - 1) / kBf16PerZmm * kBf16PerZmm;
    const int64_t kp = kpad / 2;
    const int64_t mpad = (m + kBlockRows - 1) / kBlockRows * kBlockRows;
    const int64_t strips = (n + kBf16StripRows - 1) / kBf16StripRows;
    auto* xb = Scratch<Use::kActivations, uint16_t>(static_cast<size_t>(mpad * kpad));
    const bool parallel = strips > 1 && m * n * k >= kMinParallelMacs;
    const int64_t a_stride = kpad * int64_t{sizeof(uint16_t)};
    constexpr int64_t kStripStride = kBf16StripRows * int64_t{sizeof(uint32_t)};
#pragma omp parallel if (parallel)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mpad; ++i) {
            if (i < m) {
                RoundRow(x + i * k, k, kpad, xb + i * kpad);
            } else {
                std::memset(xb + i * kpad, 0, static_cast<size_t>(a_stride));
            }
        }
        // (The loop's closing barrier publishes the activations to the team.)
        auto* rows_f32 = Scratch<Use::kStripF32, float>(static_cast<size_t>(kLanes * k));
        auto* rows_bf16 = Scratch<Use::kStripBf16, uint16_t>(static_cast<size_t>(kLanes * kpad));
        auto* packed = Scratch<Use::kPacked, uint32_t>(static_cast<size_t>(kBf16StripRows * kp));
        alignas(64) float edge[4][kLanes * kLanes];
        const TileConfig config;
        _tile_loadconfig(&config);
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t s = 0; s < strips; ++s) {
            const int64_t j0 = s * kBf16StripRows;
            const int64_t cols = std::min(kBf16StripRows, n - j0);
            PackStrip(w, j0, kpad, rows_f32, rows_bf16, packed);
            for (int64_t i0 = 0; i0 < mpad; i0 += kBlockRows) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t* a = xb + i0 * kpad;
                for (int64_t c = 0; c < kpad; c += kBf16PerZmm) {
                    _tile_loadd(4, a + c, a_stride);
                    _tile_loadd(5, a + kLanes * kpad + c, a_stride);
                    _tile_loadd(6, packed + (c / 2) * kBf16StripRows, kStripStride);
                    _tile_loadd(7, packed + (c / 2) * kBf16StripRows + kLanes, kStripStride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                const int64_t rows = std::min(kBlockRows, m - i0);
                float* out = y + i0 * n + j0;
                const int64_t y_stride = n * int64_t{sizeof(float)};
                if (rows == kBlockRows && cols == kBf16StripRows) {
                    _tile_stored(0, out, y_stride);
                    _tile_stored(1, out + kLanes, y_stride);
                    _tile_stored(2, out + kLanes * n, y_stride);
                    _tile_stored(3, out + kLanes * n + kLanes, y_stride);
                    continue;
                }
                constexpr int64_t kEdgeStride = kLanes * int64_t{sizeof(float)};
                _tile_stored(0, edge[0], kEdgeStride);
                _tile_stored(1, edge[1], kEdgeStride);
                _tile_stored(2, edge[2], kEdgeStride);
                _tile_stored(3, edge[3], kEdgeStride);
                for (int64_t i = 0; i < rows; ++i) {
                    for (int64_t j = 0; j < cols; ++j) {
                        out[i * n + j] =
                            edge[(i / kLanes) * 2 + j / kLanes][(i % kLanes) * kLanes + j % kLanes];
                    }
                }
            }
        }
        _tile_release();
    }
}

}  // namespace

void GemmBf16(const float* x, int64_t m, const StoredMatrix& w, float* y) {
    KV_CHECK(m >= 1 && GemmBf16Reads(w.dtype) && CpuHasAvx512Bf16())
        << "m=" << m << " dtype=" << DTypeName(w.dtype);
    switch (ActiveBf16Unit()) {
        case Bf16Unit::kAmx:
            return GemmAmx(x, m, w, y);
        case Bf16Unit::kAvx512Bf16:
            return GemmVdpbf16ps(x, m, w, y);
    }
}
#else
void GemmBf16(const float*, int64_t, const StoredMatrix&, float*) {
    KV_CHECK(false) << "GemmBf16 on a CPU without AVX512-BF16";
}
#endif

}  // namespace kvshard::cpu::gemm_bf16
