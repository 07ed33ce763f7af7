// kvshard: one binary, one subcommand per role (generate, convert; serve and worker to come).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <string>

#include "cli/commands.h"
#include "common/build_config.h"

namespace kvshard::cli {

int Fail(const std::string& message) {
    std::string line = message;
    for (char& c : line) {
        if (c == '\n') c = ' ';
    }
    std::fprintf(stderr, "kvshard: error: %s\n", line.c_str());
    return 1;
}

}  // namespace kvshard::cli

int main(int argc, char** argv) {
    CLI::App app{"kvshard: a tensor-parallel LLM serving cluster (version " KVSHARD_VERSION ")"};
    app.require_subcommand(1);
    std::map<std::string, kvshard::cli::Command> commands;
    commands["generate"] = kvshard::cli::RegisterGenerate(app);
    commands["convert"] = kvshard::cli::RegisterConvert(app);
    commands["bench-engine"] = kvshard::cli::RegisterBenchEngine(app);
    commands["plan"] = kvshard::cli::RegisterPlan(app);
    commands["serve"] = kvshard::cli::RegisterServe(app);
    commands["bench"] = kvshard::cli::RegisterBench(app);
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    }
    for (auto& [name, run] : commands) {
        if (app.got_subcommand(name)) return run();
    }
    return kvshard::cli::Fail("no subcommand");
}
