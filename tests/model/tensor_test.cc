#include "model/tensor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace kvshard {
namespace {

TensorInfo MakeTensor(DType dtype, std::vector<int64_t> shape, const std::vector<uint8_t>& bytes) {
    TensorInfo t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.data = bytes.data();
    t.num_bytes = bytes.size();
    return t;
}

void PutU16(std::vector<uint8_t>* b, uint16_t v) {
    b->push_back(static_cast<uint8_t>(v & 0xFF));
    b->push_back(static_cast<uint8_t>(v >> 8));
}

TEST(DTypeTest, NamesSizesAndBlocks) {
    struct Case {
        DType dtype;
        const char* name;
        int64_t block;
        size_t row_bytes_64;
    };
    const Case cases[] = {
        {DType::kF32, "F32", 1, 256},   {DType::kF16, "F16", 1, 128},
        {DType::kBF16, "BF16", 1, 128}, {DType::kQ8_0, "Q8_0", 32, 68},
        {DType::kQ4_0, "Q4_0", 32, 36}, {DType::kQ4_1, "Q4_1", 32, 40},
    };
    for (const Case& c : cases) {
        EXPECT_EQ(DTypeName(c.dtype), c.name);
        EXPECT_EQ(BlockElements(c.dtype), c.block) << c.name;
        EXPECT_EQ(RowBytes(c.dtype, 64), c.row_bytes_64) << c.name;
    }
}

TEST(TensorInfoTest, RowsColsElements) {
    TensorInfo t;
    t.shape = {3, 4, 5};
    EXPECT_EQ(t.NumElements(), 60);
    EXPECT_EQ(t.NumRows(), 12);
    EXPECT_EQ(t.NumCols(), 5);
    t.shape = {7};
    EXPECT_EQ(t.NumRows(), 1);
    EXPECT_EQ(t.NumCols(), 7);
}

TEST(HalfTest, KnownValues) {
    struct Case {
        uint16_t half;
        float value;
    };
    const Case cases[] = {
        {0x3C00, 1.0f},     {0xC000, -2.0f},      {0x7BFF, 65504.0f},        {0x0001, 0x1p-24f},
        {0x0400, 0x1p-14f}, {0x03FF, 0x3FFp-24f}, {0x3555, 0.333251953125f}, {0x0000, 0.0f},
    };
    for (const Case& c : cases) {
        EXPECT_EQ(HalfToFloat(c.half), c.value) << std::hex << c.half;
        EXPECT_EQ(FloatToHalf(c.value), c.half) << c.value;
    }
    EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
    EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
    EXPECT_EQ(HalfToFloat(0x7C00), std::numeric_limits<float>::infinity());
    EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
    EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(HalfTest, RoundsToNearestEven) {
    struct Case {
        float value;
        uint16_t half;
    };
    const Case cases[] = {
        {1.0f + 0x1p-11f, 0x3C00},      // halfway, even stays
        {1.0f + 3 * 0x1p-11f, 0x3C02},  // halfway, odd rounds up
        {1.0f + 0x1p-11f + 0x1p-20f, 0x3C01},
        {65519.0f, 0x7BFF},
        {65520.0f, 0x7C00},  // overflows to infinity
        {1e-8f, 0x0000},     // below half the smallest subnormal
        {0x1p-25f, 0x0000},  // exactly half: ties to even (zero)
        {0x1.8p-24f, 0x0002},
        {0x1p-14f - 0x1p-26f, 0x0400},  // rounds up into the smallest normal
    };
    for (const Case& c : cases) EXPECT_EQ(FloatToHalf(c.value), c.half) << c.value;
}

TEST(HalfTest, EveryHalfRoundTrips) {
    for (uint32_t h = 0; h <= 0xFFFF; ++h) {
        const float f = HalfToFloat(static_cast<uint16_t>(h));
        if (std::isnan(f)) continue;
        ASSERT_EQ(FloatToHalf(f), h) << std::hex << h;
    }
}

TEST(BF16Test, ConversionsRoundToNearestEven) {
    auto from_bits = [](uint32_t bits) {
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    };
    EXPECT_EQ(FloatToBF16(1.0f), 0x3F80);
    EXPECT_EQ(BF16ToFloat(0x3F80), 1.0f);
    EXPECT_EQ(BF16ToFloat(0xC040), -3.0f);
    EXPECT_EQ(FloatToBF16(from_bits(0x3F808000)), 0x3F80);  // halfway, even
    EXPECT_EQ(FloatToBF16(from_bits(0x3F818000)), 0x3F82);  // halfway, odd
    EXPECT_EQ(FloatToBF16(from_bits(0x3F808001)), 0x3F81);
    EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(std::nanf("")))));
    for (uint32_t b = 0; b <= 0xFFFF; ++b) {
        const float f = BF16ToFloat(static_cast<uint16_t>(b));
        if (std::isnan(f)) continue;
        ASSERT_EQ(FloatToBF16(f), b) << std::hex << b;
    }
}

// Hand-built blocks with known values: two rows of one block each; the second row is read.
TEST(DequantizeTest, Q8_0) {
    std::vector<uint8_t> bytes;
    for (int row = 0; row < 2; ++row) {
        PutU16(&bytes, row == 0 ? 0x3C00 : 0x3800);  // d = 1, then 0.5
        for (int j = 0; j < 32; ++j)
            bytes.push_back(static_cast<uint8_t>(static_cast<int8_t>(j - 16)));
    }
    TensorInfo t = MakeTensor(DType::kQ8_0, {2, 32}, bytes);
    std::vector<float> out(32);
    DequantizeRows(t, 1, 1, out.data());
    for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], 0.5f * (j - 16)) << j;
}

TEST(DequantizeTest, Q4_0) {
    std::vector<uint8_t> bytes;
    PutU16(&bytes, 0x3400);  // d = 0.25
    for (int j = 0; j < 16; ++j) bytes.push_back(static_cast<uint8_t>(j | ((15 - j) << 4)));
    TensorInfo t = MakeTensor(DType::kQ4_0, {32}, bytes);
    std::vector<float> out(32);
    DequantizeRows(t, 0, 1, out.data());
    for (int j = 0; j < 16; ++j) {
        EXPECT_EQ(out[j], 0.25f * (j - 8)) << j;              // low nibbles: weights 0..15
        EXPECT_EQ(out[j + 16], 0.25f * ((15 - j) - 8)) << j;  // high nibbles: 16..31
    }
}

TEST(DequantizeTest, Q4_1) {
    std::vector<uint8_t> bytes;
    for (int block = 0; block < 2; ++block) {
        PutU16(&bytes, 0x3800);                        // d = 0.5
        PutU16(&bytes, block == 0 ? 0xBC00 : 0x4000);  // m = -1, then 2
        for (int j = 0; j < 16; ++j) bytes.push_back(static_cast<uint8_t>(j | ((15 - j) << 4)));
    }
    TensorInfo t = MakeTensor(DType::kQ4_1, {1, 64}, bytes);
    std::vector<float> out(64);
    DequantizeRows(t, 0, 1, out.data());
    for (int j = 0; j < 16; ++j) {
        EXPECT_EQ(out[j], 0.5f * j - 1) << j;
        EXPECT_EQ(out[j + 16], 0.5f * (15 - j) - 1) << j;
        EXPECT_EQ(out[32 + j], 0.5f * j + 2) << j;
        EXPECT_EQ(out[48 + j], 0.5f * (15 - j) + 2) << j;
    }
}

TEST(DequantizeTest, FloatTypes) {
    std::vector<uint8_t> f16;
    for (uint16_t h : {0x3C00, 0xC000, 0x3800}) PutU16(&f16, h);
    std::vector<uint8_t> bf16;
    for (uint16_t b : {0x3F80, 0xC000, 0x3F00}) PutU16(&bf16, b);
    std::vector<uint8_t> f32(12);
    const float values[] = {1.0f, -2.0f, 0.5f};
    std::memcpy(f32.data(), values, 12);
    for (const auto& [dtype, bytes] : {std::pair{DType::kF16, f16}, std::pair{DType::kBF16, bf16},
                                       std::pair{DType::kF32, f32}}) {
        TensorInfo t = MakeTensor(dtype, {3, 1}, bytes);
        std::vector<float> out(2);
        DequantizeRows(t, 1, 2, out.data());
        EXPECT_EQ(out[0], -2.0f) << DTypeName(dtype);
        EXPECT_EQ(out[1], 0.5f) << DTypeName(dtype);
    }
}

// QuantizeRows then DequantizeRows stays within each type's rounding error.
TEST(QuantizeTest, RoundTripWithinBlockError) {
    std::vector<float> values(4 * 64);
    for (size_t i = 0; i < values.size(); ++i) {
        values[i] = std::sin(0.37f * static_cast<float>(i)) * (1.0f + static_cast<float>(i % 7));
    }
    struct Case {
        DType dtype;
        float max_error;  // relative to the largest magnitude of a block
    };
    const Case cases[] = {{DType::kF32, 0},
                          {DType::kF16, 1e-3f},
                          {DType::kBF16, 8e-3f},
                          {DType::kQ8_0, 0.5f / 127 + 1e-3f},
                          {DType::kQ4_0, 1.0f / 8 + 1e-3f},
                          {DType::kQ4_1, 2 * 0.5f / 15 + 1e-3f}};
    for (const Case& c : cases) {
        std::vector<uint8_t> bytes(4 * RowBytes(c.dtype, 64));
        QuantizeRows(c.dtype, values.data(), 4, 64, bytes.data());
        TensorInfo t = MakeTensor(c.dtype, {4, 64}, bytes);
        std::vector<float> out(values.size());
        DequantizeRows(t, 0, 4, out.data());
        for (size_t b = 0; b < values.size(); b += 32) {
            float amax = 0;
            for (size_t j = b; j < b + 32; ++j) amax = std::max(amax, std::fabs(values[j]));
            for (size_t j = b; j < b + 32; ++j) {
                ASSERT_LE(std::fabs(out[j] - values[j]), c.max_error * amax)
                    << DTypeName(c.dtype) << " element " << j;
            }
        }
    }
}

}  // namespace
}  // namespace kvshard
