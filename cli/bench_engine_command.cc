// `kvshard bench-engine`: prefill and decode tokens/s of the engine on this machine, no server.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/logging.h"
#include "kernels/cpu_ops.h"
#include "worker/local_model.h"
#include "worker/throughput.h"

namespace kvshard::cli {
namespace {

struct BenchFlags {
    std::string model;
    std::vector<int64_t> batches = {1, 16};
    int64_t prompt_tokens = 128;
    int64_t decode_tokens = 64;
    int64_t runs = 3;
    int threads = 0;
    bool json = false;
};

int RunBench(const BenchFlags& f) {
    InitLogging("bench", "warn");
    if (f.threads > 0) cpu::SetNumThreads(f.threads);
    LocalModelOptions lo;
    lo.runner.max_context = f.prompt_tokens + f.decode_tokens;
    Result<LocalModel> m = LoadLocalModel(f.model, lo);
    if (!m.ok()) return Fail(m.status().message());
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t batch : f.batches) {
        ThroughputConfig c{.batch = batch, .prompt_tokens = f.prompt_tokens,
                           .decode_tokens = f.decode_tokens, .runs = f.runs};
        Result<ThroughputFigures> r = MeasureThroughput(*m->runner, c);
        if (!r.ok()) return Fail(r.status().message());
        rows.push_back({{"batch", batch},
                        {"prompt_tokens", f.prompt_tokens},
                        {"decode_tokens", f.decode_tokens},
                        {"prefill_tokens_per_second", r->prefill_tokens_per_second},
                        {"decode_tokens_per_second", r->decode_tokens_per_second},
                        {"prefill_runs", r->prefill_runs},
                        {"decode_runs", r->decode_runs}});
        if (!f.json) {
            std::printf("batch %3lld  prefill %9.1f tok/s  decode %8.1f tok/s  (median of %lld)\n",
                        static_cast<long long>(batch), r->prefill_tokens_per_second,
                        r->decode_tokens_per_second, static_cast<long long>(f.runs));
        }
    }
    if (f.json) {
        nlohmann::json out{{"engine", "kvshard"}, {"threads", cpu::NumThreads()}, {"results", rows}};
        std::printf("%s\n", out.dump().c_str());
    }
    return 0;
}

}  // namespace

Command RegisterBenchEngine(CLI::App& app) {
    auto f = std::make_shared<BenchFlags>();
    CLI::App* sub = app.add_subcommand("bench-engine", "Prefill and decode tokens/s of the engine (no server)");
    sub->add_option("--model", f->model, "Model path")->required();
    sub->add_option("--batch", f->batches, "Batch sizes")->capture_default_str();
    sub->add_option("--prompt-tokens", f->prompt_tokens, "Prompt tokens per sequence")->capture_default_str();
    sub->add_option("--decode-tokens", f->decode_tokens, "Decode steps")->capture_default_str();
    sub->add_option("--runs", f->runs, "Repetitions (medians reported)")->capture_default_str();
    sub->add_option("--threads", f->threads, "CPU threads (default: all cores)");
    sub->add_flag("--json", f->json, "One JSON object on stdout");
    return [f] { return RunBench(*f); };
}

}  // namespace kvshard::cli
