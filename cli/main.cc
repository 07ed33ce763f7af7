// kvshard: one binary, one subcommand per role (generate, convert, serve, worker, ...).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

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
// - GOMP_SPINCOUNT=10000000 (ten million turns of libgomp's pause loop: tenths of a second on these
//   Xeons, where one `pause` is over a hundred cycles): a decode step is ~250 short parallel
//   regions, and a team thread that fell asleep between two of them costs a wake-up each (batch-1
//   decode of the default model at 2 threads: 68-70 tok/s with libgomp's default spin, 61 passive,
//   78-80 with this; kvshard_bench numbers in docs/benchmarks.md). After that the threads sleep, so
//   an idle server does not hold its cores. (BLAS runs one thread inside the OpenMP team, so
//   nothing else needs the cores the team spins on; until the stored-format kernels it was
//   OMP_WAIT_POLICY=passive, because libgomp's spinning starved OpenBLAS's own threads.)
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

// Edits (insert, delete, substitute) between two words.
size_t EditDistance(const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
        size_t diagonal = row[0];
        row[0] = i;
        for (size_t j = 1; j <= b.size(); ++j) {
            const size_t above = row[j];
            row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
            diagonal = above;
        }
    }
    return row[b.size()];
}

// CLI11 would answer a mistyped subcommand with "The following arguments were not expected" or
// "A subcommand is required"; say what went wrong, and the command that was probably meant.
// The first argument that is not an option is the subcommand (kvshard has no global options
// that take a value). Returns the exit code (2, a usage error) when `argv` names none known.
std::optional<int> CheckCommandName(int argc, char** argv,
                                    const std::map<std::string, kvshard::cli::Command>& commands) {
    std::string option;  // the first option before the command (kvshard's own take no value)
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (!arg.empty() && arg[0] == '-') {
            if (option.empty() && arg != "-h" && arg != "--help" && arg != "--version") {
                option = arg.substr(0, arg.find('='));
            }
            continue;
        }
        if (commands.count(arg) != 0) return std::nullopt;
        if (!option.empty()) {
            // "kvshard --model README.md serve": the option's value is not a mistyped command.
            std::fprintf(stderr,
                         "kvshard: error: %s is an option of the commands: write it after the "
                         "command (kvshard serve %s ...)\n",
                         option.c_str(), option.c_str());
            std::fprintf(stderr, "Run 'kvshard --help' for more information.\n");
            return 2;
        }
        std::string closest;
        size_t best = arg.size() / 2 + 1;  // beyond this many edits it is a different word
        std::string names;
        for (const auto& [name, command] : commands) {
            names += (names.empty() ? "" : ", ") + name;
            const size_t d = EditDistance(arg, name);
            const bool prefix = arg.size() >= 2 && name.rfind(arg, 0) == 0;
            if (d < best || (prefix && closest.empty())) {
                best = std::min(best, d);
                closest = name;
            }
        }
        if (!closest.empty()) {
            std::fprintf(stderr, "kvshard: error: unknown command '%s'; did you mean '%s'?\n",
                         arg.c_str(), closest.c_str());
        } else {
            std::fprintf(stderr, "kvshard: error: unknown command '%s'; the commands are %s\n",
                         arg.c_str(), names.c_str());
        }
        std::fprintf(stderr, "Run 'kvshard --help' for more information.\n");
        return 2;
    }
    return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
    ApplyRuntimeDefaults(argv);
    CLI::App app{"kvshard: a tensor-parallel LLM serving cluster (version " KVSHARD_VERSION ")"};
    app.require_subcommand(1);
    app.set_version_flag("--version", "kvshard " KVSHARD_VERSION, "Print the version and exit");
    std::map<std::string, kvshard::cli::Command> commands;
    commands["generate"] = kvshard::cli::RegisterGenerate(app);
    commands["convert"] = kvshard::cli::RegisterConvert(app);
    commands["bench-engine"] = kvshard::cli::RegisterBenchEngine(app);
    commands["plan"] = kvshard::cli::RegisterPlan(app);
    commands["serve"] = kvshard::cli::RegisterServe(app);
    commands["bench"] = kvshard::cli::RegisterBench(app);
    commands["worker"] = kvshard::cli::RegisterWorker(app);
    commands["simulate"] = kvshard::cli::RegisterSimulate(app);
    if (std::optional<int> code = CheckCommandName(argc, argv, commands)) return *code;
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
