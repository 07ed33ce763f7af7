// The keys of the config file (config/server_config_keys.h): each key's parser, range and field.
#include "config/server_config_keys.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

namespace kvshard::config_keys {

namespace {

Status BadValue(const ValueSource& at, std::string_view value, std::string_view why) {
    return InvalidArgument(at.where + ": " + at.key + ": invalid value '" + std::string(value) +
                           "': " + std::string(why));
}

Result<int64_t> ParseInt(const ValueSource& at, const std::string& text) {
    int64_t v = 0;
    const char* end = text.data() + text.size();
    auto [ptr, ec] = std::from_chars(text.data(), end, v);
    if (ec != std::errc() || ptr != end || text.empty()) {
        return BadValue(at, text, "expected an integer");
    }
    return v;
}

Result<double> ParseDouble(const ValueSource& at, const std::string& text) {
    char* end = nullptr;
    double v = std::strtod(text.c_str(), &end);
    if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v)) {
        return BadValue(at, text, "expected a number");
    }
    return v;
}

Result<bool> ParseBool(const ValueSource& at, const std::string& text) {
    std::string t = text;
    std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
    if (t == "true" || t == "yes" || t == "on" || t == "1") return true;
    if (t == "false" || t == "no" || t == "off" || t == "0") return false;
    return BadValue(at, text, "expected true or false");
}

std::string ScalarText(const YAML::Node& node) { return node.IsNull() ? "" : node.Scalar(); }

Status RequireScalar(const ValueSource& at, const YAML::Node& node) {
    if (node.IsScalar() || node.IsNull()) return Status::Ok();
    return InvalidArgument(at.where + ": " + at.key + ": expected a single value, got a " +
                           (node.IsSequence() ? "list" : "map"));
}

Setting String(std::string_view key, std::function<std::string&(ServerConfig&)> field,
               bool allow_empty = true) {
    return {key, [=](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                KV_RETURN_IF_ERROR(RequireScalar(at, n));
                if (!allow_empty && ScalarText(n).empty()) {
                    return BadValue(at, "", "must not be empty");
                }
                field(c) = ScalarText(n);
                return Status::Ok();
            }};
}

// A list of strings (a YAML sequence of scalars; null: empty). `why_not` says what is wrong
// with one entry, or "" when it is fine.
Setting StringList(std::string_view key,
                   std::function<std::vector<std::string>&(ServerConfig&)> field,
                   std::function<std::string(const std::string&)> why_not) {
    return {
        key, [=](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
            std::vector<std::string> items;
            if (n.IsSequence()) {
                for (const YAML::Node& item : n) {
                    if (!item.IsScalar()) {
                        return InvalidArgument(at.where + ": " + at.key +
                                               ": every entry must be a string");
                    }
                    items.push_back(item.Scalar());
                }
            } else if (!n.IsNull()) {
                return InvalidArgument(at.where + ": " + at.key + ": expected a list of strings");
            }
            for (const std::string& item : items) {
                if (const std::string why = why_not(item); !why.empty()) {
                    return BadValue(at, item, why);
                }
            }
            field(c) = std::move(items);
            return Status::Ok();
        }};
}

template <typename T>
Setting Int(std::string_view key, std::function<T&(ServerConfig&)> field, int64_t min, int64_t max,
            std::string_view rule) {
    return {key, [=](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                KV_RETURN_IF_ERROR(RequireScalar(at, n));
                const std::string text = ScalarText(n);
                KV_ASSIGN_OR_RETURN(int64_t v, ParseInt(at, text));
                if (v < min || v > max) return BadValue(at, text, rule);
                field(c) = static_cast<T>(v);
                return Status::Ok();
            }};
}

Setting Double(std::string_view key, std::function<double&(ServerConfig&)> field, double min,
               bool min_exclusive, std::string_view rule) {
    return {key, [=](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                KV_RETURN_IF_ERROR(RequireScalar(at, n));
                const std::string text = ScalarText(n);
                KV_ASSIGN_OR_RETURN(double v, ParseDouble(at, text));
                if (v < min || (min_exclusive && v == min)) return BadValue(at, text, rule);
                field(c) = v;
                return Status::Ok();
            }};
}

}  // namespace

const std::vector<Setting>& Settings() {
    static const std::vector<Setting> kSettings = [] {
        std::vector<Setting> s;
        s.push_back(String("model", [](ServerConfig& c) -> std::string& { return c.model_path; }));
        s.push_back(
            String("tokenizer", [](ServerConfig& c) -> std::string& { return c.tokenizer_path; }));
        // One name or a list of names; "" (the example file's value) is none.
        s.push_back({"served_model_name",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         std::vector<std::string> names;
                         if (n.IsScalar()) {
                             if (!n.Scalar().empty()) names.push_back(n.Scalar());
                         } else if (n.IsSequence()) {
                             for (const YAML::Node& item : n) {
                                 if (!item.IsScalar()) {
                                     return InvalidArgument(at.where + ": " + at.key +
                                                            ": every name must be a string");
                                 }
                                 if (item.Scalar().empty()) {
                                     return BadValue(at, "",
                                                     "a served model name must not be empty");
                                 }
                                 names.push_back(item.Scalar());
                             }
                         } else if (!n.IsNull()) {
                             return InvalidArgument(at.where + ": " + at.key +
                                                    ": expected a name or a list of names");
                         }
                         c.served_model_names = std::move(names);
                         return Status::Ok();
                     }});
        s.push_back(String("chat_template",
                           [](ServerConfig& c) -> std::string& { return c.chat_template; }));
        s.push_back(Int<int>(
            "tp", [](ServerConfig& c) -> int& { return c.tp; }, 1, 1024, "must be >= 1"));
        s.push_back(Int<int>(
            "threads", [](ServerConfig& c) -> int& { return c.threads; }, 0, 4096,
            "must be >= 0 (0: all cores)"));
        s.push_back({"weight_format",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string v = ScalarText(n);
                         if (v != "stored" && v != "f32") {
                             return BadValue(at, v, "expected stored (the file's format) or f32");
                         }
                         c.weight_format = v;
                         return Status::Ok();
                     }});
        s.push_back(
            {"backend", [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                 KV_RETURN_IF_ERROR(RequireScalar(at, n));
                 const std::string v = ScalarText(n);
                 for (ServeBackend b :
                      {ServeBackend::kCpu, ServeBackend::kCuda, ServeBackend::kAuto}) {
                     if (v == ServeBackendName(b)) {
                         c.backend = b;
                         return Status::Ok();
                     }
                 }
                 return BadValue(at, v, "expected cpu, cuda or auto");
             }});
        s.push_back({"cuda_graphs",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         KV_ASSIGN_OR_RETURN(c.cuda_graphs, ParseBool(at, ScalarText(n)));
                         return Status::Ok();
                     }});
        s.push_back(
            {"log_level",
             [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                 KV_RETURN_IF_ERROR(RequireScalar(at, n));
                 const std::string v = ScalarText(n);
                 for (const char* name : {"trace", "debug", "info", "warn", "error", "off"}) {
                     if (v == name) {
                         c.log_level = v;
                         return Status::Ok();
                     }
                 }
                 return BadValue(at, v, "expected trace, debug, info, warn, error or off");
             }});

        s.push_back(String(
            "server.host", [](ServerConfig& c) -> std::string& { return c.http.host; }, false));
        s.push_back(Int<int>(
            "server.port", [](ServerConfig& c) -> int& { return c.http.port; }, 0, 65535,
            "must be in 0..65535 (0: any free port)"));
        s.push_back(Int<int>(
            "server.threads", [](ServerConfig& c) -> int& { return c.http.num_threads; }, 1, 256,
            "must be in 1..256"));
        s.push_back(StringList(
            "server.api_keys",
            [](ServerConfig& c) -> std::vector<std::string>& { return c.http.api_keys; },
            [](const std::string& k) -> std::string {
                return k.empty() ? "an API key must not be empty" : "";
            }));
        s.push_back(StringList(
            "server.cors_allowed_origins",
            [](ServerConfig& c) -> std::vector<std::string>& {
                return c.http.cors_allowed_origins;
            },
            [](const std::string& o) -> std::string {
                // An origin is scheme://host[:port], no path, no trailing slash.
                const size_t scheme = o.find("://");
                const bool ok = o == "*" || (scheme != std::string::npos && scheme > 0 &&
                                             o.size() > scheme + 3 &&
                                             o.find('/', scheme + 3) == std::string::npos);
                return ok ? ""
                          : "expected \"*\" or an origin such as https://app.example.com "
                            "(scheme://host[:port], no path)";
            }));
        s.push_back(Int<int64_t>(
            "server.max_body_bytes",
            [](ServerConfig& c) -> int64_t& { return c.http.max_body_bytes; }, 1024,
            int64_t{1} << 32, "must be in 1024..4294967296"));
        s.push_back(Double(
            "server.request_timeout_s",
            [](ServerConfig& c) -> double& { return c.http.request_timeout_s; }, 0, false,
            "must be >= 0 (0: no limit)"));
        s.push_back(Double(
            "server.idle_timeout_s",
            [](ServerConfig& c) -> double& { return c.http.idle_timeout_s; }, 0, true,
            "must be > 0"));
        s.push_back(Int<int>(
            "server.max_connections",
            [](ServerConfig& c) -> int& { return c.http.max_connections; }, 1, 1 << 20,
            "must be in 1..1048576"));
        s.push_back(Int<int64_t>(
            "server.max_prompt_bytes",
            [](ServerConfig& c) -> int64_t& { return c.http.max_prompt_bytes; }, 0,
            int64_t{1} << 32, "must be in 0..4294967296 (0: what the context could hold)"));
        s.push_back(Double(
            "server.drain_timeout_s",
            [](ServerConfig& c) -> double& { return c.http.drain_timeout_s; }, 0, false,
            "must be >= 0"));
        s.push_back({"server.metrics_vllm_names",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         KV_ASSIGN_OR_RETURN(c.http.metrics_vllm_names,
                                             ParseBool(at, ScalarText(n)));
                         return Status::Ok();
                     }});
        s.push_back({"server.content_special_tokens",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string v = ScalarText(n);
                         using T = HttpConfig::ContentSpecialTokens;
                         if (v == "text") {
                             c.http.content_special_tokens = T::kText;
                         } else if (v == "control") {
                             c.http.content_special_tokens = T::kControl;
                         } else {
                             return BadValue(at, v, "expected text or control");
                         }
                         return Status::Ok();
                     }});

        s.push_back(Int<int64_t>(
            "scheduler.max_num_seqs",
            [](ServerConfig& c) -> int64_t& { return c.scheduler.max_num_seqs; }, 1, 1 << 20,
            "must be >= 1"));
        s.push_back(Int<int64_t>(
            "scheduler.max_num_batched_tokens",
            [](ServerConfig& c) -> int64_t& { return c.scheduler.max_num_batched_tokens; }, 1,
            int64_t{1} << 30, "must be >= 1"));
        s.push_back(Int<int64_t>(
            "scheduler.max_waiting_requests",
            [](ServerConfig& c) -> int64_t& { return c.scheduler.max_waiting_requests; }, 1,
            int64_t{1} << 30, "must be >= 1"));
        s.push_back(Int<int64_t>(
            "scheduler.max_model_len",
            [](ServerConfig& c) -> int64_t& { return c.scheduler.max_model_len; }, 0,
            int64_t{1} << 30, "must be >= 0 (0: the model's context length)"));

        s.push_back(Int<int64_t>(
            "kv_cache.block_size",
            [](ServerConfig& c) -> int64_t& { return c.kv_cache.block_size; }, 1, 1024,
            "must be in 1..1024"));
        s.push_back(Int<int64_t>(
            "kv_cache.num_blocks",
            [](ServerConfig& c) -> int64_t& { return c.kv_cache.num_blocks; }, 0, int64_t{1} << 30,
            "must be >= 0 (0: from memory_mib)"));
        s.push_back(Int<int64_t>(
            "kv_cache.memory_mib",
            [](ServerConfig& c) -> int64_t& { return c.kv_cache.memory_mib; }, 1, int64_t{1} << 30,
            "must be >= 1"));
        s.push_back({"kv_cache.gpu_memory_utilization",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string text = ScalarText(n);
                         KV_ASSIGN_OR_RETURN(double v, ParseDouble(at, text));
                         if (!(v > 0 && v <= 1)) return BadValue(at, text, "must be in (0, 1]");
                         c.kv_cache.gpu_memory_utilization = v;
                         return Status::Ok();
                     }});
        s.push_back({"kv_cache.dtype",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string v = ScalarText(n);
                         if (v == "auto") {
                             c.kv_cache.dtype.reset();
                             return Status::Ok();
                         }
                         Result<KvDtype> dtype = ParseKvDtype(v);
                         if (!dtype.ok()) {
                             return BadValue(at, v, "expected auto, fp32, fp16, bf16, fp8 or int8");
                         }
                         c.kv_cache.dtype = *dtype;
                         return Status::Ok();
                     }});
        s.push_back({"kv_cache.enable_prefix_caching",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         KV_ASSIGN_OR_RETURN(c.kv_cache.enable_prefix_caching,
                                             ParseBool(at, ScalarText(n)));
                         return Status::Ok();
                     }});
        s.push_back({"kv_cache.max_pinned_fraction",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string text = ScalarText(n);
                         KV_ASSIGN_OR_RETURN(double v, ParseDouble(at, text));
                         if (!(v >= 0.0 && v <= 1.0))
                             return BadValue(at, text, "must be in 0..1 (0: no pins)");
                         c.kv_cache.max_pinned_fraction = v;
                         return Status::Ok();
                     }});
        s.push_back(Int<int64_t>(
            "kv_cache.min_pinned_tokens",
            [](ServerConfig& c) -> int64_t& { return c.kv_cache.min_pinned_tokens; }, 0,
            int64_t{1} << 30, "must be >= 0"));

        s.push_back({"kv_transfer.mode",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string v = ScalarText(n);
                         if (v != "layerwise" && v != "blockwise") {
                             return BadValue(at, v, "expected layerwise or blockwise");
                         }
                         c.kv_transfer.layerwise = v == "layerwise";
                         return Status::Ok();
                     }});
        s.push_back({"kv_transfer.path",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string v = ScalarText(n);
                         if (v == "auto") {
                             c.kv_transfer.path.reset();
                             return Status::Ok();
                         }
                         Result<KvHandoffPath> path = ParseKvHandoffPath(v);
                         if (!path.ok())
                             return BadValue(at, v, "expected auto, host-staged, peer or nccl");
                         c.kv_transfer.path = *path;
                         return Status::Ok();
                     }});
        s.push_back(Int<int64_t>(
            "kv_transfer.timeout_ms",
            [](ServerConfig& c) -> int64_t& { return c.kv_transfer.timeout_ms; }, 1,
            int64_t{1} << 31, "must be > 0"));
        s.push_back({"workers.mode",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string v = ScalarText(n);
                         for (WorkersMode m : {WorkersMode::kEmbedded, WorkersMode::kProcesses}) {
                             if (v == WorkersModeName(m)) {
                                 c.workers.mode = m;
                                 return Status::Ok();
                             }
                         }
                         return BadValue(at, v, "expected embedded or processes");
                     }});
        s.push_back({"workers.launcher",
                     [](const ValueSource& at, const YAML::Node& n, ServerConfig& c) -> Status {
                         KV_RETURN_IF_ERROR(RequireScalar(at, n));
                         const std::string v = ScalarText(n);
                         for (WorkersLauncher l :
                              {WorkersLauncher::kDirect, WorkersLauncher::kMpirun,
                               WorkersLauncher::kExternal}) {
                             if (v == WorkersLauncherName(l)) {
                                 c.workers.launcher = l;
                                 return Status::Ok();
                             }
                         }
                         return BadValue(at, v, "expected direct, mpirun or external");
                     }});
        s.push_back(String(
            "workers.host", [](ServerConfig& c) -> std::string& { return c.workers.host; }, false));
        s.push_back(Int<int>(
            "workers.port", [](ServerConfig& c) -> int& { return c.workers.port; }, 0, 65535,
            "must be in 0..65535 (0: any free port)"));
        s.push_back(Int<int64_t>(
            "workers.register_timeout_ms",
            [](ServerConfig& c) -> int64_t& { return c.workers.register_timeout_ms; }, 1,
            int64_t{1} << 40, "must be >= 1"));
        s.push_back(Int<int64_t>(
            "workers.heartbeat_interval_ms",
            [](ServerConfig& c) -> int64_t& { return c.workers.heartbeat_interval_ms; }, 1,
            int64_t{1} << 40, "must be >= 1"));
        s.push_back(Int<int64_t>(
            "workers.dead_after_ms",
            [](ServerConfig& c) -> int64_t& { return c.workers.dead_after_ms; }, 1,
            int64_t{1} << 40, "must be >= 1"));
        s.push_back(Int<int64_t>(
            "workers.step_timeout_ms",
            [](ServerConfig& c) -> int64_t& { return c.workers.step_timeout_ms; }, 1,
            int64_t{1} << 40, "must be >= 1"));
        s.push_back(String("workers.token",
                           [](ServerConfig& c) -> std::string& { return c.workers.token; }));
        s.push_back(Int<int>(
            "workers.restart_limit",
            [](ServerConfig& c) -> int& { return c.workers.restart_limit; }, 0, 1'000'000,
            "must be >= 0 (0: never restart)"));
        s.push_back(Int<int64_t>(
            "workers.restart_backoff_ms",
            [](ServerConfig& c) -> int64_t& { return c.workers.restart_backoff_ms; }, 0,
            int64_t{1} << 40, "must be >= 0"));
        return s;
    }();
    return kSettings;
}

const Setting* FindSetting(std::string_view key) {
    for (const Setting& s : Settings()) {
        if (s.key == key) return &s;
    }
    return nullptr;
}

}  // namespace kvshard::config_keys
