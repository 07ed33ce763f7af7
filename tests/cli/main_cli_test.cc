// `kvshard` itself, before any subcommand runs: --version, a mistyped subcommand, and a backend
// refused before anything is opened, as a user meets them (a real process, its exit code, stdout
// and stderr).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <string>

#include "common/build_config.h"
#include "common/device.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

using testing::TempDir;

struct Output {
    int exit_code = -1;
    std::string out;
    std::string err;
};

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

TEST(MainCli, VersionPrintsTheBuildsVersion) {
    const Output o = RunKvshard("--version");
    EXPECT_EQ(o.exit_code, 0) << o.err;
    EXPECT_EQ(o.out, "kvshard " KVSHARD_VERSION "\n");
    EXPECT_EQ(o.err, "");
}

TEST(MainCli, MistypedCommandSaysSoAndSuggestsTheClosest) {
    struct Case {
        std::string args;
        std::string suggestion;  // "" when none is close
    };
    const Case cases[] = {
        {"serv", "serve"},
        {"serve2 --model x", "serve"},
        {"genrate --prompt hi", "generate"},
        {"bench-eng", "bench-engine"},
        {"frobnicate", ""},
    };
    for (const Case& c : cases) {
        const Output o = RunKvshard(c.args);
        const std::string word = c.args.substr(0, c.args.find(' '));
        EXPECT_EQ(o.exit_code, 2) << c.args << "\n" << o.err;
        EXPECT_EQ(o.err.rfind("kvshard: error: unknown command '" + word + "'", 0), 0u) << o.err;
        if (c.suggestion.empty()) {
            EXPECT_EQ(o.err.find("did you mean"), std::string::npos) << o.err;
            EXPECT_NE(o.err.find("serve"), std::string::npos) << "lists the commands: " << o.err;
        } else {
            EXPECT_NE(o.err.find("did you mean '" + c.suggestion + "'?"), std::string::npos)
                << c.args << "\n"
                << o.err;
        }
        EXPECT_EQ(o.err.find("not expected"), std::string::npos) << "CLI11's words: " << o.err;
        EXPECT_EQ(o.out, "");
    }
}

TEST(MainCli, KnownCommandsStillParse) {
    const Output help = RunKvshard("serve --help");
    EXPECT_EQ(help.exit_code, 0) << help.err;
    EXPECT_NE(help.out.find("--model"), std::string::npos) << help.out;
    // An unknown option of a known command is still CLI11's error (not an unknown command).
    const Output bad = RunKvshard("serve --no-such-flag");
    EXPECT_NE(bad.exit_code, 0);
    EXPECT_EQ(bad.err.find("unknown command"), std::string::npos) << bad.err;
}

// backend: cuda on a machine (or a build) without a device: one line naming the setting, before
// the model is opened (the model path does not exist).
TEST(MainCli, ServeRefusesCudaWithoutADeviceBeforeOpeningTheModel) {
    if (KVSHARD_WITH_CUDA && DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
    const Output o = RunKvshard("serve --model /nonexistent/model.gguf --backend cuda");
    EXPECT_NE(o.exit_code, 0);
    const std::string want = KVSHARD_WITH_CUDA ? "backend: cuda: no CUDA device found (0 devices"
                                               : "backend: cuda: this kvshard was built without CUDA";
    EXPECT_NE(o.err.find(want), std::string::npos) << o.err;
    EXPECT_EQ(o.err.find("nonexistent"), std::string::npos) << o.err;
}

}  // namespace
}  // namespace kvshard
