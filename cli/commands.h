// The `kvshard` subcommands. Each Register* adds its options to the app and returns the callback
// that runs it; commands only wire libraries together.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace kvshard::cli {

using Command = std::function<int()>;  // returns the process exit code

Command RegisterGenerate(CLI::App& app);
Command RegisterConvert(CLI::App& app);
Command RegisterBenchEngine(CLI::App& app);
Command RegisterPlan(CLI::App& app);
Command RegisterServe(CLI::App& app);
Command RegisterBench(CLI::App& app);
Command RegisterWorker(CLI::App& app);
Command RegisterSimulate(CLI::App& app);

// Prints "kvshard: error: <message>" as one line on stderr and returns 1.
int Fail(const std::string& message);

}  // namespace kvshard::cli
