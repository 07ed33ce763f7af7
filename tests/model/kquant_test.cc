// The Q5 and K-quant types (common/dtype.h): block sizes, dequantization checked against gguf-py's
// numpy dequantizers on the same random blocks (tests/golden/kquant_golden.json, made by
// tests/golden/make_kquant_golden.py), and GGUF files holding them, good and bad.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/build_config.h"
#include "common/dtype.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/tensor.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using nlohmann::json;

std::vector<uint8_t> FromHex(const std::string& hex) {
    std::vector<uint8_t> out(hex.size() / 2);
    for (size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
    }
    return out;
}

DType DTypeNamed(const std::string& name) {
    for (DType d : {DType::kQ5_0, DType::kQ5_1, DType::kQ2_K, DType::kQ3_K, DType::kQ4_K,
                    DType::kQ5_K, DType::kQ6_K, DType::kQ8_K}) {
        if (DTypeName(d) == name) return d;
    }
    ADD_FAILURE() << "unknown type " << name;
    return DType::kF32;
}

TEST(KQuantTest, BlockSizesAreGgmls) {
    struct Case {
        DType dtype;
        const char* name;
        int64_t block;
        size_t block_bytes;
    };
    const Case cases[] = {{DType::kQ5_0, "Q5_0", 32, 22},   {DType::kQ5_1, "Q5_1", 32, 24},
                          {DType::kQ2_K, "Q2_K", 256, 84},  {DType::kQ3_K, "Q3_K", 256, 110},
                          {DType::kQ4_K, "Q4_K", 256, 144}, {DType::kQ5_K, "Q5_K", 256, 176},
                          {DType::kQ6_K, "Q6_K", 256, 210}, {DType::kQ8_K, "Q8_K", 256, 292}};
    for (const Case& c : cases) {
        EXPECT_EQ(DTypeName(c.dtype), c.name);
        EXPECT_EQ(BlockElements(c.dtype), c.block) << c.name;
        EXPECT_EQ(BlockBytes(c.dtype), c.block_bytes) << c.name;
        EXPECT_EQ(RowBytes(c.dtype, 3 * c.block), 3 * c.block_bytes) << c.name;
        EXPECT_EQ(IsKQuant(c.dtype), c.block == 256) << c.name;
    }
    EXPECT_FALSE(IsKQuant(DType::kQ4_1));
}

TEST(KQuantTest, DequantizationMatchesGgufPy) {
    std::ifstream in(std::string(KVSHARD_SOURCE_DIR) + "/tests/golden/kquant_golden.json");
    ASSERT_TRUE(in.good());
    const json golden = json::parse(in);
    ASSERT_EQ(golden["types"].size(), 7u);  // Q5_0 Q5_1 Q2_K..Q6_K
    for (const auto& [name, entry] : golden["types"].items()) {
        const DType dtype = DTypeNamed(name);
        const int64_t cols = entry["cols"];
        const std::vector<uint8_t> bytes = FromHex(entry["bytes"]);
        ASSERT_EQ(bytes.size(), RowBytes(dtype, cols)) << name;
        const std::vector<float> want = entry["values"].get<std::vector<float>>();
        ASSERT_EQ(want.size(), static_cast<size_t>(cols)) << name;
        std::vector<float> got(static_cast<size_t>(cols));
        DequantizeRow(dtype, bytes.data(), cols, got.data());
        int mismatches = 0;
        for (int64_t i = 0; i < cols; ++i) {
            const float tol = 1e-6f * std::max(1.0f, std::fabs(want[i]));
            if (std::fabs(got[i] - want[i]) > tol && ++mismatches <= 5) {
                ADD_FAILURE() << name << " element " << i << ": " << got[i] << " vs gguf-py "
                              << want[i];
            }
        }
        EXPECT_EQ(mismatches, 0) << name;
        // Different weights within a block: the test is not passed by constant output.
        float lo = want[0];
        float hi = want[0];
        for (float v : want) lo = std::min(lo, v), hi = std::max(hi, v);
        EXPECT_LT(lo, hi) << name;
    }
}

TEST(KQuantTest, Q8KIsScaleTimesInt8) {
    // gguf-py has no Q8_K dequantizer: one block by hand (the int16 sums are not read).
    std::vector<uint8_t> block(292, 0);
    const float d = 0.03125f;
    std::memcpy(block.data(), &d, 4);
    for (int j = 0; j < 256; ++j) block[4 + j] = static_cast<uint8_t>(static_cast<int8_t>(j - 128));
    std::vector<float> out(256);
    DequantizeRow(DType::kQ8_K, block.data(), 256, out.data());
    for (int j = 0; j < 256; ++j) EXPECT_EQ(out[j], d * static_cast<float>(j - 128)) << j;
}

// A Q4_K block whose every weight is known: d = 1, dmin = 0.5, scale j = j + 1, min j = 2j, and
// q = (position % 16): checks the 6-bit scale packing end to end without a reference.
TEST(KQuantTest, Q4KScalePackingByHand) {
    std::vector<uint8_t> b(144, 0);
    const uint16_t one = FloatToHalf(1.0f);
    const uint16_t half = FloatToHalf(0.5f);
    std::memcpy(b.data(), &one, 2);
    std::memcpy(b.data() + 2, &half, 2);
    uint8_t* s = b.data() + 4;
    for (int j = 0; j < 8; ++j) {
        const int sc = j + 1 + (j >= 4 ? 40 : 0);  // > 15 for j >= 4: uses the top bits
        const int m = 2 * j + (j >= 4 ? 33 : 0);
        if (j < 4) {
            s[j] = static_cast<uint8_t>(sc);
            s[j + 4] = static_cast<uint8_t>(m);
        } else {
            s[j + 4] = static_cast<uint8_t>((sc & 0x0F) | ((m & 0x0F) << 4));
            s[j - 4] |= static_cast<uint8_t>((sc >> 4) << 6);
            s[j] |= static_cast<uint8_t>((m >> 4) << 6);
        }
    }
    uint8_t* q = b.data() + 16;
    for (int g = 0; g < 4; ++g) {
        for (int l = 0; l < 32; ++l)
            q[32 * g + l] = static_cast<uint8_t>((l % 16) | ((15 - l % 16) << 4));
    }
    std::vector<float> out(256);
    DequantizeRow(DType::kQ4_K, b.data(), 256, out.data());
    for (int i = 0; i < 256; ++i) {
        const int sub = i / 32;
        const int sc = sub + 1 + (sub >= 4 ? 40 : 0);
        const int m = 2 * sub + (sub >= 4 ? 33 : 0);
        const int l = i % 32;
        const int qv = sub % 2 == 0 ? l % 16 : 15 - l % 16;
        EXPECT_EQ(out[i], static_cast<float>(sc * qv) - 0.5f * static_cast<float>(m)) << i;
    }
}

TEST(KQuantTest, GgufFileWithKQuantTensors) {
    testing::TempDir dir;
    std::ifstream in(std::string(KVSHARD_SOURCE_DIR) + "/tests/golden/kquant_golden.json");
    const json golden = json::parse(in);
    GgufWriter w;
    w.AddString("general.architecture", "llama");
    for (const auto& [name, entry] : golden["types"].items()) {
        const std::vector<uint8_t> bytes = FromHex(entry["bytes"]);
        const int64_t cols = entry["cols"];
        // Two rows of half the golden row each.
        w.AddTensor("t." + name, DTypeNamed(name), {2, cols / 2},
                    std::string(bytes.begin(), bytes.end()));
    }
    const std::string path = dir.File("k.gguf");
    ASSERT_TRUE(w.WriteFile(path).ok());
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    for (const auto& [name, entry] : golden["types"].items()) {
        const TensorInfo* t = (*f)->FindTensor("t." + name);
        ASSERT_NE(t, nullptr) << name;
        EXPECT_EQ(t->dtype, DTypeNamed(name));
        const std::vector<float> want = entry["values"].get<std::vector<float>>();
        std::vector<float> got(want.size());
        DequantizeRows(*t, 0, 2, got.data());
        for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_NEAR(got[i], want[i], 1e-6f * std::max(1.0f, std::fabs(want[i])))
                << name << " " << i;
        }
    }
}

TEST(KQuantTest, RowNotAMultipleOfTheSuperBlockIsOneLineNamingFileAndTensor) {
    testing::TempDir dir;
    GgufWriter w;
    w.AddString("general.architecture", "llama");
    // 320 columns: ggml would need 1.25 super-blocks per row.
    w.AddTensorWithGgmlType("blk.0.ffn_down.weight", 12 /* Q4_K */, {2, 320},
                            std::string(2 * 144, '\0'));
    const std::string path = dir.File("bad.gguf");
    ASSERT_TRUE(w.WriteFile(path).ok());
    auto f = GgufFile::Open(path);
    ASSERT_FALSE(f.ok());
    const std::string msg = f.status().message();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("blk.0.ffn_down.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Q4_K"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not a multiple of its block size"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(KQuantTest, TruncatedKQuantTensorIsOneLineNamingFileAndTensor) {
    testing::TempDir dir;
    GgufWriter w;
    w.AddString("general.architecture", "llama");
    // Shape {4, 512} of Q6_K needs 4 * 2 * 210 bytes; the file holds one row's worth.
    w.AddTensorWithGgmlType("output.weight", 14 /* Q6_K */, {4, 512}, std::string(420, '\x01'));
    const std::string path = dir.File("short.gguf");
    ASSERT_TRUE(w.WriteFile(path).ok());
    auto f = GgufFile::Open(path);
    ASSERT_FALSE(f.ok());
    const std::string msg = f.status().message();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("output.weight"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

}  // namespace
}  // namespace kvshard
