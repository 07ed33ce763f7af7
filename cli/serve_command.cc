// `kvshard serve`: the embedded instance — the coordinator (HTTP front end, engine thread,
// scheduler, block manager) and the tensor-parallel worker threads in this process.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "common/logging.h"
#include "config/server_config.h"
#include "coordinator/api_service.h"
#include "coordinator/engine.h"
#include "coordinator/http_server.h"
#include "kernels/paged_attention.h"
#include "model/chat_template.h"
#include "model/model_file.h"
#include "model/tokenizer.h"
#include "worker/local_model.h"
#include "worker/tp_group.h"

namespace kvshard::cli {
namespace {

struct ServeFlags {
    std::string config;
    std::vector<ConfigOverride> overrides;
    // Flag values, turned into overrides when given.
    std::string model, tokenizer, host, chat_template, log_level;
    int port = -1, tp = 0, threads = -1;
};

cpu::KvStorage StorageOf(KvCacheDtype dtype) {
    switch (dtype) {
        case KvCacheDtype::kAuto:
        case KvCacheDtype::kFp32: return cpu::KvStorage::kF32;
        case KvCacheDtype::kInt8: return cpu::KvStorage::kInt8;
        case KvCacheDtype::kFp8: return cpu::KvStorage::kFp8E4M3;
    }
    return cpu::KvStorage::kF32;
}

// Blocks that memory_mib holds on the worker with the most KV heads (ranks whose query heads
// straddle a KV group hold that head too, hence the + 1).
int64_t BlocksFor(const ServerConfig& c, const ModelSpec& s) {
    if (c.kv_cache.num_blocks > 0) return c.kv_cache.num_blocks;
    const int64_t local_kv = std::min<int64_t>(s.num_kv_heads, (s.num_kv_heads + c.tp - 1) / c.tp + (c.tp > 1 ? 1 : 0));
    const int64_t bytes_per_block =
        s.num_layers * cpu::PagedLayerBytes(StorageOf(c.kv_cache.dtype), c.kv_cache.block_size, local_kv, s.head_dim);
    return std::max<int64_t>(1, (c.kv_cache.memory_mib << 20) / bytes_per_block);
}

sig_atomic_t volatile g_signal = 0;

int RunServe(ServeFlags f) {
    auto add = [&](const std::string& key, const std::string& value, const std::string& flag) {
        f.overrides.push_back({key, value, flag});
    };
    if (!f.model.empty()) add("model", f.model, "--model");
    if (!f.tokenizer.empty()) add("tokenizer", f.tokenizer, "--tokenizer");
    if (!f.host.empty()) add("server.host", f.host, "--host");
    if (f.port >= 0) add("server.port", std::to_string(f.port), "--port");
    if (f.tp > 0) add("tp", std::to_string(f.tp), "--tp");
    if (f.threads >= 0) add("threads", std::to_string(f.threads), "--threads");
    if (!f.chat_template.empty()) add("chat_template", f.chat_template, "--chat-template");
    if (!f.log_level.empty()) add("log_level", f.log_level, "--log-level");
    Result<ServerConfig> cr = LoadServerConfig(f.config, f.overrides);
    if (!cr.ok()) return Fail(cr.status().message());
    const ServerConfig& c = *cr;
    InitLogging("coordinator", c.log_level);

    OpenModelOptions open;
    open.tokenizer_path = c.tokenizer_path;
    Result<std::unique_ptr<ModelFile>> model = OpenModel(c.model_path, open);
    if (!model.ok()) return Fail(model.status().message());
    const ModelSpec& spec = (*model)->spec();
    Result<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::Create((*model)->tokenizer_data());
    if (!tokenizer.ok()) return Fail(c.model_path + ": " + tokenizer.status().message());
    Result<std::optional<ChatTemplate>> chat = ResolveChatTemplate(
        spec.chat_template, c.chat_template, ChatTemplateTokensOf((*model)->tokenizer_data()));
    if (!chat.ok()) return Fail(chat.status().message());

    const int64_t max_context = c.scheduler.max_model_len > 0 ? c.scheduler.max_model_len
                                : spec.max_position > 0       ? spec.max_position
                                                              : 4096;
    TpGroupConfig tc;
    tc.tp = c.tp;
    tc.threads_per_rank = c.threads;
    tc.runner.max_context = max_context;
    tc.runner.block_size = c.kv_cache.block_size;
    tc.runner.num_kv_blocks = BlocksFor(c, spec);
    tc.runner.kv_storage = StorageOf(c.kv_cache.dtype);
    Result<std::unique_ptr<TpGroup>> group = TpGroup::Create(**model, tc);
    if (!group.ok()) return Fail(c.model_path + ": " + group.status().message());

    InstanceEngineConfig ec;
    ec.scheduler.max_num_seqs = c.scheduler.max_num_seqs;
    ec.scheduler.max_num_batched_tokens = c.scheduler.max_num_batched_tokens;
    ec.blocks.num_blocks = tc.runner.num_kv_blocks;
    ec.blocks.block_size = c.kv_cache.block_size;
    ec.blocks.enable_prefix_caching = c.kv_cache.enable_prefix_caching;
    ec.max_context = max_context;
    ec.max_waiting_requests = c.scheduler.max_waiting_requests;
    LocalModel stop_ids_of{.file = std::move(*model), .tokenizer = std::move(*tokenizer), .runner = nullptr};
    ec.stop_token_ids = stop_ids_of.StopTokenIds();
    if (chat->has_value()) {
        const int32_t eot = stop_ids_of.tokenizer->PieceToId((*chat)->end_of_turn());
        if (eot >= 0 && std::find(ec.stop_token_ids.begin(), ec.stop_token_ids.end(), eot) == ec.stop_token_ids.end()) {
            ec.stop_token_ids.push_back(eot);
        }
    }
    if (Status st = InstanceEngine::ValidateConfig(ec); !st.ok()) return Fail(c.source + ": " + st.message());
    InstanceEngine engine(ec, *stop_ids_of.tokenizer, **group);
    engine.Start();

    ApiServiceOptions ao;
    ao.model.name = c.served_model_name.empty() ? std::filesystem::path(c.model_path).filename().string()
                                                : c.served_model_name;
    ao.model.path = c.model_path;
    ao.model.vocab_size = spec.vocab_size;
    ao.chat_template = *chat;
    ao.api_keys = c.http.api_keys;
    auto metrics = std::make_shared<ServerMetrics>(ao.model.name);
    ApiService api(engine, *stop_ids_of.tokenizer, metrics, ao);

    // Block SIGINT/SIGTERM in every thread started from here on; this thread waits for them.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGINT);
    sigaddset(&signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    Result<std::unique_ptr<HttpServer>> server = HttpServer::Start(c.http, api);
    if (!server.ok()) {
        engine.Stop();
        return Fail(server.status().message());
    }
    spdlog::info("serving {} as '{}' on http://{}:{} (tp {}, {} KV blocks of {} tokens, context {})",
                 c.model_path, ao.model.name, c.http.host, (*server)->port(), c.tp,
                 tc.runner.num_kv_blocks, c.kv_cache.block_size, max_context);
    std::fprintf(stderr, "kvshard: listening on http://%s:%d\n", c.http.host.c_str(), (*server)->port());
    int sig = 0;
    sigwait(&signals, &sig);
    spdlog::info("signal {}: shutting down", sig);
    (*server)->Stop();
    engine.Stop();
    return 0;
}

}  // namespace

Command RegisterServe(CLI::App& app) {
    auto f = std::make_shared<ServeFlags>();
    CLI::App* sub = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
    sub->add_option("--config", f->config, "YAML config file (docs/config.md)");
    sub->add_option("--model", f->model, "A .gguf file, a Hugging Face directory or a llama2.c .bin");
    sub->add_option("--tokenizer", f->tokenizer, "llama2.c tokenizer.bin (default: found beside --model)");
    sub->add_option("--tp", f->tp, "Tensor-parallel worker threads");
    sub->add_option("--host", f->host, "Address to bind (default 127.0.0.1)");
    sub->add_option("--port", f->port, "Port (default 8000; 0 picks a free one)");
    sub->add_option("--threads", f->threads, "CPU threads per worker (0: cores / tp)");
    sub->add_option("--chat-template", f->chat_template, "chatml, llama2, llama3 or a Jinja file of one of those shapes");
    sub->add_option("--log-level", f->log_level, "trace|debug|info|warn|error|off");
    for (CLI::Option* o : sub->get_options()) o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    return [f] { return RunServe(*f); };
}

}  // namespace kvshard::cli
