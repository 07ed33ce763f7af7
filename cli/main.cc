// kvshard: one binary, one subcommand per role (generate, convert, serve, worker, ...).
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "cli/commands.h"
#include "common/build_config.h"
#include "kernels/cpu_ops.h"

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

namespace {

// Both runtimes read their settings when the process loads them, before main, so kvshard sets its
// defaults and starts itself again, once:
// - OMP_WAIT_POLICY=passive: libgomp's idle threads otherwise spin on the cores OpenBLAS's
//   threads need (measured: prefill of 64 tokens at 2 threads 39 tok/s spinning, 193 passive).
// - OPENBLAS_CORETYPE: Debian's OpenBLAS does not know some current CPUs (virtualized Xeons
//   among them) and falls back to its SSE3 "Prescott" kernels; the AVX2/AVX-512 kernels the CPU
//   supports are ~2x faster here and pass the same tests.
// A value the user set is left alone; KVSHARD_NO_REEXEC=1 turns this off.
void ApplyRuntimeDefaults(char** argv) {
    if (std::getenv("KVSHARD_NO_REEXEC") != nullptr) return;
    bool changed = false;
    if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
        setenv("OMP_WAIT_POLICY", "passive", 1);
        changed = true;
    }
    if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {
        const std::string core = kvshard::cpu::SuggestedBlasCoreType();
        if (!core.empty()) {
            setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
            changed = true;
        }
    }
    if (!changed) return;
    setenv("KVSHARD_NO_REEXEC", "1", 1);
    execv("/proc/self/exe", argv);  // returns only on failure: carry on with the defaults
}

}  // namespace

int main(int argc, char** argv) {
    ApplyRuntimeDefaults(argv);
    CLI::App app{"kvshard: a tensor-parallel LLM serving cluster (version " KVSHARD_VERSION ")"};
    app.require_subcommand(1);
    std::map<std::string, kvshard::cli::Command> commands;
    commands["generate"] = kvshard::cli::RegisterGenerate(app);
    commands["convert"] = kvshard::cli::RegisterConvert(app);
    commands["bench-engine"] = kvshard::cli::RegisterBenchEngine(app);
    commands["plan"] = kvshard::cli::RegisterPlan(app);
    commands["serve"] = kvshard::cli::RegisterServe(app);
    commands["bench"] = kvshard::cli::RegisterBench(app);
    commands["worker"] = kvshard::cli::RegisterWorker(app);
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
