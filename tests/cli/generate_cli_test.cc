// `kvshard generate` and `kvshard convert` as a user runs them: a real process, its exit code,
// stdout and stderr.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "common/device.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::DefaultModel;
using testing::SharedModel;
using testing::TempDir;

struct Output {
    int exit_code = -1;
    std::string out;
    std::string err;
};

std::string Quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += (c == '\'') ? std::string("'\\''") : std::string(1, c);
    return q + "'";
}

Output RunKvshard(const std::string& args) {
    TempDir tmp;
    const std::string cmd = std::string(KVSHARD_BINARY_DIR) + "/cli/kvshard " + args + " >" +
                            tmp.File("out") + " 2>" + tmp.File("err") + " </dev/null";
    Output o;
    const int status = std::system(cmd.c_str());
    o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    o.out = testing::ReadFile(tmp.File("out"));
    o.err = testing::ReadFile(tmp.File("err"));
    return o;
}

int CountLines(const std::string& s) {
    int n = 0;
    for (char c : s) n += (c == '\n');
    return n;
}

TEST(GenerateCli, TextOnStdoutJsonWithFields) {
    const std::string model = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(model, "stories260K.bin");
    Output text = RunKvshard("generate --model " + Quote(model) +
                             " --prompt 'Once upon a time' --max-tokens 40");
    ASSERT_EQ(text.exit_code, 0) << text.err;
    EXPECT_EQ(text.out.rfind(", there was a little girl named Lily.", 0), 0u) << text.out;

    Output json = RunKvshard("generate --json --model " + Quote(model) +
                             " --prompt 'Once upon a time' --max-tokens 40");
    ASSERT_EQ(json.exit_code, 0) << json.err;
    nlohmann::json j = nlohmann::json::parse(json.out);
    EXPECT_EQ(j["prompt_token_ids"], nlohmann::json({1, 403, 407, 261, 378}));
    EXPECT_EQ(j["token_ids"].size(), 40u);
    EXPECT_EQ(j["finish_reason"], "length");
    EXPECT_EQ(j["tokens_processed"], 5 + 39);
    EXPECT_EQ(j["text"].get<std::string>() + "\n", text.out);
}

TEST(GenerateCli, NoKvCacheCountsEveryPosition) {
    const std::string model = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(model, "stories260K.bin");
    // 8-token prompt; L = 64: 8L + L(L-1)/2 = 2528 uncached, L + 7 = 71 cached.
    const std::string args = "generate --json --model " + Quote(model) +
                             " --prompt 'Once upon a time there was a' --max-tokens 64";
    Output cached = RunKvshard(args);
    Output uncached = RunKvshard(args + " --no-kv-cache");
    ASSERT_EQ(cached.exit_code, 0) << cached.err;
    ASSERT_EQ(uncached.exit_code, 0) << uncached.err;
    nlohmann::json a = nlohmann::json::parse(cached.out), b = nlohmann::json::parse(uncached.out);
    ASSERT_EQ(a["prompt_token_ids"].size(), 8u);
    ASSERT_EQ(a["token_ids"].size(), 64u);
    EXPECT_EQ(a["token_ids"], b["token_ids"]);
    EXPECT_EQ(a["tokens_processed"], 71);
    EXPECT_EQ(b["tokens_processed"], 2528);
}

TEST(GenerateCli, StopStringEndsTheText) {
    const std::string model = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(model, "stories260K.bin");
    Output o = RunKvshard("generate --json --model " + Quote(model) +
                          " --prompt 'Once upon a time' --stop Lily --max-tokens 100");
    ASSERT_EQ(o.exit_code, 0) << o.err;
    nlohmann::json j = nlohmann::json::parse(o.out);
    EXPECT_EQ(j["text"], ", there was a little girl named ");
    EXPECT_EQ(j["finish_reason"], "stop");
}

// Bad input: exit code != 0 and one line on stderr naming the file and the problem.
TEST(GenerateCli, BadModelFilesFailWithOneLine) {
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    const std::string gguf = SharedModel("stories260K/stories260K.gguf");
    KV_REQUIRE_FIXTURE(bin, "stories260K.bin");
    KV_REQUIRE_FIXTURE(gguf, "stories260K.gguf");
    TempDir dir;
    const std::string full_gguf = testing::ReadFile(gguf);
    const std::string full_bin = testing::ReadFile(bin);
    testing::WriteFile(dir.File("cut.gguf"), full_gguf.substr(0, 1000));
    testing::WriteFile(dir.File("cut.bin"), full_bin.substr(0, full_bin.size() - 100));
    std::string flipped = full_gguf;
    flipped[0] ^= 0x20;
    testing::WriteFile(dir.File("magic.gguf"), flipped);
    testing::WriteFile(dir.File("tokenizer.bin"), "\x05\x00\x00\x00");
    const std::array<std::string, 5> paths = {dir.File("missing.gguf"), dir.File("cut.gguf"),
                                              dir.File("cut.bin"), dir.File("magic.gguf"),
                                              dir.File("empty-dir")};
    std::system(("mkdir -p " + dir.File("empty-dir")).c_str());
    for (const std::string& p : paths) {
        Output o = RunKvshard("generate --model " + Quote(p) + " --prompt hi --max-tokens 2");
        EXPECT_NE(o.exit_code, 0) << p;
        EXPECT_LT(o.exit_code, 128) << p << " crashed: " << o.err;
        EXPECT_EQ(CountLines(o.err), 1) << o.err;
        EXPECT_NE(o.err.find(p), std::string::npos) << o.err;
        EXPECT_TRUE(o.out.empty()) << o.out;
    }
}

TEST(GenerateCli, TokenizerThatDoesNotMatchTheModel) {
    const std::string bin = SharedModel("stories260K/stories260K.bin");
    const std::string poem_tok = SharedModel("zh-poem/poem_tok.bin");
    KV_REQUIRE_FIXTURE(bin, "stories260K.bin");
    KV_REQUIRE_FIXTURE(poem_tok, "zh-poem/poem_tok.bin");
    Output o = RunKvshard("generate --model " + Quote(bin) + " --tokenizer " + Quote(poem_tok) +
                          " --prompt hi");
    EXPECT_NE(o.exit_code, 0);
    EXPECT_LT(o.exit_code, 128) << o.err;
    EXPECT_EQ(CountLines(o.err), 1) << o.err;
    EXPECT_NE(o.err.find("poem_tok.bin"), std::string::npos) << o.err;
}

// --backend: what this build and machine cannot run is refused with one line naming the flag,
// before any weight is read; with a GPU, the CUDA backend's greedy tokens on an fp32 model (the
// pedantic fp32 path) are the CPU's.
TEST(GenerateCli, BackendFlag) {
    const std::string model = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(model, "stories260K.bin");
    const std::string base = "generate --json --model " + Quote(model) +
                             " --prompt 'Once upon a time' --max-tokens 24";
    for (const std::string& bad : {std::string(" --backend tpu"),
                                   std::string(" --backend cuda --tp 2 --devices 0")}) {
        Output o = RunKvshard(base + bad);
        EXPECT_NE(o.exit_code, 0) << bad;
        EXPECT_LT(o.exit_code, 128) << bad << " crashed: " << o.err;
        EXPECT_EQ(CountLines(o.err), 1) << o.err;
        EXPECT_NE(o.err.find("--backend"), std::string::npos) << o.err;
    }
    if (DeviceCount() < 2) {
        // More ranks than GPUs, placed automatically: the numbers, and how to share a GPU.
        Output o = RunKvshard(base + " --backend cuda --tp 2");
        EXPECT_NE(o.exit_code, 0);
        EXPECT_LT(o.exit_code, 128) << o.err;
        EXPECT_EQ(CountLines(o.err), 1) << o.err;
        EXPECT_NE(o.err.find("--tp 2 with --backend cuda: GPUs 0..1 wanted, " +
                             std::to_string(DeviceCount()) + " present"),
                  std::string::npos)
            << o.err;
    }
    Output cuda = RunKvshard(base + " --backend cuda");
    if (DeviceCount() == 0) {
        EXPECT_NE(cuda.exit_code, 0);
        EXPECT_LT(cuda.exit_code, 128) << cuda.err;
        EXPECT_EQ(CountLines(cuda.err), 1) << cuda.err;
        EXPECT_NE(cuda.err.find("backend: cuda"), std::string::npos) << cuda.err;
        return;
    }
    Output cpu = RunKvshard(base + " --backend cpu");
    ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
    ASSERT_EQ(cuda.exit_code, 0) << cuda.err;
    EXPECT_EQ(nlohmann::json::parse(cuda.out)["token_ids"],
              nlohmann::json::parse(cpu.out)["token_ids"]);
}

// --tp 2 with the ranks' all-reduces staged through host copies (the path of two ranks on one
// GPU) gives tp 1's greedy tokens; and so does --backend cuda --tp 2 with both ranks on GPU 0,
// where a GPU exists.
TEST(GenerateCli, StagedCollectivesGiveTp1Tokens) {
    const std::string model = SharedModel("stories260K/stories260K.bin");
    KV_REQUIRE_FIXTURE(model, "stories260K.bin");
    const std::string base = "generate --json --model " + Quote(model) +
                             " --prompt 'Once upon a time' --max-tokens 32";
    Output one = RunKvshard(base);
    Output staged = RunKvshard(base + " --tp 2 --stage-collectives");
    ASSERT_EQ(one.exit_code, 0) << one.err;
    ASSERT_EQ(staged.exit_code, 0) << staged.err;
    const nlohmann::json j1 = nlohmann::json::parse(one.out), j2 = nlohmann::json::parse(staged.out);
    EXPECT_EQ(j2["collective"], "host-staged");
    EXPECT_EQ(j1["collective"], "host");
    EXPECT_EQ(j2["token_ids"], j1["token_ids"]);
    Output tp1_flag = RunKvshard(base + " --stage-collectives");
    EXPECT_NE(tp1_flag.exit_code, 0);
    EXPECT_NE(tp1_flag.err.find("--stage-collectives"), std::string::npos) << tp1_flag.err;
    if (DeviceCount() == 0) return;
    Output cuda1 = RunKvshard(base + " --backend cuda");
    Output cuda2 = RunKvshard(base + " --backend cuda --tp 2 --devices 0,0");
    ASSERT_EQ(cuda1.exit_code, 0) << cuda1.err;
    ASSERT_EQ(cuda2.exit_code, 0) << cuda2.err;
    EXPECT_EQ(nlohmann::json::parse(cuda2.out)["collective"], "host-staged");
    EXPECT_EQ(nlohmann::json::parse(cuda2.out)["token_ids"],
              nlohmann::json::parse(cuda1.out)["token_ids"]);
}

// A Hugging Face directory written by `kvshard convert` generates the same tokens as the GGUF.
TEST(ConvertCli, HuggingFaceDirectoryGivesTheSameTokens) {
    const std::string gguf = DefaultModel();
    KV_REQUIRE_FIXTURE(gguf, "default model");
    TempDir dir;
    const std::string hf = dir.File("smollm2-hf");
    Output conv = RunKvshard("convert --model " + Quote(gguf) + " --out " + Quote(hf) +
                             " --max-shard-mib 200");
    ASSERT_EQ(conv.exit_code, 0) << conv.err;
    const std::string args = " --json --prompt 'The capital of France is' --max-tokens 24";
    Output a = RunKvshard("generate --model " + Quote(gguf) + args);
    Output b = RunKvshard("generate --model " + Quote(hf) + args);
    ASSERT_EQ(a.exit_code, 0) << a.err;
    ASSERT_EQ(b.exit_code, 0) << b.err;
    nlohmann::json ja = nlohmann::json::parse(a.out), jb = nlohmann::json::parse(b.out);
    EXPECT_EQ(ja["prompt_token_ids"], jb["prompt_token_ids"]);
    EXPECT_EQ(ja["token_ids"], jb["token_ids"]);
    EXPECT_EQ(ja["text"], jb["text"]);
}

}  // namespace
}  // namespace kvshard
