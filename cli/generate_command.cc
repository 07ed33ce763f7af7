// `kvshard generate`: load a model and complete one prompt — on this thread (--tp 1), on --tp N
// worker threads of this process (--comm local), or as one rank of `mpirun -np N` processes
// (--comm mpi; rank 0 prints, the others are silent).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "comm/collective.h"
#include "comm/mpi_runtime.h"
#include "common/device.h"
#include "common/logging.h"
#include "kernels/cpu_ops.h"
#include "worker/generator.h"
#include "worker/local_model.h"
#include "worker/rank_memory.h"
#include "worker/tp_group.h"

namespace kvshard::cli {
namespace {

struct GenerateFlags {
    std::string model;
    std::string tokenizer;
    std::string prompt;
    int64_t max_tokens = 256;
    float temperature = 0.0f;
    float top_p = 1.0f;
    int top_k = 0;
    float min_p = 0.0f;
    int64_t seed = -1;
    std::vector<std::string> stop;
    bool no_kv_cache = false;
    bool json = false;
    int threads = 0;
    int64_t max_context = 0;
    std::string kv_dtype = "fp32";
    int64_t block_size = 16;
    std::string weight_format = "stored";
    std::string log_level = "warn";
    int tp = 1;
    std::string comm = "local";
    std::string backend = "cpu";
    int device = 0;
    std::vector<int> devices;  // --tp N on cuda: each rank's GPU
    bool stage_collectives = false;
    std::optional<bool> cuda_graphs;  // unset: off (graphs are opt-in)
};

// --backend cuda --tp N: rank r on --devices[r], else on --device + r (docs/cuda.md "Tensor
// parallelism on GPUs"). Ranks share a GPU only where --devices repeats an ordinal.
Result<std::vector<int>> RankDevices(const GenerateFlags& f) {
    if (!f.devices.empty()) {
        if (static_cast<int>(f.devices.size()) != f.tp) {
            return InvalidArgument("--devices: " + std::to_string(f.devices.size()) +
                                   " GPU ordinals for --tp " + std::to_string(f.tp) +
                                   " (--backend cuda: one per rank)");
        }
        return f.devices;
    }
    const int present = DeviceCount();
    if (f.device + f.tp > present) {
        return InvalidArgument("--tp " + std::to_string(f.tp) + " with --backend cuda: GPUs " +
                               std::to_string(f.device) + ".." +
                               std::to_string(f.device + f.tp - 1) + " wanted, " +
                               std::to_string(present) +
                               " present (--devices 0,0 runs two ranks on GPU 0, staging "
                               "their all-reduces through the host)");
    }
    std::vector<int> devices;
    for (int r = 0; r < f.tp; ++r) devices.push_back(f.device + r);
    return devices;
}

// Where the ranks run: this process's threads, or this process as one MPI rank.
struct Placement {
    std::unique_ptr<MpiRuntime> mpi;             // --comm mpi only
    std::unique_ptr<Collective> mpi_collective;  // --comm mpi only
    int rank = 0;
};

// One model loaded for this process: the tokenizer and either one runner (tp 1, or this MPI
// rank's) or the worker threads of all ranks.
struct LoadedModel {
    LocalModel local;                // file and tokenizer always; runner unless `group`
    std::unique_ptr<TpGroup> group;  // --tp N --comm local
};

Result<LoadedModel> Load(const GenerateFlags& f, const RunnerOptions& runner, Placement& p) {
    LocalModelOptions options;
    options.open.tokenizer_path = f.tokenizer;
    options.runner = runner;
    LoadedModel m;
    if (f.tp == 1 || f.comm == "mpi") {
        options.shard = {.rank = p.rank, .tp = f.tp};
        options.collective = p.mpi_collective.get();
        KV_ASSIGN_OR_RETURN(m.local, LoadLocalModel(f.model, options));
        return m;
    }
    KV_ASSIGN_OR_RETURN(m.local.file, OpenModel(f.model, options.open));
    KV_ASSIGN_OR_RETURN(m.local.tokenizer,
                        Tokenizer::Create(m.local.file->shared_tokenizer_data()));
    TpGroupConfig tc{.tp = f.tp, .runner = runner};
    tc.force_staged = f.stage_collectives;
    if (runner.backend.kind == BackendKind::kCuda) {
        KV_ASSIGN_OR_RETURN(tc.devices, RankDevices(f));
    }
    if (f.threads > 0) tc.threads_per_rank = std::max(1, f.threads / f.tp);
    KV_ASSIGN_OR_RETURN(m.group, TpGroup::Create(*m.local.file, tc));
    return m;
}

// Every rank's memory after loading (threads: weights and pool per rank, one process RSS).
Result<std::vector<RankMemory>> RankMemories(LoadedModel& m, Placement& p) {
    if (m.group == nullptr) {
        return GatherRankMemory(MeasureRankMemory(*m.local.runner), p.mpi_collective.get());
    }
    std::vector<RankMemory> all;
    for (int r = 0; r < m.group->tp(); ++r) all.push_back(MeasureRankMemory(m.group->runner(r)));
    return all;
}

int RunGenerate(const GenerateFlags& f) {
    Placement p;
    if (f.comm != "local" && f.comm != "mpi") {
        return Fail("--comm: '" + f.comm + "' is not one of local, mpi");
    }
    if (f.comm == "mpi") {
        Result<std::unique_ptr<MpiRuntime>> mpi = MpiRuntime::Init();
        if (!mpi.ok()) return Fail("--comm mpi: " + mpi.status().message());
        p.mpi = std::move(*mpi);
        p.rank = p.mpi->world_rank();
        if (p.mpi->world_size() != f.tp) {
            if (p.rank != 0) return 1;
            return Fail("--tp " + std::to_string(f.tp) + " but mpirun started " +
                        std::to_string(p.mpi->world_size()) + " processes (mpirun -np " +
                        std::to_string(f.tp) + ")");
        }
        if (f.tp > 1) {
            CollectiveConfig cc;
            cc.kind = CollectiveConfig::Kind::kMpi;
            Result<std::unique_ptr<Collective>> c = MakeCollective(cc);
            if (!c.ok()) return Fail("--comm mpi: " + c.status().message());
            p.mpi_collective = std::move(*c);
        }
    }
    // Rank 0 speaks; the other ranks report only errors.
    InitLogging(p.mpi ? "generate r" + std::to_string(p.rank) : "generate",
                p.rank == 0 ? f.log_level : "error");
    auto fail = [&](const std::string& message) {
        Fail(p.rank == 0 ? message : "rank " + std::to_string(p.rank) + ": " + message);
        // A rank that stops early would leave its peers waiting in a collective.
        if (p.mpi && f.tp > 1) MpiRuntime::AbortJob(1);
        return 1;
    };
    if (f.threads > 0) {
        cpu::SetNumThreads(f.comm == "mpi" || f.tp == 1 ? f.threads
                                                        : std::max(1, f.threads / f.tp));
    } else if (p.mpi && f.tp > 1) {
        // One node's cores shared by its ranks (mpirun --oversubscribe on a small machine).
        const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        cpu::SetNumThreads(std::max(1, hw / f.tp));
    }
    RunnerOptions runner;
    runner.max_context = f.max_context;
    runner.block_size = f.block_size;
    runner.num_kv_blocks = RunnerOptions::kOneSequence;
    if (Result<WeightFormat> wf = ParseWeightFormat(f.weight_format); wf.ok()) {
        runner.weight_format = *wf;
    } else {
        return fail("--weight-format: " + wf.status().message());
    }
    if (Result<KvDtype> dtype = ParseKvDtype(f.kv_dtype); !dtype.ok()) {
        return fail("--kv-dtype: " + dtype.status().message());
    } else {
        runner.kv_storage = *dtype;
    }
    if (f.backend == "cpu") {
        runner.backend.kind = BackendKind::kCpu;
    } else if (f.backend == "cuda") {
        if (f.tp > 1 && f.comm == "mpi") {
            return fail("--backend cuda --tp " + std::to_string(f.tp) +
                        " --comm mpi: not implemented (use --comm local, one thread per GPU, or "
                        "kvshard serve with workers.mode: processes)");
        }
        runner.backend.kind = BackendKind::kCuda;
        runner.backend.device = f.device;
    } else {
        return fail("--backend: '" + f.backend + "' is not one of cpu, cuda");
    }
    if (f.stage_collectives && (f.tp == 1 || f.comm == "mpi")) {
        return fail("--stage-collectives: only for --tp > 1 with --comm local");
    }
    if (!f.devices.empty() && (f.tp == 1 || f.backend != "cuda")) {
        return fail("--devices: only for --backend cuda with --tp > 1 (--device places tp 1)");
    }
    runner.cuda_graphs = f.cuda_graphs;
    Result<LoadedModel> loaded = Load(f, runner, p);
    if (!loaded.ok()) return fail(loaded.status().message());
    LoadedModel& m = *loaded;
    Result<std::vector<RankMemory>> memory = RankMemories(m, p);
    if (!memory.ok()) return fail(memory.status().message());
    for (size_t r = 0; r < memory->size(); ++r) {
        spdlog::info("rank {}/{}: {}", r, f.tp, (*memory)[r].ToString());
    }

    std::vector<int32_t> prompt_ids = m.local.EncodePrompt(f.prompt);
    if (prompt_ids.empty()) {
        return fail("the prompt is empty and model " + f.model +
                    " adds no BOS token: give --prompt");
    }
    GenerateOptions g;
    g.max_tokens = f.max_tokens;
    g.sampling.temperature = f.temperature;
    g.sampling.top_p = f.top_p;
    g.sampling.top_k = f.top_k;
    g.sampling.min_p = f.min_p;
    if (f.seed >= 0) {
        g.sampling.seed = static_cast<uint64_t>(f.seed);
    } else {
        // Every rank must sample with the same seed: rank 0's, broadcast.
        g.sampling.seed = std::random_device{}();
        if (p.mpi_collective != nullptr) {
            Status st = p.mpi_collective->Broadcast(&g.sampling.seed, sizeof(g.sampling.seed), 0);
            if (!st.ok()) return fail(st.message());
        }
    }
    g.stop_strings = f.stop;
    g.stop_token_ids = m.local.StopTokenIds();
    g.use_kv_cache = !f.no_kv_cache;

    auto print = [&](std::string_view s) {
        if (f.json || p.rank != 0) return;
        std::fwrite(s.data(), 1, s.size(), stdout);
        std::fflush(stdout);
    };
    Result<GenerateResult> r =
        m.group != nullptr ? GenerateOnEveryRank(*m.group, *m.local.tokenizer, prompt_ids, g, print)
                           : Generate(*m.local.runner, *m.local.tokenizer, prompt_ids, g, print);
    if (!r.ok()) return fail(f.model + ": " + r.status().message());
    if (p.rank != 0) return 0;
    const GenerateResult& res = *r;
    const auto generated = static_cast<int64_t>(res.token_ids.size());
    spdlog::info(
        "prompt {} tokens in {:.3f} s; generated {} tokens, decode {:.1f} tokens/s; {} positions "
        "computed",
        prompt_ids.size(), res.prefill_seconds, generated,
        res.decode_seconds > 0 ? static_cast<double>(generated - 1) / res.decode_seconds : 0.0,
        res.tokens_processed);
    if (f.json) {
        nlohmann::json j;
        j["text"] = res.text;
        j["prompt_token_ids"] = prompt_ids;
        j["token_ids"] = res.token_ids;
        j["finish_reason"] = std::string(FinishReasonName(res.finish_reason));
        j["tokens_processed"] = res.tokens_processed;
        j["kv_cache"] = !f.no_kv_cache;
        j["seed"] = g.sampling.seed;
        j["prefill_seconds"] = res.prefill_seconds;
        j["decode_seconds"] = res.decode_seconds;
        j["tp"] = f.tp;
        j["comm"] = f.comm;
        j["backend"] = f.backend;
        // How the ranks all-reduced (worker/rank_collective.h): host, host-staged or nccl.
        j["collective"] = CollectivePathName(m.group != nullptr ? m.group->collective_path()
                                                                : CollectivePath::kHost);
        nlohmann::json ranks = nlohmann::json::array();
        for (const RankMemory& mem : *memory) {
            ranks.push_back({{"weight_bytes", mem.weight_bytes},
                             {"kv_pool_bytes", mem.kv_pool_bytes},
                             {"rss_bytes", mem.rss_bytes},
                             {"rss_file_bytes", mem.rss_file_bytes}});
        }
        j["rank_memory"] = ranks;
        // Invalid UTF-8 cannot reach here (TextStream replaces it), but be strict anyway.
        std::string out = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
        std::printf("%s\n", out.c_str());
    } else {
        std::printf("\n");
    }
    return 0;
}

}  // namespace

Command RegisterGenerate(CLI::App& app) {
    auto f = std::make_shared<GenerateFlags>();
    CLI::App* sub =
        app.add_subcommand("generate", "Complete one prompt with a model on this machine");
    sub->add_option("--model", f->model,
                    "A .gguf file, a Hugging Face directory or a llama2.c .bin")
        ->required();
    sub->add_option("--tokenizer", f->tokenizer,
                    "llama2.c tokenizer.bin (default: found beside --model)");
    sub->add_option("--prompt", f->prompt, "Prompt text (default: empty, BOS only)");
    sub->add_option("--max-tokens", f->max_tokens, "Tokens to generate at most")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--temperature", f->temperature, "0 is greedy")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--top-p", f->top_p, "Nucleus sampling mass, (0, 1]")->capture_default_str();
    sub->add_option("--top-k", f->top_k, "Keep the k most likely tokens (0: off)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    sub->add_option("--min-p", f->min_p, "Drop tokens below min_p x the top probability")
        ->capture_default_str();
    sub->add_option("--seed", f->seed, "Sampling seed (default: random, printed with --json)");
    sub->add_option("--stop", f->stop, "Stop string (repeatable)");
    sub->add_flag("--no-kv-cache", f->no_kv_cache, "Recompute the whole context every step");
    sub->add_flag("--json", f->json, "Print one JSON object instead of the text");
    sub->add_option("--threads", f->threads, "CPU threads (default: all cores)");
    sub->add_option("--max-context", f->max_context, "Context length (default: the model's)");
    sub->add_option("--kv-dtype", f->kv_dtype,
                    "KV cache storage: fp32, int8 or fp8 (e4m3), with per-token scales")
        ->capture_default_str();
    sub->add_option("--block-size", f->block_size, "Token slots per KV block")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--weight-format", f->weight_format,
                    "stored (matmuls read the file's format) or f32 (dequantized at load: the "
                    "reference)")
        ->capture_default_str();
    sub->add_option("--log-level", f->log_level, "trace|debug|info|warn|error|off")
        ->capture_default_str();
    sub->add_option(
           "--tp", f->tp,
           "Tensor-parallel ranks: worker threads (--comm local) or mpirun processes (--comm mpi)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    sub->add_option("--backend", f->backend, "Where the forward pass runs: cpu or cuda")
        ->capture_default_str();
    sub->add_option("--device", f->device, "The GPU ordinal of --backend cuda")
        ->capture_default_str();
    sub->add_option("--devices", f->devices,
                    "--backend cuda --tp N: the GPU of each rank, comma-separated (default: "
                    "--device, --device + 1, ...); a repeated ordinal puts ranks on one GPU")
        ->delimiter(',');
    sub->add_flag("--stage-collectives", f->stage_collectives,
                  "--tp N: all-reduce through the host copies of the ranks' buffers even where "
                  "NCCL or the host buffers themselves could be used (the path of ranks sharing "
                  "a GPU)");
    sub->add_option("--cuda-graphs", f->cuda_graphs,
                    "Decode steps as CUDA graphs on cuda: true or false (default: false)");
    sub->add_option("--comm", f->comm,
                    "Collectives between ranks: local (threads of this process) or mpi (one "
                    "process per rank, under mpirun -np N)")
        ->capture_default_str();
    return [f] { return RunGenerate(*f); };
}

}  // namespace kvshard::cli
