// kvshard: one binary, one subcommand per role (generate, convert, serve, worker, ...).
#include <unistd.h>

#include <CLI/CLI.hpp>
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
// - GOMP_SPINCOUNT=10000000 (a few ms): a decode step is ~250 short parallel regions, and a team
//   thread that fell asleep between two of them costs a wake-up each (batch-1 decode of the
//   default model at 2 threads: 68-70 tok/s with libgomp's default spin, 61 passive, 78-80 with
//   this; kvshard_bench numbers in docs/benchmarks.md). After that the threads sleep, so an idle
//   server does not hold its cores. (BLAS runs one thread inside the OpenMP team, so nothing else
//   needs the cores the team spins on; until the stored-format kernels it was OMP_WAIT_POLICY=
//   passive, because libgomp's spinning starved OpenBLAS's own threads.)
// - OPENBLAS_CORETYPE: Debian's OpenBLAS does not know some current CPUs (virtualized Xeons
//   among them) and falls back to its SSE3 "Prescott" kernels; the AVX2/AVX-512 kernels the CPU
//   supports are ~2x faster here and pass the same tests.
// A value the user set is left alone; KVSHARD_NO_REEXEC=1 turns this off.
void ApplyRuntimeDefaults(char** argv) {
    if (std::getenv("KVSHARD_NO_REEXEC") != nullptr) return;
    bool changed = false;
    if (std::getenv("OMP_WAIT_POLICY") == nullptr && std::getenv("GOMP_SPINCOUNT") == nullptr) {
        setenv("GOMP_SPINCOUNT", "10000000", 1);
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
    commands["simulate"] = kvshard::cli::RegisterSimulate(app);
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
