// The host side of the CUDA backend, on the CPU of every build (no device, no CUDA needed): the
// __host__ __device__ index and softmax-merge arithmetic its kernels run (kernels/cuda/
// launch_math.h) against the CPU ops, the bf16 weight packing against the CPU dequantizer, and
// the cuBLASLt algorithm cache's keying (kernels/cuda/weight_pack.h).
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/launch_math.h"
#include "kernels/cuda/weight_pack.h"
#include "kernels/kv_quant.h"
#include "kernels/paged_attention.h"

namespace kvshard::cuda {
namespace {

TEST(CudaLaunchMathTest, AttentionBlocksFitInStaticSharedMemory) {
    for (int64_t hd : {16, 32, 64, 80, 96, 128, 256}) {
        const int qv = QueryVectorsPerPass(hd);
        EXPECT_GE(qv, 8) << hd;
        EXPECT_LE(qv, kAttnMaxQueryVectors) << hd;
        EXPECT_LE(qv * hd, kAttnMaxAccFloats) << hd;
        // Without cudaFuncSetAttribute a block gets 48 KiB, static arrays included (~3 KiB).
        EXPECT_LE(AttentionSharedBytes(hd), 44 * 1024) << hd;
    }
    EXPECT_EQ(QueryVectorsPerPass(128), 16);
    EXPECT_EQ(QueryVectorsPerPass(256), 8);
    EXPECT_EQ(TileRowFloats(128) % 32, 1) << "tile rows must not share a bank";
}

TEST(CudaLaunchMathTest, SplitCountFillsTheMultiprocessorsWithinTheScratch) {
    const int64_t big = int64_t{1} << 40;
    // Batch 1, 8 KV heads on 132 SMs: 264 blocks wanted, 33 splits, capped at kMaxKvSplits.
    EXPECT_EQ(ChooseNumSplits(1, 8, 32, 128, 132, big), kMaxKvSplits);
    // Batch 8: ceil(264 / 64) = 5.
    EXPECT_EQ(ChooseNumSplits(8, 8, 32, 128, 132, big), 5);
    // Batch 64: 512 blocks already cover the SMs twice.
    EXPECT_EQ(ChooseNumSplits(64, 8, 32, 128, 132, big), 1);
    // The scratch holds 3 splits of batch 8 (8 seqs × 32 heads × 130 floats each).
    EXPECT_EQ(ChooseNumSplits(8, 8, 32, 128, 132, 3 * 8 * 32 * 130), 3);
    EXPECT_EQ(ChooseNumSplits(8, 8, 32, 128, 132, 0), 1);
    EXPECT_EQ(ChooseNumSplits(0, 8, 32, 128, 132, big), 1);
    EXPECT_EQ(ChooseNumSplits(2, 2, 4, 64, 0, big), 1);
}

TEST(CudaLaunchMathTest, SplitRangesCoverTheContextInWholeTiles) {
    for (int64_t len : {1, 5, 31, 32, 33, 100, 512, 4097}) {
        for (int splits : {1, 2, 3, 7, 32}) {
            int64_t next = 0;
            for (int s = 0; s < splits; ++s) {
                const KeyRange r = SplitKeyRange(len, splits, s);
                ASSERT_LE(r.begin, r.end);
                if (r.begin == r.end) {
                    EXPECT_EQ(r.begin, len) << "empty ranges only past the end";
                    continue;
                }
                EXPECT_EQ(r.begin, next) << len << " " << splits << " " << s;
                EXPECT_EQ(r.begin % kAttnTileKeys, 0);
                next = r.end;
            }
            EXPECT_EQ(next, len) << len << " " << splits;
        }
    }
}

// The items the attention blocks of one sequence take cover every (row, group head) once for a
// prefill chunk, and every group head once per split for a decode row, within a pass's query
// vectors, each over the keys its rows may see (all of them together for a decode row).
TEST(CudaLaunchMathTest, AttentionItemsCoverEveryRowAndHeadOnce) {
    for (int64_t hd : {16, 64, 128, 256}) {
        const int qv = QueryVectorsPerPass(hd);
        for (int group : {1, 3, 4, 8, 20}) {
            for (int64_t n_rows : {1, 2, 5, 17, 100}) {
                for (int splits : {1, 3, 32}) {
                    const int64_t len = n_rows + 37;
                    const AttnPlan plan = PlanAttention(n_rows, group, qv);
                    std::vector<int> seen(static_cast<size_t>(n_rows * group), 0);
                    std::vector<int64_t> keys_of_head(static_cast<size_t>(group), 0);
                    for (int z = 0; z < splits; ++z) {
                        for (int64_t it = FirstItem(plan, z); it < plan.items;
                             it += ItemStride(plan, splits)) {
                            const AttnItem w = ItemOf(plan, it, n_rows, len, group, splits, z);
                            ASSERT_LE((w.r_end - w.r_begin) * (w.h_end - w.h_begin), qv);
                            ASSERT_LT(w.r_begin, w.r_end);
                            ASSERT_LT(w.h_begin, w.h_end);
                            if (plan.decode) {
                                for (int h = w.h_begin; h < w.h_end; ++h) {
                                    keys_of_head[h] += w.k_end - w.k_begin;
                                }
                            } else {
                                EXPECT_EQ(w.k_begin, 0);
                                EXPECT_EQ(w.k_end, len - n_rows + w.r_end);
                            }
                            for (int64_t r = w.r_begin; r < w.r_end; ++r) {
                                for (int h = w.h_begin; h < w.h_end; ++h) ++seen[r * group + h];
                            }
                        }
                    }
                    const int want = plan.decode ? splits : 1;
                    for (int c : seen) ASSERT_EQ(c, want) << hd << " " << group << " " << n_rows;
                    if (plan.decode) {
                        for (int64_t k : keys_of_head) EXPECT_EQ(k, len);
                    }
                }
            }
        }
    }
}

// A sliding window: a decode row's splits cover exactly its window's keys; a prefill item starts
// at its first row's window and every row's keys are the CPU's (p - window, p].
TEST(CudaLaunchMathTest, WindowedItemsCoverEachRowsWindow) {
    EXPECT_EQ(WindowStart(10, 0), 0);
    EXPECT_EQ(WindowStart(10, 4), 7);
    EXPECT_EQ(WindowStart(2, 4), 0);
    for (int64_t pos : {0, 3, 9, 40}) {
        for (int64_t window : {0, 1, 4, 32}) {
            for (int64_t key = 0; key <= pos + 2; ++key) {
                const bool cpu = key <= pos && (window == 0 || key > pos - window);
                EXPECT_EQ(KeyVisible(key, pos, window), cpu) << key << " " << pos << " " << window;
            }
        }
    }
    for (int64_t window : {1, 5, 32, 100, 600}) {
        for (int64_t len : {1, 7, 64, 301, 1000}) {
            for (int splits : {1, 3, 32}) {
                // Decode: every key of the window once, no key before it.
                const AttnPlan d = PlanAttention(1, 4, 16);
                std::vector<int> seen(static_cast<size_t>(len), 0);
                for (int z = 0; z < splits; ++z) {
                    const AttnItem w = ItemOf(d, 0, 1, len, 4, splits, z, window);
                    for (int64_t t = w.k_begin; t < w.k_end; ++t) ++seen[t];
                }
                for (int64_t t = 0; t < len; ++t) {
                    ASSERT_EQ(seen[t], t >= len - window ? 1 : 0)
                        << "window " << window << " len " << len << " splits " << splits << " key " << t;
                }
            }
            // Prefill: an item's keys hold every visible key of each of its rows.
            const int64_t n_rows = std::min<int64_t>(len, 45);
            const AttnPlan p = PlanAttention(n_rows, 2, 16);
            for (int64_t it = 0; it < p.items; ++it) {
                const AttnItem w = ItemOf(p, it, n_rows, len, 2, 3, 0, window);
                EXPECT_EQ(w.k_begin, WindowStart(len - n_rows + w.r_begin, window));
                for (int64_t r = w.r_begin; r < w.r_end; ++r) {
                    const int64_t pos = len - n_rows + r;
                    EXPECT_LE(w.k_begin, WindowStart(pos, window));
                    EXPECT_GE(w.k_end, pos + 1);
                }
            }
        }
    }
}

TEST(CudaLaunchMathTest, KvOffsetsAddressWhatTheCpuWrites) {
    for (KvDtype storage :
         {KvDtype::kFp32, KvDtype::kInt8, KvDtype::kFp8, KvDtype::kBf16, KvDtype::kFp16}) {
        const int64_t bs = 4, kv_heads = 3, hd = 8, layers = 2, blocks = 6;
        const int64_t block_bytes = layers * cpu::PagedLayerBytes(storage, bs, kv_heads, hd);
        std::vector<uint8_t> pool(static_cast<size_t>(blocks * block_bytes));
        const cpu::PagedKvLayer kv =
            cpu::MakePagedKvLayer(pool.data(), block_bytes, 1, storage, bs, kv_heads, hd);
        const std::vector<int64_t> slots = {5 * bs + 3, 0, 2 * bs + 1};
        std::mt19937 rng(4);
        std::uniform_real_distribution<float> u(-2.0f, 2.0f);
        std::vector<float> k(slots.size() * kv_heads * hd), v(k.size());
        for (float& x : k) x = u(rng);
        for (float& x : v) x = u(rng);
        cpu::PagedKvWrite(kv, k.data(), v.data(), kv_heads * hd, slots.data(), int64_t(slots.size()));
        const int64_t eb = KvElementBytes(storage);
        ASSERT_EQ(eb, KvDtypeBytes(storage));
        for (size_t i = 0; i < slots.size(); ++i) {
            for (int64_t h = 0; h < kv_heads; ++h) {
                for (int pass = 0; pass < 2; ++pass) {
                    const float* src = (pass == 0 ? k : v).data() + i * kv_heads * hd + h * hd;
                    const int64_t data_off = pass == 0 ? kv.k_offset : kv.v_offset;
                    float scale = 1.0f;
                    if (KvPoolHasScales(storage)) {
                        std::memcpy(&scale,
                                    &pool[KvScaleOffset(block_bytes,
                                                        pass == 0 ? kv.k_scale_offset
                                                                  : kv.v_scale_offset,
                                                        bs, slots[i], h)],
                                    4);
                    }
                    for (int64_t d = 0; d < hd; ++d) {
                        const uint8_t* p =
                            &pool[KvElementOffset(block_bytes, data_off, bs, hd, eb, slots[i], h, d)];
                        float got;
                        if (storage == KvDtype::kFp32) {
                            std::memcpy(&got, p, 4);
                            EXPECT_EQ(got, src[d]);
                            continue;
                        }
                        if (storage == KvDtype::kBf16 || storage == KvDtype::kFp16) {
                            uint16_t bits;
                            std::memcpy(&bits, p, 2);
                            const bool bf16 = storage == KvDtype::kBf16;
                            // The device's encoding of the value is what the CPU stored, and
                            // decodes to the CPU's rounding of it.
                            EXPECT_EQ(bits, bf16 ? Bf16Encode(src[d]) : Fp16Encode(src[d]));
                            EXPECT_EQ(bf16 ? Bf16Decode(bits) : Fp16Decode(bits),
                                      bf16 ? BF16ToFloat(FloatToBF16(src[d]))
                                           : HalfToFloat(FloatToHalf(src[d])));
                            continue;
                        }
                        got = storage == KvDtype::kInt8 ? float(int8_t(*p)) * scale
                                                        : Fp8E4M3Decode(*p) * scale;
                        EXPECT_NEAR(got, src[d], 2.0f * 2.0f / 16.0f) << int(storage);
                    }
                }
            }
        }
    }
    const int32_t table[] = {7, 2, 9};
    EXPECT_EQ(SlotOfPosition(table, 16, 0), 7 * 16);
    EXPECT_EQ(SlotOfPosition(table, 16, 17), 2 * 16 + 1);
    EXPECT_EQ(SlotOfPosition(table, 16, 47), 9 * 16 + 15);
}

// Split partial results merged by log-sum-exp equal the softmax over all keys at once, and
// empty splits change nothing.
TEST(CudaLaunchMathTest, LogSumExpMergeEqualsOneSoftmax) {
    std::mt19937 rng(9);
    std::normal_distribution<float> n(0.0f, 3.0f);
    const int64_t len = 77, hd = 5;
    std::vector<float> scores(len), values(len * hd);
    for (float& s : scores) s = n(rng);
    for (float& x : values) x = n(rng);
    std::vector<double> want(hd, 0.0);
    double mx = -1e300, den = 0;
    for (float s : scores) mx = std::max(mx, double(s));
    for (int64_t t = 0; t < len; ++t) {
        const double w = std::exp(double(scores[t]) - mx);
        den += w;
        for (int64_t d = 0; d < hd; ++d) want[d] += w * values[t * hd + d];
    }
    for (double& x : want) x /= den;
    for (int splits : {1, 2, 3, 8}) {
        std::vector<std::vector<float>> recs(splits, std::vector<float>(2 + hd, 0.0f));
        for (int s = 0; s < splits; ++s) {
            const KeyRange r = SplitKeyRange(len, splits, s);
            float m = -INFINITY;
            for (int64_t t = r.begin; t < r.end; ++t) m = std::max(m, scores[t]);
            recs[s][0] = m;
            for (int64_t t = r.begin; t < r.end; ++t) {
                const float w = std::exp(scores[t] - m);
                recs[s][1] += w;
                for (int64_t d = 0; d < hd; ++d) recs[s][2 + d] += w * values[t * hd + d];
            }
        }
        auto at = [&](int s) { return recs[s].data(); };
        for (int64_t d = 0; d < hd; ++d) {
            EXPECT_NEAR(MergedValue(splits, at, d), want[d], 1e-5 * (1 + std::fabs(want[d])))
                << splits << " splits, d=" << d;
        }
    }
    std::vector<float> empty = {-INFINITY, 0.0f, 0.0f};
    EXPECT_EQ(MergedValue(1, [&](int) { return empty.data(); }, 0), 0.0f);
}

TEST(CudaLaunchMathTest, Fp8AndInt8EncodingsMatchTheCpu) {
    for (int v = 0; v < 256; ++v) {
        const float want = cpu::Fp8E4M3ToFloat(uint8_t(v));
        const float got = Fp8E4M3Decode(uint8_t(v));
        if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(got)) << v;
        } else {
            EXPECT_EQ(got, want) << v;
        }
    }
    std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 448.0f, 449.0f, 1e6f, -1e6f,
                             std::ldexp(1.0f, -9), std::ldexp(1.0f, -10), std::ldexp(3.0f, -11),
                             0.0625f * 1.0625f, 240.0f, 232.0f, 17.0f, 1.1875f,
                             std::numeric_limits<float>::quiet_NaN()};
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> e(-12.0f, 9.5f);
    for (int i = 0; i < 20000; ++i) {
        xs.push_back((i % 2 ? -1.0f : 1.0f) * std::exp2(e(rng)));
    }
    for (float x : xs) EXPECT_EQ(Fp8E4M3Encode(x), cpu::FloatToFp8E4M3(x)) << x;

    std::uniform_real_distribution<float> u(-3.0f, 3.0f);
    std::vector<float> row(64);
    for (float& x : row) x = u(rng);
    std::vector<int8_t> q(row.size());
    const float scale = cpu::QuantizeInt8(row.data(), int64_t(row.size()), q.data());
    float amax = 0;
    for (float x : row) amax = std::fmax(amax, std::fabs(x));
    ASSERT_EQ(scale, amax / 127.0f);
    for (size_t i = 0; i < row.size(); ++i) EXPECT_EQ(Int8Encode(row[i], 1.0f / scale), q[i]) << i;
}

// The 16-bit KV encodings the device kernels run equal common/dtype.h's (the CPU pool's values):
// every fp16 and bf16 code decodes exactly, and encoding rounds to nearest even across every
// binade, subnormals, halfway cases, overflow, infinities and NaN.
TEST(CudaLaunchMathTest, SixteenBitKvEncodingsMatchTheCpu) {
    for (uint32_t v = 0; v < 65536; ++v) {
        const uint16_t h = static_cast<uint16_t>(v);
        const float want_half = HalfToFloat(h), want_bf16 = BF16ToFloat(h);
        if (std::isnan(want_half)) {
            EXPECT_TRUE(std::isnan(Fp16Decode(h))) << v;
        } else {
            EXPECT_EQ(Fp16Decode(h), want_half) << v;
            EXPECT_EQ(std::signbit(Fp16Decode(h)), std::signbit(want_half)) << v;
        }
        if (std::isnan(want_bf16)) {
            EXPECT_TRUE(std::isnan(Bf16Decode(h))) << v;
        } else {
            EXPECT_EQ(Bf16Decode(h), want_bf16) << v;
        }
    }
    std::vector<float> xs = {0.0f,
                             -0.0f,
                             1.0f,
                             -1.0f,
                             65504.0f,
                             65519.0f,
                             65520.0f,
                             1e30f,
                             std::ldexp(1.0f, -24),
                             std::ldexp(1.0f, -25),
                             std::ldexp(3.0f, -26),
                             std::ldexp(1.0f, -14),
                             std::ldexp(1023.0f, -24),
                             1.0f + 0x1p-11f,
                             1.0f + 0x1p-8f,
                             1.0f + 3 * 0x1p-8f,
                             std::ldexp(1.0f, -130),
                             std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::quiet_NaN()};
    std::mt19937 rng(11);
    for (int i = 0; i < 200000; ++i) {
        uint32_t bits = rng();
        float x;
        std::memcpy(&x, &bits, 4);
        xs.push_back(x);  // every class of float, uniformly over bit patterns
    }
    for (float x : xs) {
        EXPECT_EQ(Bf16Encode(x), FloatToBF16(x)) << x;
        EXPECT_EQ(Fp16Encode(x), FloatToHalf(x)) << x;
    }
}

TEST(CudaLaunchMathTest, Bf16PackingFollowsTheCpuDequantizer) {
    for (DType dtype : {DType::kF16, DType::kQ8_0, DType::kQ4_1}) {
        const int64_t rows = 3, cols = 64;
        std::vector<uint8_t> bytes(RowBytes(dtype, cols) * rows);
        std::mt19937 rng(2);
        for (uint8_t& b : bytes) b = uint8_t(rng());
        // Keep the block scales finite and small (the first half-words of each block).
        const size_t block = BlockBytes(dtype);
        for (size_t at = 0; at < bytes.size(); at += block) {
            if (dtype == DType::kF16) {
                const uint16_t h = FloatToHalf(float(at % 7) - 3.0f);
                std::memcpy(&bytes[at], &h, 2);
                continue;
            }
            const uint16_t d = FloatToHalf(0.03f);
            std::memcpy(&bytes[at], &d, 2);
            if (dtype == DType::kQ4_1) std::memcpy(&bytes[at + 2], &d, 2);
        }
        const std::vector<float> f32 = DequantizeRowsToF32(dtype, bytes.data(), rows, cols);
        const std::vector<uint16_t> bf16 = DequantizeRowsToBf16(dtype, bytes.data(), rows, cols);
        ASSERT_EQ(f32.size(), size_t(rows * cols));
        ASSERT_EQ(bf16.size(), f32.size());
        std::vector<float> row(cols);
        for (int64_t r = 0; r < rows; ++r) {
            DequantizeRow(dtype, bytes.data() + r * RowBytes(dtype, cols), cols, row.data());
            for (int64_t c = 0; c < cols; ++c) {
                EXPECT_EQ(f32[r * cols + c], row[c]);
                EXPECT_EQ(bf16[r * cols + c], FloatToBF16(row[c]));
                EXPECT_NEAR(BF16ToFloat(bf16[r * cols + c]), row[c], std::fabs(row[c]) / 256.0f);
            }
        }
    }
}

TEST(CudaLaunchMathTest, GemmAlgorithmsAreChosenOncePerShapeAndAlignment) {
    GemmAlgoCache<int> cache;
    int chosen = 0;
    auto choose = [&](const GemmKey& k) {
        ++chosen;
        return int(k.m * 1000 + k.n);
    };
    const GemmKey a{.m = 8, .n = 4096, .k = 4096};
    EXPECT_EQ(cache.Get(a, choose), 8 * 1000 + 4096);
    EXPECT_EQ(cache.Get(a, choose), 8 * 1000 + 4096);
    EXPECT_EQ(chosen, 1);
    GemmKey b = a;
    b.m = 9;  // another batch size
    cache.Get(b, choose);
    GemmKey c = a;
    c.y_align = 16;  // the same shape into a less aligned output
    cache.Get(c, choose);
    GemmKey d = a;
    d.b_type = DType::kF32;
    cache.Get(d, choose);
    EXPECT_EQ(chosen, 4);
    EXPECT_EQ(cache.size(), 4u);
    EXPECT_EQ(cache.hits(), 1);
    EXPECT_EQ(cache.misses(), 4);
    int seen = 0;
    cache.ForEach([&](const GemmKey&, int&) { ++seen; });
    EXPECT_EQ(seen, 4);
    EXPECT_TRUE(a == GemmKey(a));
    EXPECT_FALSE(a == c);
}

TEST(CudaLaunchMathTest, ElementwiseGridsCoverEveryElement) {
    EXPECT_EQ(GridFor(0, 256), 1u);
    EXPECT_EQ(GridFor(256, 256), 1u);
    EXPECT_EQ(GridFor(257, 256), 2u);
    EXPECT_EQ(GridFor(int64_t{1} << 40, 256, 1000), 1000u);
}

}  // namespace
}  // namespace kvshard::cuda
