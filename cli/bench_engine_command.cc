// `kvshard bench-engine`: prefill and decode tokens/s of the engine on this machine, no server;
// tensor-parallel with --tp N on worker threads (--comm local) or as `mpirun -np N` processes
// (--comm mpi; rank 0 prints).
#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "comm/collective.h"
#include "comm/mpi_runtime.h"
#include "common/logging.h"
#include "kernels/cpu_matmul_batch_copy.h"
#include "kernels/cpu_ops.h"
#include "kv/kv_cache_groups.h"
#include "model/model_file.h"
#include "worker/local_model.h"
#include "worker/steps_after_gap.h"
#include "worker/throughput.h"
#include "worker/tp_group.h"

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
    int tp = 1;
    std::string comm = "local";
    std::string weight_format = "stored";
    std::string rope_kv_write = "fused";
    // --steps-after: per-position decode step times after each gap (worker/steps_after_gap.h)
    // in place of the throughput figures.
    std::vector<std::string> steps_after;
    StepsAfterGapConfig gap;
    double gap_evict_mib = 256;
};

// Where products of many rows read weights that have a decode copy (kernels/
// cpu_matmul_batch_copy.h; KVSHARD_MATMUL_BATCH_WEIGHTS), for the JSON record.
std::string BatchWeights() {
    return std::string(cpu::BatchWeightSourceName(cpu::ActiveBatchWeightSource()));
}

// The --steps-after figures: one line (or JSON object) per gap kind.
void PrintStepsAfterGap(const BenchFlags& f, int threads,
                        const std::vector<StepPositionFigures>& figures) {
    nlohmann::json rows = nlohmann::json::array();
    for (const StepPositionFigures& g : figures) {
        if (f.json) {
            rows.push_back({{"gap", std::string(StepGapName(g.gap))},
                            {"gap_ms", g.gap_ms},
                            {"step_ms", g.step_ms},
                            {"minor_faults", g.minor_faults}});
            continue;
        }
        std::printf("tp %d  context %lld  after %-7s (gap %7.2f ms)  step ms:", f.tp,
                    static_cast<long long>(f.gap.context), std::string(StepGapName(g.gap)).c_str(),
                    g.gap_ms);
        for (double ms : g.step_ms) std::printf(" %.3f", ms);
        std::printf("\n");
    }
    if (f.json) {
        nlohmann::json out{{"engine", "kvshard"},
                           {"threads", threads},
                           {"tp", f.tp},
                           {"comm", f.comm},
                           {"context", f.gap.context},
                           {"prefill_tokens", f.gap.prefill_tokens},
                           {"idle_ms", f.gap.idle_ms},
                           {"evict_bytes", f.gap.evict_bytes},
                           {"repeats", f.gap.repeats},
                           {"batch_weights", BatchWeights()},
                           {"steps_after", rows}};
        std::printf("%s\n", out.dump().c_str());
    }
}

int RunBench(const BenchFlags& f) {
    if (f.comm != "local" && f.comm != "mpi") {
        return Fail("--comm: '" + f.comm + "' is not one of local, mpi");
    }
    // --comm mpi: this process is one rank; its peers are the other mpirun processes.
    std::unique_ptr<MpiRuntime> mpi;
    std::unique_ptr<Collective> collective;
    int rank = 0;
    if (f.comm == "mpi") {
        Result<std::unique_ptr<MpiRuntime>> rt = MpiRuntime::Init();
        if (!rt.ok()) return Fail("--comm mpi: " + rt.status().message());
        mpi = std::move(*rt);
        rank = mpi->world_rank();
        if (mpi->world_size() != f.tp) {
            return rank == 0 ? Fail("--tp " + std::to_string(f.tp) + " but mpirun started " +
                                    std::to_string(mpi->world_size()) + " processes")
                             : 1;
        }
        if (f.tp > 1) {
            CollectiveConfig cc;
            cc.kind = CollectiveConfig::Kind::kMpi;
            Result<std::unique_ptr<Collective>> c = MakeCollective(cc);
            if (!c.ok()) return Fail("--comm mpi: " + c.status().message());
            collective = std::move(*c);
        }
    }
    InitLogging(mpi ? "bench r" + std::to_string(rank) : "bench", rank == 0 ? "warn" : "error");
    auto fail = [&](const std::string& message) {
        Fail(message);
        if (mpi && f.tp > 1) MpiRuntime::AbortJob(1);
        return 1;
    };
    StepsAfterGapConfig gap = f.gap;
    gap.gaps.clear();
    for (const std::string& name : f.steps_after) {
        Result<StepGap> g = ParseStepGap(name);
        if (!g.ok()) return fail("--steps-after: " + g.status().message());
        gap.gaps.push_back(*g);
    }
    gap.evict_bytes = static_cast<int64_t>(f.gap_evict_mib * double(1 << 20));
    const bool steps_mode = !gap.gaps.empty();
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int threads = f.threads > 0 ? f.threads : hw;  // in all, shared by the ranks
    RunnerOptions runner;
    runner.max_context = f.prompt_tokens + f.decode_tokens;
    if (steps_mode) runner.max_context = StepsAfterGapTokensPerSequence(gap);
    runner.fuse_rope_kv_write = f.rope_kv_write == "fused";
    if (Result<WeightFormat> wf = ParseWeightFormat(f.weight_format); wf.ok()) {
        runner.weight_format = *wf;
    } else {
        Fail("--weight-format: " + wf.status().message());
        return 1;
    }
    // Room for the largest batch, each sequence in its own fixed blocks in every KV cache group
    // (worker/sequence_slots.h; a sliding-window model has a table per group).
    Result<std::unique_ptr<ModelFile>> opened = OpenModel(f.model);
    if (!opened.ok()) return fail(opened.status().message());
    Result<kv::KvCacheGroups> kv_groups =
        kv::MakeKvCacheGroups(kv::LayerWindows((*opened)->spec()));
    if (!kv_groups.ok()) return fail(f.model + ": " + kv_groups.status().message());
    const int64_t max_batch =
        steps_mode ? 2 : *std::max_element(f.batches.begin(), f.batches.end());
    runner.num_kv_blocks = kv_groups->num_groups() * max_batch *
                           ((runner.max_context + runner.block_size - 1) / runner.block_size);
    runner.max_step_tokens =
        steps_mode ? std::max(gap.context, gap.prefill_tokens) : max_batch * f.prompt_tokens;
    runner.max_step_seqs = max_batch;
    // One loaded model: a runner (tp 1, or this MPI rank's) or the group of rank threads.
    std::unique_ptr<LocalModel> local;
    std::unique_ptr<ModelFile> file;
    std::unique_ptr<TpGroup> group;
    if (f.tp == 1 || mpi) {
        cpu::SetNumThreads(std::max(1, threads / (mpi ? f.tp : 1)));
        LocalModelOptions lo;
        lo.runner = runner;
        lo.shard = {.rank = rank, .tp = f.tp};
        lo.collective = collective.get();
        Result<LocalModel> m = LoadLocalModel(f.model, lo);
        if (!m.ok()) return fail(m.status().message());
        local = std::make_unique<LocalModel>(std::move(*m));
    } else {
        file = std::move(*opened);
        TpGroupConfig tc{
            .tp = f.tp, .runner = runner, .threads_per_rank = std::max(1, threads / f.tp)};
        Result<std::unique_ptr<TpGroup>> g = TpGroup::Create(*file, tc);
        if (!g.ok()) return fail(g.status().message());
        group = std::move(*g);
    }
    if (steps_mode) {
        Result<std::vector<StepPositionFigures>> r =
            group ? MeasureStepsAfterGap(*group, gap) : MeasureStepsAfterGap(*local->runner, gap);
        if (!r.ok()) return fail(r.status().message());
        if (rank == 0) PrintStepsAfterGap(f, threads, *r);
        return 0;
    }
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t batch : f.batches) {
        ThroughputConfig c{.batch = batch,
                           .prompt_tokens = f.prompt_tokens,
                           .decode_tokens = f.decode_tokens,
                           .runs = f.runs};
        Result<ThroughputFigures> r =
            group ? MeasureThroughput(*group, c) : MeasureThroughput(*local->runner, c);
        if (!r.ok()) return fail(r.status().message());
        if (rank != 0) continue;
        rows.push_back({{"batch", batch},
                        {"prompt_tokens", f.prompt_tokens},
                        {"decode_tokens", f.decode_tokens},
                        {"prefill_tokens_per_second", r->prefill_tokens_per_second},
                        {"decode_tokens_per_second", r->decode_tokens_per_second},
                        {"prefill_runs", r->prefill_runs},
                        {"decode_runs", r->decode_runs},
                        {"decode_comm_fraction", r->decode_comm_fraction}});
        if (!f.json) {
            std::printf(
                "tp %d (%s)  batch %3lld  prefill %9.1f tok/s  decode %8.1f tok/s  "
                "(median of %lld; %.0f%% of decode in collectives)\n",
                f.tp, f.comm.c_str(), static_cast<long long>(batch), r->prefill_tokens_per_second,
                r->decode_tokens_per_second, static_cast<long long>(f.runs),
                100.0 * r->decode_comm_fraction);
        }
    }
    if (f.json && rank == 0) {
        nlohmann::json out{{"engine", "kvshard"},
                           {"threads", threads},
                           {"tp", f.tp},
                           {"comm", f.comm},
                           {"batch_weights", BatchWeights()},
                           {"results", rows}};
        std::printf("%s\n", out.dump().c_str());
    }
    return 0;
}

}  // namespace

Command RegisterBenchEngine(CLI::App& app) {
    auto f = std::make_shared<BenchFlags>();
    CLI::App* sub =
        app.add_subcommand("bench-engine", "Prefill and decode tokens/s of the engine (no server)");
    sub->add_option("--model", f->model, "Model path")->required();
    sub->add_option("--batch", f->batches, "Batch sizes")->capture_default_str();
    sub->add_option("--prompt-tokens", f->prompt_tokens, "Prompt tokens per sequence")
        ->capture_default_str();
    sub->add_option("--decode-tokens", f->decode_tokens, "Decode steps")->capture_default_str();
    sub->add_option("--runs", f->runs, "Repetitions (medians reported)")->capture_default_str();
    sub->add_option("--threads", f->threads,
                    "CPU threads in all, shared by the ranks (default: all cores)");
    sub->add_option(
           "--tp", f->tp,
           "Tensor-parallel ranks: threads (--comm local) or mpirun processes (--comm mpi)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--comm", f->comm, "local or mpi")->capture_default_str();
    sub->add_option("--weight-format", f->weight_format, "stored or f32 (dequantized at load)")
        ->capture_default_str();
    sub->add_option("--rope-kv-write", f->rope_kv_write,
                    "fused (the backend's RoPE + KV write in one op, where it has one) or "
                    "separate (Rope, then KvWrite)")
        ->check(CLI::IsMember({"fused", "separate"}))
        ->capture_default_str();
    sub->add_option(
           "--steps-after", f->steps_after,
           "Instead of tokens/s: decode step times by position after each of these "
           "gaps, taken in turn (none, prefill, idle, spin, warm, evict; e.g. prefill,none)")
        ->delimiter(',');
    sub->add_option("--context", f->gap.context,
                    "--steps-after: the decoding sequence's context before the timed steps")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--steps", f->gap.steps, "--steps-after: decode steps timed after each gap")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--repeats", f->gap.repeats,
                    "--steps-after: rounds per gap (medians reported; one more unmeasured)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--gap-prefill-tokens", f->gap.prefill_tokens,
                    "--steps-after prefill: the other sequence's prompt tokens")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--gap-idle-ms", f->gap.idle_ms, "--steps-after idle, spin, warm: the pause")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--gap-evict-mib", f->gap_evict_mib,
                    "--steps-after evict: MiB each rank's thread reads through")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_flag("--json", f->json, "One JSON object on stdout");
    return [f] { return RunBench(*f); };
}

}  // namespace kvshard::cli
