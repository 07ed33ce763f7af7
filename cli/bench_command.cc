// `kvshard bench`: load-test any OpenAI-compatible server (kvshard, llama.cpp's, vLLM) over http
// or https with streamed requests and report throughput, TTFT, TPOT, ITL, E2E latency and
// goodput; optionally every request's measurements as JSON lines.
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "common/logging.h"
#include "loadgen/bench_report.h"
#include "loadgen/bench_runner.h"
#include "loadgen/dataset.h"
#include "loadgen/result_file.h"
#include "loadgen/sharegpt.h"
#include "loadgen/tls.h"
#include "loadgen/trace_file.h"
#include "model/model_file.h"
#include "model/tokenizer.h"

namespace kvshard::cli {
namespace {

struct BenchFlags {
    std::string base_url = "http://127.0.0.1:8000";
    std::string model;
    std::string endpoint = "completions";
    std::string api_key;
    int64_t num_requests = 100;
    std::string request_rate = "inf";
    int64_t max_concurrency = 0;
    std::string dataset = "random";
    int64_t input_len = 256;
    int64_t output_len = 128;
    double range_ratio = 0.0;
    int64_t num_groups = 4;
    int64_t prefix_len = 512;
    int64_t suffix_len = 32;
    uint64_t seed = 0;
    double temperature = 0.0;
    double timeout_s = 600;
    std::string slo;
    bool json = false;
    bool cache_prefix = false;
    std::string dataset_path;
    bool output_len_given = false;
    bool insecure = false;
    std::string ca_cert;
    std::string result_file;
    std::string trace_out;
    std::string tokenizer;
};

// --tokenizer MODEL_FILE: ShareGPT lengths counted with a local model's tokenizer, as the
// server's completions route counts a prompt (special-token text parsed; BOS when the model adds
// one and it is asked for), for servers without a /tokenize route or offline.
Result<loadgen::TokenCounter> LocalTokenCounter(const std::string& path) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<ModelFile> file, OpenModel(path));
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                        Tokenizer::Create(file->shared_tokenizer_data()));
    const bool model_adds_bos = file->tokenizer_data().add_bos;
    std::shared_ptr<const Tokenizer> shared = std::move(tokenizer);
    return loadgen::TokenCounter(
        [shared, model_adds_bos](const std::string& text, bool add_special_tokens) {
            EncodeOptions options;
            options.add_bos = add_special_tokens && model_adds_bos && !text.empty();
            options.parse_special = true;
            return Result<int64_t>(static_cast<int64_t>(shared->Encode(text, options).size()));
        });
}

// The prompts of the --dataset: made from words, or (sharegpt) read from --dataset-path and
// measured with the server's /tokenize, which needs the model name.
Result<std::vector<loadgen::BenchPrompt>> LoadPrompts(const BenchFlags& f,
                                                      loadgen::DatasetKind kind,
                                                      loadgen::BenchOptions* options) {
    if (kind != loadgen::DatasetKind::kShareGpt) {
        if (!f.dataset_path.empty() || !f.tokenizer.empty()) {
            const char* flag = f.dataset_path.empty() ? "--tokenizer" : "--dataset-path";
            return InvalidArgument(std::string(flag) + " is read by --dataset sharegpt only, not " +
                                   f.dataset);
        }
        loadgen::DatasetOptions data;
        data.kind = kind;
        data.num_requests = f.num_requests;
        data.input_len = f.input_len;
        data.output_len = f.output_len;
        data.range_ratio = f.range_ratio;
        data.num_groups = f.num_groups;
        data.prefix_len = f.prefix_len;
        data.suffix_len = f.suffix_len;
        data.seed = f.seed;
        return loadgen::MakeDataset(data);
    }
    if (f.dataset_path.empty()) return InvalidArgument("--dataset sharegpt needs --dataset-path");
    KV_ASSIGN_OR_RETURN(loadgen::ShareGptFile file, loadgen::ReadShareGpt(f.dataset_path));
    loadgen::TokenCounter count_tokens;
    if (!f.tokenizer.empty()) {
        KV_ASSIGN_OR_RETURN(count_tokens, LocalTokenCounter(f.tokenizer));
    } else {
        KV_RETURN_IF_ERROR(loadgen::CheckConnection(options->url, 30));
        if (options->model.empty()) {
            KV_ASSIGN_OR_RETURN(options->model,
                                loadgen::ServedModel(options->url, options->api_key));
        }
        count_tokens =
            loadgen::ServerTokenCounter(options->url, options->model, options->api_key, 60);
    }
    loadgen::ShareGptOptions sample_options;
    sample_options.num_prompts = f.num_requests;
    sample_options.seed = f.seed;
    sample_options.output_len = f.output_len_given ? f.output_len : 0;
    KV_ASSIGN_OR_RETURN(loadgen::ShareGptSample sample,
                        loadgen::SampleShareGpt(file, sample_options, count_tokens));
    if (static_cast<int64_t>(sample.prompts.size()) < f.num_requests) {
        std::fprintf(stderr,
                     "kvshard bench: only %zu of the %zu human/gpt pairs of %s pass the length "
                     "filter; sending %zu requests, not %lld\n",
                     sample.prompts.size(), file.pairs.size(), f.dataset_path.c_str(),
                     sample.prompts.size(), static_cast<long long>(f.num_requests));
    }
    return std::move(sample.prompts);
}

int RunBench(const BenchFlags& f) {
    InitLogging("bench", "warn");
    auto url = loadgen::ParseBaseUrl(f.base_url);
    if (!url.ok()) return Fail(url.status().message());
    if (url->https) {
        auto tls = loadgen::MakeTlsContext({f.insecure, f.ca_cert});
        if (!tls.ok()) return Fail(tls.status().message());
        url->tls = *tls;
    } else if (f.insecure || !f.ca_cert.empty()) {
        return Fail(std::string(f.insecure ? "--insecure" : "--ca-cert") +
                    " is for an https:// --base-url, got " + f.base_url);
    }
    auto kind = loadgen::ParseDatasetKind(f.dataset);
    if (!kind.ok()) return Fail(kind.status().message());
    auto slo = loadgen::ParseSlo(f.slo);
    if (!slo.ok()) return Fail(slo.status().message());

    loadgen::BenchOptions options;
    options.url = *url;
    options.model = f.model;
    if (f.endpoint == "completions") {
        options.api = loadgen::ApiKind::kCompletions;
    } else if (f.endpoint == "chat") {
        options.api = loadgen::ApiKind::kChat;
    } else if (f.endpoint == "messages") {
        options.api = loadgen::ApiKind::kMessages;
    } else {
        return Fail("--endpoint must be completions, chat or messages, got '" + f.endpoint + "'");
    }
    if (f.cache_prefix) {
        if (options.api == loadgen::ApiKind::kCompletions) {
            return Fail("--cache-prefix marks the system message: it needs --endpoint chat or "
                        "messages");
        }
        if (*kind == loadgen::DatasetKind::kRandom || *kind == loadgen::DatasetKind::kShareGpt) {
            return Fail(
                "--cache-prefix needs a dataset with a shared prefix (shared-prefix or "
                "chat), not " +
                f.dataset);
        }
    }
    options.cache_prefix = f.cache_prefix;
    if (f.request_rate == "inf") {
        options.request_rate = std::numeric_limits<double>::infinity();
    } else {
        char* end = nullptr;
        options.request_rate = std::strtod(f.request_rate.c_str(), &end);
        if (end != f.request_rate.c_str() + f.request_rate.size() || !(options.request_rate > 0)) {
            return Fail("--request-rate must be a positive number or inf, got '" + f.request_rate +
                        "'");
        }
    }
    options.max_concurrency = f.max_concurrency;
    options.api_key = f.api_key;
    options.read_timeout_s = f.timeout_s;
    options.seed = f.seed;
    options.temperature = f.temperature;

    if (!f.result_file.empty()) {
        // An unwritable path is refused before the run, not after it.
        const Status writable = loadgen::WriteResultFile(f.result_file, {}, {});
        if (!writable.ok()) return Fail(writable.message());
    }
    if (!f.trace_out.empty()) {
        // The trace's prefix_len is the prefix as the completions route counts it; in a chat
        // template it sits behind the template's own tokens.
        if (*kind == loadgen::DatasetKind::kSharedPrefix &&
            options.api != loadgen::ApiKind::kCompletions) {
            return Fail(
                "--trace-out with --dataset shared-prefix counts the prefix's tokens as "
                "the completions route does: it needs --endpoint completions, not " +
                f.endpoint);
        }
        const Status writable = loadgen::WriteTraceFile(f.trace_out, {});
        if (!writable.ok()) return Fail(writable.message());
    }
    auto prompts = LoadPrompts(f, *kind, &options);
    if (!prompts.ok()) return Fail(prompts.status().message());

    auto run = loadgen::RunBench(options, *prompts);
    if (!run.ok()) return Fail(run.status().message());
    if (!f.result_file.empty()) {
        const Status written = loadgen::WriteResultFile(f.result_file, *prompts, *run);
        if (!written.ok()) return Fail(written.message());
    }
    if (!f.trace_out.empty()) {
        auto trace = loadgen::MakeTrace(
            *prompts, *run,
            loadgen::ServerTokenCounter(options.url, run->model, options.api_key, 60));
        if (!trace.ok())
            return Fail("--trace-out " + f.trace_out + ": " + trace.status().message());
        const Status written = loadgen::WriteTraceFile(f.trace_out, *trace);
        if (!written.ok()) return Fail(written.message());
    }
    loadgen::BenchReport report = loadgen::MakeReport(*run, *slo);
    report.dataset = f.dataset;
    report.request_rate = options.request_rate;
    report.max_concurrency = options.max_concurrency;
    const std::string out =
        f.json ? loadgen::ReportJson(report) + "\n" : loadgen::ReportText(report);
    std::fwrite(out.data(), 1, out.size(), stdout);
    return report.completed > 0 ? 0 : 1;
}

}  // namespace

Command RegisterBench(CLI::App& app) {
    auto f = std::make_shared<BenchFlags>();
    CLI::App* sub =
        app.add_subcommand("bench", "Load-test an OpenAI-compatible server with streamed requests");
    sub->add_option("--base-url,--url", f->base_url,
                    "Server URL, http[s]://host:port (a trailing /v1 is fine)")
        ->capture_default_str();
    sub->add_flag("--insecure", f->insecure,
                  "https: do not check the server's certificate or name (still encrypted)");
    sub->add_option("--ca-cert", f->ca_cert,
                    "https: also trust the PEM certificates of this file (besides the system's)")
        ->check(CLI::ExistingFile);
    sub->add_option("--model", f->model, "Model name to send (default: the server's first model)");
    sub->add_option("--endpoint", f->endpoint,
                    "completions, chat (/v1/chat/completions) or messages (Anthropic's "
                    "/v1/messages)")
        ->capture_default_str();
    sub->add_option("--api-key", f->api_key, "Sent as Authorization: Bearer");
    sub->add_option("--num-requests,--num-prompts", f->num_requests,
                    "Requests to send (sharegpt: prompts to sample)")
        ->capture_default_str();
    sub->add_option("--request-rate", f->request_rate,
                    "Poisson arrivals per second; inf sends all at once")
        ->capture_default_str();
    sub->add_option("--max-concurrency", f->max_concurrency,
                    "Requests in flight at most (0: no cap)")
        ->capture_default_str();
    sub->add_option("--dataset", f->dataset, "random | shared-prefix | chat | sharegpt")
        ->capture_default_str();
    sub->add_option(
        "--dataset-path", f->dataset_path,
        "sharegpt: the ShareGPT JSON file (a list of {conversations: [{from, value}]})");
    sub->add_option("--tokenizer", f->tokenizer,
                    "sharegpt: count lengths with this model file's tokenizer (default: the "
                    "server's POST /tokenize)");
    sub->add_option("--input-len", f->input_len, "Prompt words (random; chat: median)")
        ->capture_default_str();
    sub->add_option("--output-len", f->output_len,
                    "Tokens to generate (chat: median; sharegpt: instead of each answer's length)")
        ->capture_default_str()
        ->each([f](const std::string&) { f->output_len_given = true; });
    sub->add_option("--range-ratio", f->range_ratio, "random: lengths vary by +-ratio, [0, 1)")
        ->capture_default_str();
    sub->add_option("--num-groups", f->num_groups, "shared-prefix: prefix groups")
        ->capture_default_str();
    sub->add_option("--prefix-len", f->prefix_len, "shared-prefix: words shared by a group")
        ->capture_default_str();
    sub->add_option("--suffix-len", f->suffix_len, "shared-prefix: words of each request's own")
        ->capture_default_str();
    sub->add_option("--seed", f->seed, "Seed of the prompts and arrival times")
        ->capture_default_str();
    sub->add_option("--temperature", f->temperature, "Sampling temperature sent (0: greedy)")
        ->capture_default_str();
    sub->add_option("--timeout", f->timeout_s,
                    "Seconds a request may receive nothing before failing")
        ->capture_default_str();
    sub->add_option("--slo", f->slo, "Goodput targets: ttft_ms=...,tpot_ms=...[,e2el_ms=...]");
    sub->add_flag("--json", f->json, "Print the report as JSON");
    sub->add_option("--result-file", f->result_file,
                    "Write every request's measurements to this file, one JSON line each");
    sub->add_option("--trace-out", f->trace_out,
                    "Write the requests sent (arrival, prompt and output tokens as the server "
                    "counted them) as a trace for kvshard simulate --dataset trace");
    sub->add_flag("--cache-prefix", f->cache_prefix,
                  "Prompt caching: mark each prompt's shared prefix (its system message) with "
                  "cache_control {type: ephemeral} (chat or messages)");
    return [f] { return RunBench(*f); };
}

}  // namespace kvshard::cli
