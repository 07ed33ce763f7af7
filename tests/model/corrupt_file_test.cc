// Truncated and corrupted model files: OpenModel must return an error naming the damaged file,
// never crash, hang or allocate absurd amounts.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "model/hf_export.h"
#include "model/model_file.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::SharedModel;
using testing::TempDir;

// 40 cut lengths: every byte of the first 16, a spread over the first 4 KiB (headers, metadata),
// then evenly over the file, and the last byte.
std::vector<size_t> CutPoints(size_t size) {
    std::vector<size_t> cuts;
    for (size_t i = 0; i < 16 && i < size; ++i) cuts.push_back(i);
    for (size_t at : {20, 24, 28, 31, 40, 64, 100, 200, 500, 1000, 2000, 4000}) {
        if (at < size) cuts.push_back(at);
    }
    while (cuts.size() < 39) cuts.push_back(size * (cuts.size() - 27) / 13);
    cuts.push_back(size - 1);
    return cuts;
}

// Opens `model_path` (whose damaged file is `damaged`) and checks the error.
void ExpectError(const std::string& model_path, const std::string& damaged,
                 const OpenModelOptions& options, const std::string& what) {
    auto m = OpenModel(model_path, options);
    ASSERT_FALSE(m.ok()) << what;
    EXPECT_NE(m.status().message().find(damaged), std::string::npos)
        << what << ": " << m.status().ToString();
}

struct Fixture {
    const char* name;  // under shared/models
    const char* file_name;
};

TEST(CorruptFileTest, TruncatedGgufAndLlama2cFiles) {
    const std::string tok = SharedModel("stories260K/tok512.bin");
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(tok, "stories260K/tok512.bin");
    KV_REQUIRE_FIXTURE(bin, "stories260K/stories260K.bin");
    for (const Fixture& f : {Fixture{"stories260K/stories260K.gguf", "model.gguf"},
                             Fixture{"stories260K/stories260K.bin", "model.bin"},
                             Fixture{"stories260K/tok512.bin", "tok512.bin"}}) {
        const std::string src = SharedModel(f.name);
        KV_REQUIRE_FIXTURE(src, f.name);
        const std::string bytes = testing::ReadFile(src);
        TempDir dir;
        const std::string damaged = dir.File(f.file_name);
        const bool is_tokenizer = std::string(f.file_name) == "tok512.bin";
        OpenModelOptions options;
        options.tokenizer_path = is_tokenizer ? damaged : tok;
        const std::string model_path = is_tokenizer ? bin : damaged;
        for (size_t cut : CutPoints(bytes.size())) {
            testing::WriteFile(damaged, bytes.substr(0, cut));
            ExpectError(model_path, damaged, options,
                        std::string(f.name) + " cut at " + std::to_string(cut));
        }
    }
}

TEST(CorruptFileTest, FlippedHeaderBytes) {
    const std::string tok = SharedModel("stories260K/tok512.bin");
    KV_REQUIRE_FIXTURE(tok, "stories260K/tok512.bin");
    // GGUF: magic, version, tensor and metadata counts, first key length. llama2.c: the header.
    for (const auto& [name, num_bytes] : {std::pair{"stories260K/stories260K.gguf", 32},
                                          std::pair{"stories260K/stories260K.bin", 28}}) {
        const std::string src = SharedModel(name);
        KV_REQUIRE_FIXTURE(src, name);
        const std::string bytes = testing::ReadFile(src);
        TempDir dir;
        const std::string damaged = dir.File(std::filesystem::path(src).filename().string());
        OpenModelOptions options;
        options.tokenizer_path = tok;
        for (int i = 0; i < num_bytes; ++i) {
            std::string flipped = bytes;
            flipped[i] = static_cast<char>(flipped[i] ^ 0xFF);
            testing::WriteFile(damaged, flipped);
            ExpectError(damaged, damaged, options,
                        std::string(name) + " byte " + std::to_string(i) + " flipped");
        }
    }
}

// Random byte flips anywhere in the GGUF metadata and tensor infos: whatever the outcome, no
// crash, and an error names the file.
TEST(CorruptFileTest, RandomGgufMetadataFlipsNeverCrash) {
    const std::string src = SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(src, "stories260K/stories260K.gguf");
    const std::string bytes = testing::ReadFile(src);
    const size_t metadata_end = 14176;  // where token_embd's data starts
    std::mt19937 rng(1234);
    TempDir dir;
    const std::string damaged = dir.File("model.gguf");
    int failures = 0;
    for (int trial = 0; trial < 150; ++trial) {
        std::string flipped = bytes;
        for (int k = 0; k < 3; ++k) {
            flipped[rng() % metadata_end] ^= static_cast<char>(1 + rng() % 255);
        }
        testing::WriteFile(damaged, flipped);
        auto m = OpenModel(damaged);
        if (!m.ok()) {
            ++failures;
            EXPECT_NE(m.status().message().find(damaged), std::string::npos)
                << m.status().ToString();
        }
    }
    EXPECT_GT(failures, 0);
}

TEST(CorruptFileTest, TruncatedAndFlippedSafetensors) {
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(bin, "stories260K/stories260K.bin");
    auto model = OpenModel(bin);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    TempDir dir;
    ASSERT_TRUE(ExportHuggingFace(**model, dir.path()).ok());
    const std::string weights = dir.File("model.safetensors");
    const std::string bytes = testing::ReadFile(weights);
    ASSERT_TRUE(OpenModel(dir.path()).ok());
    for (size_t cut : CutPoints(bytes.size())) {
        testing::WriteFile(weights, bytes.substr(0, cut));
        ExpectError(dir.path(), weights, {}, "model.safetensors cut at " + std::to_string(cut));
    }
    // The header length and a spread of bytes inside the JSON header.
    uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);
    std::vector<size_t> flips = {0, 1, 2, 3, 4, 5, 6, 7};
    for (size_t at = 8; at < 8 + header_len; at += header_len / 40 + 1) flips.push_back(at);
    for (size_t at : flips) {
        std::string flipped = bytes;
        flipped[at] = static_cast<char>(flipped[at] ^ 0xFF);
        testing::WriteFile(weights, flipped);
        ExpectError(dir.path(), weights, {}, "model.safetensors byte " + std::to_string(at));
    }
}

}  // namespace
}  // namespace kvshard
