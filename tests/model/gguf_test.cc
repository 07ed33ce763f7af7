#include "model/gguf.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <vector>

#include "model/gguf_writer.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::TempDir;

template <typename T>
std::string Bytes(T v) {
    std::string s(sizeof(T), '\0');
    std::memcpy(s.data(), &v, sizeof(T));
    return s;
}

std::vector<float> Iota(size_t n, float scale) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = scale * (static_cast<float>(i % 37) - 18.0f);
    return v;
}

// A writer with one value of every kind and one tensor of every supported type.
GgufWriter FullWriter(uint64_t alignment = 32) {
    GgufWriter w(alignment);
    w.AddString("general.architecture", "llama");
    w.AddUInt32("u32", 4000000000u);
    w.AddInt32("i32", -7);
    w.AddUInt64("u64", 1ull << 40);
    w.AddFloat32("f32", 0.5f);
    w.AddBool("yes", true);
    w.AddRaw("u8", GgufValueType::kU8, Bytes<uint8_t>(200));
    w.AddRaw("i16", GgufValueType::kI16, Bytes<int16_t>(-300));
    w.AddRaw("f64", GgufValueType::kF64, Bytes<double>(0.125));
    w.AddRaw("i64", GgufValueType::kI64, Bytes<int64_t>(-(1ll << 50)));
    w.AddStringArray("strs", {"a", "", "ccc"});
    w.AddFloat32Array("floats", {1.5f, -2.0f});
    w.AddInt32Array("ints", {3, -4, 5});
    w.AddRaw("bools", GgufValueType::kArray,
             Bytes<uint32_t>(7) + Bytes<uint64_t>(2) + std::string("\x01\x00", 2));
    for (DType dtype :
         {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
        w.AddTensorFromFloats("t." + std::string(DTypeName(dtype)), dtype, {3, 64},
                              Iota(3 * 64, 0.25f));
    }
    w.AddTensorFromFloats("vec", DType::kF32, {5}, Iota(5, 1.0f));
    return w;
}

std::string Write(const TempDir& dir, const std::string& bytes,
                  const std::string& name = "m.gguf") {
    const std::string path = dir.File(name);
    testing::WriteFile(path, bytes);
    return path;
}

TEST(GgufTest, WriterRoundTripsEveryValueAndTensorType) {
    for (uint64_t alignment : {32, 64}) {
        TempDir dir;
        const std::string path = Write(dir, FullWriter(alignment).Serialize());
        auto f = GgufFile::Open(path);
        ASSERT_TRUE(f.ok()) << f.status().ToString();
        const GgufFile& g = **f;
        EXPECT_EQ(g.version(), 3u);
        EXPECT_EQ(g.alignment(), alignment);
        EXPECT_EQ(*g.GetString("general.architecture"), "llama");
        EXPECT_EQ(*g.GetInt("u32"), 4000000000ll);
        EXPECT_EQ(*g.GetInt("i32"), -7);
        EXPECT_EQ(*g.GetInt("u64"), 1ll << 40);
        EXPECT_EQ(*g.GetInt("u8"), 200);
        EXPECT_EQ(*g.GetInt("i16"), -300);
        EXPECT_EQ(*g.GetInt("i64"), -(1ll << 50));
        EXPECT_EQ(*g.GetFloat("f32"), 0.5);
        EXPECT_EQ(*g.GetFloat("f64"), 0.125);
        EXPECT_EQ(*g.GetFloat("i32"), -7.0);  // integers read as floats too
        EXPECT_TRUE(*g.GetBool("yes"));
        EXPECT_EQ(*g.GetStringArray("strs"), (std::vector<std::string>{"a", "", "ccc"}));
        EXPECT_EQ(*g.GetFloatArray("floats"), (std::vector<double>{1.5, -2.0}));
        EXPECT_EQ(*g.GetIntArray("ints"), (std::vector<int64_t>{3, -4, 5}));
        EXPECT_EQ(*g.GetFloatArray("ints"), (std::vector<double>{3, -4, 5}));
        const auto* bools = std::get_if<GgufValue::Array>(&g.Find("bools")->value);
        ASSERT_NE(bools, nullptr);
        EXPECT_EQ(std::get<std::vector<bool>>(*bools), (std::vector<bool>{true, false}));
        EXPECT_EQ(g.keys().front(), alignment == 32 ? "general.architecture" : "general.alignment");

        ASSERT_EQ(g.tensors().size(), 7u);
        for (const TensorInfo& t : g.tensors()) {
            EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % alignment, 0u) << t.name;
        }
        for (DType dtype :
             {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
            const TensorInfo* t = g.FindTensor("t." + std::string(DTypeName(dtype)));
            ASSERT_NE(t, nullptr);
            EXPECT_EQ(t->dtype, dtype);
            EXPECT_EQ(t->shape, (std::vector<int64_t>{3, 64}));
            EXPECT_EQ(t->num_bytes, 3 * RowBytes(dtype, 64));
            // The stored bytes are exactly what QuantizeRows makes of the values; the float
            // types hold these multiples of 0.25 exactly.
            std::vector<float> expected = Iota(3 * 64, 0.25f);
            std::vector<uint8_t> q(3 * RowBytes(dtype, 64));
            QuantizeRows(dtype, expected.data(), 3, 64, q.data());
            EXPECT_EQ(std::memcmp(q.data(), t->data, q.size()), 0) << DTypeName(dtype);
            std::vector<float> row(64);
            DequantizeRows(*t, 2, 1, row.data());
            if (BlockElements(dtype) == 1) {
                for (int j = 0; j < 64; ++j) EXPECT_EQ(row[j], expected[128 + j]);
            }
        }
        EXPECT_EQ(g.FindTensor("vec")->shape, std::vector<int64_t>{5});
        EXPECT_EQ(g.FindTensor("missing"), nullptr);
    }
}

TEST(GgufTest, DropMetadataFreesTheValuesAndKeepsTheTensors) {
    TempDir dir;
    auto f = GgufFile::Open(Write(dir, FullWriter().Serialize()));
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    GgufFile& g = **f;
    ASSERT_TRUE(g.Has("strs"));
    std::vector<float> before(5);
    DequantizeRows(*g.FindTensor("vec"), 0, 1, before.data());
    g.DropMetadata();
    EXPECT_TRUE(g.keys().empty());
    EXPECT_FALSE(g.Has("strs"));
    EXPECT_EQ(g.GetStringArray("strs").status().code(), StatusCode::kNotFound);
    EXPECT_EQ(g.GetString("general.architecture").status().code(), StatusCode::kNotFound);
    ASSERT_EQ(g.tensors().size(), 7u);
    const TensorInfo* vec = g.FindTensor("vec");
    ASSERT_NE(vec, nullptr);
    std::vector<float> after(5);
    DequantizeRows(*vec, 0, 1, after.data());
    EXPECT_EQ(after, before);
    EXPECT_EQ(after, Iota(5, 1.0f));
}

TEST(GgufTest, GettersReportMissingAndMistypedKeys) {
    TempDir dir;
    const std::string path = Write(dir, FullWriter().Serialize());
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok());
    const GgufFile& g = **f;
    EXPECT_EQ(g.GetInt("nope").status().code(), StatusCode::kNotFound);
    EXPECT_NE(g.GetInt("nope").status().message().find("nope"), std::string::npos);
    EXPECT_EQ(g.GetInt("f32").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(g.GetString("u32").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(g.GetBool("u32").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(g.GetStringArray("ints").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(g.GetIntArray("floats").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(g.GetInt("strs").status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(g.GetInt("f32").status().message().find(path), std::string::npos);
}

TEST(GgufTest, AcceptsVersion2RejectsOthers) {
    TempDir dir;
    for (uint32_t version : {1u, 2u, 3u, 4u}) {
        GgufWriter w = FullWriter();
        w.set_version(version);
        auto f = GgufFile::Open(Write(dir, w.Serialize()));
        if (version == 2 || version == 3) {
            EXPECT_TRUE(f.ok()) << f.status().ToString();
        } else {
            EXPECT_EQ(f.status().code(), StatusCode::kUnimplemented) << version;
        }
    }
}

TEST(GgufTest, UnsupportedTensorTypeIsUnimplementedNamingTensorAndType) {
    TempDir dir;
    GgufWriter w;
    w.AddTensorWithGgmlType("blk.0.attn_q.weight", 16 /* IQ2_XXS */, {1, 256},
                            std::string(66, '\0'));
    auto f = GgufFile::Open(Write(dir, w.Serialize()));
    ASSERT_EQ(f.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(f.status().message().find("blk.0.attn_q.weight"), std::string::npos);
    EXPECT_NE(f.status().message().find("16"), std::string::npos);
}

TEST(GgufTest, NestedArraysAreSkipped) {
    TempDir dir;
    GgufWriter w;
    // An array of two arrays of one u8 each.
    std::string inner = Bytes<uint32_t>(0) + Bytes<uint64_t>(1) + "\x05";
    w.AddRaw("nested", GgufValueType::kArray,
             Bytes<uint32_t>(9) + Bytes<uint64_t>(2) + inner + inner);
    w.AddUInt32("after", 3);
    auto f = GgufFile::Open(Write(dir, w.Serialize()));
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_FALSE((*f)->Has("nested"));
    EXPECT_EQ(*(*f)->GetInt("after"), 3);
}

// Header offsets of the first tensor info of a writer with exactly one kv and one tensor.
struct OneTensorLayout {
    std::string bytes;
    size_t n_dims_at, dims_at, type_at, offset_at;
};

OneTensorLayout OneTensor() {
    GgufWriter w;
    w.AddUInt32("k", 1);
    w.AddTensorFromFloats("w", DType::kF32, {2, 8}, Iota(16, 1.0f));
    OneTensorLayout l;
    l.bytes = w.Serialize();
    const size_t kv_end = 24 + (8 + 1) + 4 + 4;
    l.n_dims_at = kv_end + 8 + 1;
    l.dims_at = l.n_dims_at + 4;
    l.type_at = l.dims_at + 16;
    l.offset_at = l.type_at + 4;
    return l;
}

template <typename T>
void Poke(std::string* s, size_t at, T v) {
    std::memcpy(s->data() + at, &v, sizeof(T));
}

TEST(GgufTest, CorruptionsAreDataLossNamingTheFile) {
    struct Case {
        const char* name;
        std::function<std::string()> make;
    };
    const Case cases[] = {
        {"empty", [] { return std::string(); }},
        {"bad magic",
         [] {
             std::string s = OneTensor().bytes;
             s[0] = 'X';
             return s;
         }},
        {"absurd kv count",
         [] {
             std::string s = OneTensor().bytes;
             Poke<uint64_t>(&s, 16, 1ull << 60);
             return s;
         }},
        {"absurd tensor count",
         [] {
             std::string s = OneTensor().bytes;
             Poke<uint64_t>(&s, 8, ~0ull);
             return s;
         }},
        {"key length past end",
         [] {
             std::string s = OneTensor().bytes;
             Poke<uint64_t>(&s, 24, 1ull << 40);
             return s;
         }},
        {"unknown value type",
         [] {
             std::string s = OneTensor().bytes;
             Poke<uint32_t>(&s, 33, 99);
             return s;
         }},
        {"five dims",
         [] {
             auto l = OneTensor();
             Poke<uint32_t>(&l.bytes, l.n_dims_at, 5);
             return l.bytes;
         }},
        {"zero dim",
         [] {
             auto l = OneTensor();
             Poke<uint64_t>(&l.bytes, l.dims_at, 0);
             return l.bytes;
         }},
        {"dims overflow",
         [] {
             auto l = OneTensor();
             Poke<uint64_t>(&l.bytes, l.dims_at, 1ull << 40);
             Poke<uint64_t>(&l.bytes, l.dims_at + 8, 1ull << 40);
             return l.bytes;
         }},
        {"tensor too large for file",
         [] {
             auto l = OneTensor();
             Poke<uint64_t>(&l.bytes, l.dims_at + 8, 1000);
             return l.bytes;
         }},
        {"misaligned offset",
         [] {
             auto l = OneTensor();
             Poke<uint64_t>(&l.bytes, l.offset_at, 4);
             return l.bytes;
         }},
        {"offset past end",
         [] {
             auto l = OneTensor();
             Poke<uint64_t>(&l.bytes, l.offset_at, 1ull << 62);
             return l.bytes;
         }},
        {"q8 row not whole blocks",
         [] {
             auto l = OneTensor();
             Poke<uint32_t>(&l.bytes, l.type_at, 8);
             return l.bytes;
         }},
        {"truncated data",
         [] {
             std::string s = OneTensor().bytes;
             s.resize(s.size() - 1);
             return s;
         }},
        {"bool value 2",
         [] {
             GgufWriter w;
             w.AddRaw("b", GgufValueType::kBool, "\x02");
             return w.Serialize();
         }},
        {"uint64 above int64",
         [] {
             GgufWriter w;
             w.AddUInt64("u", ~0ull);
             return w.Serialize();
         }},
        {"duplicate key",
         [] {
             GgufWriter w;
             w.AddUInt32("k", 1);
             w.AddUInt32("k", 2);
             return w.Serialize();
         }},
        {"duplicate tensor",
         [] {
             GgufWriter w;
             w.AddTensorFromFloats("t", DType::kF32, {1}, {1.0f});
             w.AddTensorFromFloats("t", DType::kF32, {1}, {1.0f});
             return w.Serialize();
         }},
        {"alignment not a power of two",
         [] {
             GgufWriter w;
             w.AddUInt32("general.alignment", 48);
             return w.Serialize();
         }},
        {"alignment a string",
         [] {
             GgufWriter w;
             w.AddString("general.alignment", "32");
             return w.Serialize();
         }},
        {"array count past end",
         [] {
             GgufWriter w;
             w.AddRaw("a", GgufValueType::kArray, Bytes<uint32_t>(8) + Bytes<uint64_t>(1ull << 61));
             return w.Serialize();
         }},
        {"unknown array element type",
         [] {
             GgufWriter w;
             w.AddRaw("a", GgufValueType::kArray, Bytes<uint32_t>(77) + Bytes<uint64_t>(1));
             return w.Serialize();
         }},
        {"arrays nested too deeply",
         [] {
             std::string v;
             for (int i = 0; i < 20; ++i) v += Bytes<uint32_t>(9) + Bytes<uint64_t>(1);
             v += Bytes<uint32_t>(0) + Bytes<uint64_t>(0);
             GgufWriter w;
             w.AddRaw("deep", GgufValueType::kArray, v);
             return w.Serialize();
         }},
    };
    TempDir dir;
    for (const Case& c : cases) {
        const std::string path = Write(dir, c.make(), "corrupt.gguf");
        auto f = GgufFile::Open(path);
        ASSERT_FALSE(f.ok()) << c.name;
        EXPECT_EQ(f.status().code(), StatusCode::kDataLoss)
            << c.name << ": " << f.status().ToString();
        EXPECT_NE(f.status().message().find(path), std::string::npos) << c.name;
    }
}

TEST(GgufTest, MissingFileIsNotFound) {
    EXPECT_EQ(GgufFile::Open("/nonexistent/x.gguf").status().code(), StatusCode::kNotFound);
}

TEST(GgufTest, ReadsStories260K) {
    const std::string path = testing::SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(path, "stories260K/stories260K.gguf");
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    const GgufFile& g = **f;
    EXPECT_EQ(g.version(), 3u);
    EXPECT_EQ(g.keys().size(), 19u);
    EXPECT_EQ(g.tensors().size(), 48u);
    EXPECT_EQ(*g.GetInt("llama.embedding_length"), 64);
    EXPECT_EQ(g.GetStringArray("tokenizer.ggml.tokens")->size(), 512u);
    const TensorInfo* emb = g.FindTensor("token_embd.weight");
    ASSERT_NE(emb, nullptr);
    EXPECT_EQ(emb->dtype, DType::kF32);
    EXPECT_EQ(emb->shape, (std::vector<int64_t>{512, 64}));
    EXPECT_EQ(g.FindTensor("blk.0.ffn_down.weight")->shape, (std::vector<int64_t>{64, 172}));
}

}  // namespace
}  // namespace kvshard
