// ServerConfig: the settings of `kvshard serve`, read once from a YAML file (plus flag overrides)
// into an immutable, validated struct. Every key and its default is listed in docs/config.md;
// config/examples/serve.yaml shows them all.
//
// Errors name the file (or flag), the key and the value: "serve.yaml:7: scheduler.max_num_seqs:
// invalid value '-3': must be > 0". Unknown keys are errors too, so a misspelt setting is never
// silently ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "config/engine_config.h"

namespace kvshard {

struct HttpConfig {
    std::string host = "127.0.0.1";     // loopback only unless asked
    int port = 8000;                    // 0: an ephemeral port (tests)
    int num_threads = 2;                // Boost.Asio threads of the HTTP server
    std::vector<std::string> api_keys;  // empty: no authentication
    int64_t max_body_bytes = 1 << 20;   // larger request bodies get 413
    double request_timeout_s = 600;     // a request still running after this is aborted; 0: none
    double idle_timeout_s = 60;         // a keep-alive connection idle this long is closed
    int max_connections = 512;          // open connections beyond this get 503 and are closed
    // Prompts (completion text, or all chat content) longer than this in bytes get 400 before
    // they are tokenized. 0: as long as could fit the context (max_model_len times the longest
    // token's bytes).
    int64_t max_prompt_bytes = 0;
    // On SIGTERM/SIGINT: requests in flight may finish for this long; then they end with an error.
    double drain_timeout_s = 30;
    // Special-token text (e.g. "<|im_start|>") inside chat message content: kText encodes it as
    // the plain text it is; kControl makes it the control token (a user could write a turn).
    enum class ContentSpecialTokens { kText, kControl };
    ContentSpecialTokens content_special_tokens = ContentSpecialTokens::kText;
    // CORS for browser clients: the origins ("https://app.example.com", exactly as the browser
    // sends Origin) whose pages may call the API, or "*" for any. Empty: no CORS headers.
    std::vector<std::string> cors_allowed_origins;
    // GET /metrics also writes every kvshard: metric as vllm:<name> (same values and labels), so
    // that dashboards and autoscalers made for vLLM read kvshard unchanged.
    bool metrics_vllm_names = false;
};

// The file's workers: section: where the instance's workers run (DESIGN.md "Configuration and
// launch"). Embedded: threads of this process. Processes: `kvshard worker` processes that
// register with the coordinator over TCP (coordinator/remote_executor.h).
enum class WorkersMode { kEmbedded, kProcesses };
std::string_view WorkersModeName(WorkersMode mode);  // "embedded", "processes"
// Who starts the worker processes: the coordinator, one process per rank (with tp > 1 they meet
// through the coordinator and all-reduce over Gloo) or one mpirun for the instance; or someone
// else (external: started by hand, e.g. on other machines).
enum class WorkersLauncher { kDirect, kMpirun, kExternal };
std::string_view WorkersLauncherName(WorkersLauncher launcher);  // "direct", "mpirun", "external"

struct ServeWorkersConfig {
    WorkersMode mode = WorkersMode::kEmbedded;
    WorkersLauncher launcher = WorkersLauncher::kDirect;
    std::string host = "127.0.0.1";         // where workers register; loopback only unless asked
    int port = 0;                           // 0: a free port (external needs a fixed one)
    int64_t register_timeout_ms = 120'000;  // every rank registered and loaded by then
    int64_t heartbeat_interval_ms = 1'000;
    int64_t dead_after_ms = 5'000;     // a worker silent this long is dead (>= heartbeat)
    int64_t step_timeout_ms = 60'000;  // a step not answered by every rank by then fails
    // The secret a worker presents when it registers. Empty: the coordinator makes one for the
    // workers it launches; external workers need it set (here and in their KVSHARD_WORKER_TOKEN).
    std::string token;
    // A failed instance is re-formed (its launched workers killed and started again, or external
    // workers' new registrations awaited) at most this many times in a row; 0: never.
    int restart_limit = 5;
    int64_t restart_backoff_ms = 1'000;  // wait before the first restart; doubles, at most 30 s
};

// The file's pools: list (disaggregated serving, docs/disaggregation.md). Each pool has a role
// (config/engine_config.h PoolRole) and instances; each instance its tensor-parallel size and
// devices. No pools: one mixed pool with one instance of `tp` workers.

struct InstanceConfig {
    int tp = 1;
    // One per worker: "cpu" or a GPU ordinal ("0"). Empty: cpu for every worker. The CPU
    // backend runs every worker on the CPU whatever this says (logged at start).
    std::vector<std::string> devices;
};

struct PoolConfig {
    std::string name;
    PoolRole role = PoolRole::kMixed;
    std::vector<InstanceConfig> instances;
};

// backend: where the workers run. kAuto: cuda when this kvshard is built with CUDA and a device
// is present, else cpu (config/device_plan.h resolves it).
enum class ServeBackend { kCpu, kCuda, kAuto };
std::string_view ServeBackendName(ServeBackend backend);  // "cpu", "cuda", "auto"

struct ServerConfig {
    std::string source;          // the file read ("" when built from defaults and flags)
    std::string model_path;      // required
    std::string tokenizer_path;  // llama2.c tokenizer.bin; "" finds it beside the model
    // The names clients may pass as "model" (a string or a list in the file): the first is the
    // one answers carry; /v1/models lists every one. Empty: the model file's base name.
    std::vector<std::string> served_model_names;
    std::string chat_template;  // "" (the model's), "chatml", "llama2", "llama3", or a file
    int tp = 1;                 // tensor-parallel workers of the instance
    int threads = 0;            // CPU threads per worker; 0 = the cores divided among workers
    // "stored": matrix products read weights in the file's format; "f32": dequantized at load
    // (the reference path).
    std::string weight_format = "stored";
    ServeBackend backend = ServeBackend::kCpu;
    // Decode steps as CUDA graphs, one per decode bucket (docs/cuda.md "CUDA graphs"): vLLM's
    // enforce_eager: false, SGLang's graphs without --disable-cuda-graph. Off by default until
    // scripts/gpu-check has shown replay equal to eager; true is refused on the CPU and at tp > 1.
    bool cuda_graphs = false;
    std::string log_level = "info";
    HttpConfig http;
    SchedulerConfig scheduler;  // config/engine_config.h: the engine takes these three as they are
    KvCacheConfig kv_cache;
    ServeWorkersConfig workers;
    std::vector<PoolConfig> pools;  // empty: one mixed instance of `tp` workers
    KvTransferConfig kv_transfer;

    // The pools as configured, or the single mixed pool that `tp` implies.
    std::vector<PoolConfig> EffectivePools() const;
};

// One flag override: a dotted key as in the file ("server.port", "tp") and its value as text,
// with the flag's name for messages ("--port").
struct ConfigOverride {
    std::string key;
    std::string value;
    std::string origin;
};

// Parses YAML text. `source` names it in messages. Overrides replace (or add) single scalar
// values before validation, so a bad flag value gets the same message as a bad file value. For a
// list key (server.api_keys, served_model_name) the value is a comma-separated list.
Result<ServerConfig> ParseServerConfig(std::string_view yaml_text, const std::string& source,
                                       const std::vector<ConfigOverride>& overrides = {});
// Every dotted key the file may hold, in documentation order.
std::vector<std::string_view> ServerConfigKeys();

// Reads `path` (empty: no file, defaults only) and parses it as above.
Result<ServerConfig> LoadServerConfig(const std::string& path,
                                      const std::vector<ConfigOverride>& overrides = {});

}  // namespace kvshard
