#include "model/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::TempDir;

SafetensorsWriteEntry Entry(std::string name, DType dtype, std::vector<int64_t> shape,
                            std::vector<float> values) {
    SafetensorsWriteEntry e;
    e.name = std::move(name);
    e.dtype = dtype;
    e.shape = shape;
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    const int64_t cols = shape.empty() ? 1 : shape.back();
    e.fill = [values, dtype, rows, cols](uint8_t* out) {
        QuantizeRows(dtype, values.data(), rows, cols, out);
    };
    return e;
}

// A raw safetensors file from a header text and data bytes.
std::string RawFile(const std::string& header, const std::string& data) {
    std::string s(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(s.data(), &n, 8);
    return s + header + data;
}

std::vector<float> Read(const TensorInfo& t) {
    std::vector<float> out(static_cast<size_t>(t.NumElements()));
    DequantizeRows(t, 0, t.NumRows(), out.data());
    return out;
}

TEST(SafetensorsTest, WriteThenReadEveryDType) {
    TempDir dir;
    const std::string path = dir.File("model.safetensors");
    const std::vector<float> values = {1.0f, -2.0f, 0.5f, 3.0f, -0.25f, 8.0f};
    ASSERT_TRUE(
        WriteSafetensors(
            path,
            {Entry("a", DType::kF32, {2, 3}, values), Entry("b", DType::kF16, {3, 2}, values),
             Entry("c", DType::kBF16, {6}, values), Entry("scalar", DType::kF32, {}, {7.0f})},
            {{"format", "pt"}})
            .ok());
    auto f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ((*f)->metadata().at("format"), "pt");
    ASSERT_EQ((*f)->tensors().size(), 4u);
    EXPECT_EQ((*f)->tensors()[0].name, "a");  // data order
    for (const char* name : {"a", "b", "c"}) {
        const TensorInfo* t = (*f)->FindTensor(name);
        ASSERT_NE(t, nullptr) << name;
        EXPECT_EQ(Read(*t), values) << name;
    }
    EXPECT_EQ((*f)->FindTensor("b")->shape, (std::vector<int64_t>{3, 2}));
    EXPECT_EQ((*f)->FindTensor("b")->dtype, DType::kF16);
    EXPECT_EQ((*f)->FindTensor("c")->dtype, DType::kBF16);
    EXPECT_EQ(Read(*(*f)->FindTensor("scalar")), std::vector<float>{7.0f});
    EXPECT_EQ((*f)->FindTensor("nope"), nullptr);

    auto model = SafetensorsModel::Open(path);
    ASSERT_TRUE(model.ok());
    EXPECT_EQ((*model)->TensorNames(), (std::vector<std::string>{"a", "b", "c", "scalar"}));
    EXPECT_EQ((*model)->FileOf("a"), path);
}

TEST(SafetensorsTest, ShardedIndex) {
    TempDir dir;
    ASSERT_TRUE(
        WriteSafetensors(dir.File("s1.safetensors"), {Entry("x", DType::kF32, {2}, {1, 2})}).ok());
    ASSERT_TRUE(WriteSafetensors(dir.File("s2.safetensors"), {Entry("y", DType::kF32, {1}, {3}),
                                                              Entry("z", DType::kF32, {1}, {4})})
                    .ok());
    testing::WriteFile(dir.File("index.json"),
                       R"({"metadata": {"total_size": 16},
                           "weight_map": {"x": "s1.safetensors", "y": "s2.safetensors",
                                          "z": "s2.safetensors"}})");
    auto m = SafetensorsModel::Open(dir.File("index.json"));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ((*m)->TensorNames(), (std::vector<std::string>{"x", "y", "z"}));
    EXPECT_EQ(Read(*(*m)->FindTensor("z")), std::vector<float>{4});
    EXPECT_EQ((*m)->FileOf("y"), dir.File("s2.safetensors"));

    struct Case {
        const char* name;
        std::string index;
    };
    const Case bad[] = {
        {"tensor not in its shard", R"({"weight_map": {"x": "s2.safetensors"}})"},
        {"shard outside folder", R"({"weight_map": {"x": "../s1.safetensors"}})"},
        {"no weight_map", R"({"metadata": {}})"},
        {"not json", R"({"weight_map": )"},
        {"tensor in two shards", R"({"weight_map": {"x": "s1.safetensors", "y": "s2.safetensors",
                                                    "w": "dup.safetensors"}})"},
    };
    ASSERT_TRUE(WriteSafetensors(dir.File("dup.safetensors"), {Entry("w", DType::kF32, {1}, {0}),
                                                               Entry("x", DType::kF32, {1}, {0})})
                    .ok());
    for (const Case& c : bad) {
        const std::string path = dir.File("bad.json");
        testing::WriteFile(path, c.index);
        auto r = SafetensorsModel::Open(path);
        EXPECT_EQ(r.status().code(), StatusCode::kDataLoss)
            << c.name << ": " << r.status().ToString();
        EXPECT_NE(r.status().message().find(dir.path()), std::string::npos) << c.name;
    }
    // A missing shard is NotFound naming it.
    testing::WriteFile(dir.File("bad.json"), R"({"weight_map": {"x": "gone.safetensors"}})");
    auto r = SafetensorsModel::Open(dir.File("bad.json"));
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
    EXPECT_NE(r.status().message().find("gone.safetensors"), std::string::npos);
}

TEST(SafetensorsTest, MalformedFilesAreDataLoss) {
    const std::string four_floats(16, '\0');
    struct Case {
        const char* name;
        std::string bytes;
        StatusCode code;
    };
    std::string huge_len(8, '\xFF');
    const Case cases[] = {
        {"too short", std::string(5, '\0'), StatusCode::kDataLoss},
        {"header length past end", huge_len + "{}", StatusCode::kDataLoss},
        {"not json", RawFile("{\"a\": ", four_floats), StatusCode::kDataLoss},
        {"not an object", RawFile("[1, 2]  ", four_floats), StatusCode::kDataLoss},
        {"entry not object", RawFile(R"({"a": 3})", four_floats), StatusCode::kDataLoss},
        {"missing dtype", RawFile(R"({"a": {"shape": [4], "data_offsets": [0, 16]}})", four_floats),
         StatusCode::kDataLoss},
        {"negative dim",
         RawFile(R"({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}})", four_floats),
         StatusCode::kDataLoss},
        {"offsets past data",
         RawFile(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}})", four_floats),
         StatusCode::kDataLoss},
        {"offsets reversed",
         RawFile(R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", four_floats),
         StatusCode::kDataLoss},
        {"size mismatch",
         RawFile(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}})", four_floats),
         StatusCode::kDataLoss},
        {"shape overflow",
         RawFile(
             R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 16]}})",
             four_floats),
         StatusCode::kDataLoss},
        {"unsupported dtype",
         RawFile(R"({"pos_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}})",
                 four_floats),
         StatusCode::kUnimplemented},
    };
    TempDir dir;
    for (const Case& c : cases) {
        const std::string path = dir.File("bad.safetensors");
        testing::WriteFile(path, c.bytes);
        auto f = SafetensorsFile::Open(path);
        ASSERT_FALSE(f.ok()) << c.name;
        EXPECT_EQ(f.status().code(), c.code) << c.name << ": " << f.status().ToString();
        EXPECT_NE(f.status().message().find(path), std::string::npos) << c.name;
    }
    auto f = SafetensorsFile::Open(dir.File("bad.safetensors"));
    EXPECT_NE(f.status().message().find("pos_ids"), std::string::npos);
    EXPECT_NE(f.status().message().find("I64"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
