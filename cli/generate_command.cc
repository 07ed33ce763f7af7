// `kvshard generate`: load a model on this process and complete one prompt.
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/logging.h"
#include "kernels/cpu_ops.h"
#include "worker/generator.h"
#include "worker/local_model.h"

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
    bool contiguous_kv = false;
    std::string log_level = "warn";
};

int RunGenerate(const GenerateFlags& f) {
    InitLogging("generate", f.log_level);
    if (f.threads > 0) cpu::SetNumThreads(f.threads);
    LocalModelOptions options;
    options.open.tokenizer_path = f.tokenizer;
    options.runner.max_context = f.max_context;
    options.runner.block_size = f.block_size;
    options.runner.num_kv_blocks = f.contiguous_kv ? 0 : RunnerOptions::kOneSequence;
    if (f.kv_dtype == "fp32") {
        options.runner.kv_storage = cpu::KvStorage::kF32;
    } else if (f.kv_dtype == "int8") {
        options.runner.kv_storage = cpu::KvStorage::kInt8;
    } else if (f.kv_dtype == "fp8") {
        options.runner.kv_storage = cpu::KvStorage::kFp8E4M3;
    } else {
        return Fail("--kv-dtype: '" + f.kv_dtype + "' is not one of fp32, int8, fp8");
    }
    Result<LocalModel> loaded = LoadLocalModel(f.model, options);
    if (!loaded.ok()) return Fail(loaded.status().message());
    LocalModel& m = *loaded;

    std::vector<int32_t> prompt_ids = m.EncodePrompt(f.prompt);
    if (prompt_ids.empty()) {
        return Fail("the prompt is empty and model " + f.model + " adds no BOS token: give --prompt");
    }
    GenerateOptions g;
    g.max_tokens = f.max_tokens;
    g.sampling.temperature = f.temperature;
    g.sampling.top_p = f.top_p;
    g.sampling.top_k = f.top_k;
    g.sampling.min_p = f.min_p;
    g.sampling.seed = f.seed >= 0 ? static_cast<uint64_t>(f.seed) : std::random_device{}();
    g.stop_strings = f.stop;
    g.stop_token_ids = m.StopTokenIds();
    g.use_kv_cache = !f.no_kv_cache;

    auto print = [&](std::string_view s) {
        if (f.json) return;
        std::fwrite(s.data(), 1, s.size(), stdout);
        std::fflush(stdout);
    };
    Result<GenerateResult> r = Generate(*m.runner, *m.tokenizer, prompt_ids, g, print);
    if (!r.ok()) return Fail(f.model + ": " + r.status().message());
    const GenerateResult& res = *r;
    const auto generated = static_cast<int64_t>(res.token_ids.size());
    spdlog::info("prompt {} tokens in {:.3f} s; generated {} tokens, decode {:.1f} tokens/s; {} positions computed",
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
    CLI::App* sub = app.add_subcommand("generate", "Complete one prompt with a model on this machine");
    sub->add_option("--model", f->model, "A .gguf file, a Hugging Face directory or a llama2.c .bin")->required();
    sub->add_option("--tokenizer", f->tokenizer, "llama2.c tokenizer.bin (default: found beside --model)");
    sub->add_option("--prompt", f->prompt, "Prompt text (default: empty, BOS only)");
    sub->add_option("--max-tokens", f->max_tokens, "Tokens to generate at most")->capture_default_str()->check(CLI::NonNegativeNumber);
    sub->add_option("--temperature", f->temperature, "0 is greedy")->capture_default_str()->check(CLI::NonNegativeNumber);
    sub->add_option("--top-p", f->top_p, "Nucleus sampling mass, (0, 1]")->capture_default_str();
    sub->add_option("--top-k", f->top_k, "Keep the k most likely tokens (0: off)")->capture_default_str()->check(CLI::NonNegativeNumber);
    sub->add_option("--min-p", f->min_p, "Drop tokens below min_p x the top probability")->capture_default_str();
    sub->add_option("--seed", f->seed, "Sampling seed (default: random, printed with --json)");
    sub->add_option("--stop", f->stop, "Stop string (repeatable)");
    sub->add_flag("--no-kv-cache", f->no_kv_cache, "Recompute the whole context every step");
    sub->add_flag("--json", f->json, "Print one JSON object instead of the text");
    sub->add_option("--threads", f->threads, "CPU threads (default: all cores)");
    sub->add_option("--max-context", f->max_context, "Context length (default: the model's)");
    sub->add_option("--kv-dtype", f->kv_dtype, "KV cache storage: fp32, int8 or fp8 (e4m3), with per-token scales")->capture_default_str();
    sub->add_option("--block-size", f->block_size, "Token slots per KV block")->capture_default_str()->check(CLI::PositiveNumber);
    sub->add_flag("--contiguous-kv", f->contiguous_kv, "Keep KV in one contiguous region (the paged pool's reference)");
    sub->add_option("--log-level", f->log_level, "trace|debug|info|warn|error|off")->capture_default_str();
    return [f] { return RunGenerate(*f); };
}

}  // namespace kvshard::cli
