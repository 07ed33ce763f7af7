// The serving config: defaults, every key read, flag overrides, and errors naming file, line, key
// and value.
#include "config/server_config.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "common/build_config.h"
#include "tests/test_util.h"

namespace kvshard {
namespace {

TEST(ServerConfig, Defaults) {
    auto c = ParseServerConfig("model: m.gguf\n", "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->model_path, "m.gguf");
    EXPECT_EQ(c->tp, 1);
    EXPECT_EQ(c->http.host, "127.0.0.1");
    EXPECT_EQ(c->http.port, 8000);
    EXPECT_TRUE(c->http.api_keys.empty());
    EXPECT_EQ(c->http.max_body_bytes, 1 << 20);
    EXPECT_EQ(c->scheduler.max_num_seqs, 64);
    EXPECT_EQ(c->scheduler.max_num_batched_tokens, 512);
    EXPECT_EQ(c->scheduler.max_model_len, 0);
    EXPECT_EQ(c->kv_cache.block_size, 16);
    EXPECT_EQ(c->kv_cache.num_blocks, 0);
    EXPECT_EQ(c->kv_cache.memory_mib, 512);
    EXPECT_FALSE(c->kv_cache.dtype.has_value());  // auto
    EXPECT_TRUE(c->kv_cache.enable_prefix_caching);
    EXPECT_EQ(c->log_level, "info");
}

TEST(ServerConfig, ReadsEveryKey) {
    const char* yaml = R"(
model: /m/model.gguf
tokenizer: /m/tok.bin
served_model_name: smol
chat_template: chatml
tp: 2
threads: 3
log_level: debug
server:
  host: 0.0.0.0
  port: 9001
  threads: 4
  api_keys: [k1, k2]
  max_body_bytes: 65536
  request_timeout_s: 30.5
  idle_timeout_s: 5
scheduler:
  max_num_seqs: 8
  max_num_batched_tokens: 256
  max_waiting_requests: 100
  max_model_len: 2048
kv_cache:
  block_size: 32
  num_blocks: 1000
  memory_mib: 64
  dtype: int8
  enable_prefix_caching: false
  max_pinned_fraction: 0.25
  min_pinned_tokens: 2048
)";
    auto c = ParseServerConfig(yaml, "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->model_path, "/m/model.gguf");
    EXPECT_EQ(c->tokenizer_path, "/m/tok.bin");
    EXPECT_EQ(c->served_model_names, (std::vector<std::string>{"smol"}));
    EXPECT_EQ(c->chat_template, "chatml");
    EXPECT_EQ(c->tp, 2);
    EXPECT_EQ(c->threads, 3);
    EXPECT_EQ(c->log_level, "debug");
    EXPECT_EQ(c->http.host, "0.0.0.0");
    EXPECT_EQ(c->http.port, 9001);
    EXPECT_EQ(c->http.num_threads, 4);
    EXPECT_EQ(c->http.api_keys, (std::vector<std::string>{"k1", "k2"}));
    EXPECT_EQ(c->http.max_body_bytes, 65536);
    EXPECT_DOUBLE_EQ(c->http.request_timeout_s, 30.5);
    EXPECT_DOUBLE_EQ(c->http.idle_timeout_s, 5);
    EXPECT_EQ(c->scheduler.max_num_seqs, 8);
    EXPECT_EQ(c->scheduler.max_num_batched_tokens, 256);
    EXPECT_EQ(c->scheduler.max_waiting_requests, 100);
    EXPECT_EQ(c->scheduler.max_model_len, 2048);
    EXPECT_EQ(c->kv_cache.block_size, 32);
    EXPECT_EQ(c->kv_cache.num_blocks, 1000);
    EXPECT_EQ(c->kv_cache.memory_mib, 64);
    EXPECT_EQ(c->kv_cache.dtype, KvDtype::kInt8);
    EXPECT_FALSE(c->kv_cache.enable_prefix_caching);
    EXPECT_DOUBLE_EQ(c->kv_cache.max_pinned_fraction, 0.25);
    EXPECT_EQ(c->kv_cache.min_pinned_tokens, 2048);
}

TEST(ServerConfig, OverridesWinAndAreValidated) {
    auto c = ParseServerConfig("model: a.gguf\nserver:\n  port: 9000\n", "serve.yaml",
                               {{"server.port", "0", "--port"},
                                {"model", "b.gguf", "--model"},
                                {"server.api_keys", "x,y", "--api-key"},
                                {"tp", "4", "--tp"}});
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_EQ(c->http.port, 0);
    EXPECT_EQ(c->model_path, "b.gguf");
    EXPECT_EQ(c->tp, 4);
    EXPECT_EQ(c->http.api_keys, (std::vector<std::string>{"x", "y"}));

    // CORS origins: a list in the file, comma-separated in --set; off by default.
    EXPECT_TRUE(c->http.cors_allowed_origins.empty());
    auto cors = ParseServerConfig(
        "model: a.gguf\nserver:\n  cors_allowed_origins: [\"https://a.example\", \"*\"]\n",
        "serve.yaml", {});
    ASSERT_TRUE(cors.ok()) << cors.status().ToString();
    EXPECT_EQ(cors->http.cors_allowed_origins,
              (std::vector<std::string>{"https://a.example", "*"}));
    cors = ParseServerConfig("model: a.gguf\n", "serve.yaml",
                             {{"server.cors_allowed_origins",
                               "http://localhost:3000,https://b.example:8443", "--set"}});
    ASSERT_TRUE(cors.ok()) << cors.status().ToString();
    EXPECT_EQ(cors->http.cors_allowed_origins,
              (std::vector<std::string>{"http://localhost:3000", "https://b.example:8443"}));
    for (const char* bad_origin : {"a.example", "https://a.example/", "https://a.example/app"}) {
        auto refused = ParseServerConfig("model: a.gguf\n", "serve.yaml",
                                         {{"server.cors_allowed_origins", bad_origin, "--set"}});
        ASSERT_FALSE(refused.ok()) << bad_origin;
        EXPECT_NE(refused.status().message().find("server.cors_allowed_origins"), std::string::npos)
            << refused.status().message();
    }

    auto bad =
        ParseServerConfig("model: a.gguf\n", "serve.yaml", {{"server.port", "http", "--port"}});
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().message(),
              "flag --port: server.port: invalid value 'http': expected an integer");
    // No file at all: defaults plus flags.
    auto flags_only = LoadServerConfig("", {{"model", "m.gguf", "--model"}});
    ASSERT_TRUE(flags_only.ok()) << flags_only.status().ToString();
    EXPECT_EQ(flags_only->model_path, "m.gguf");
}

// Each bad config and a piece its message must contain (file:line, key, value).
TEST(ServerConfig, ErrorsNameFileKeyAndValue) {
    struct Case {
        const char* yaml;
        const char* expect;
    };
    const Case cases[] = {
        {"model: m\nscheduler:\n  max_num_seqs: -3\n",
         "serve.yaml:3: scheduler.max_num_seqs: invalid value '-3': must be >= 1"},
        {"model: m\nserver:\n  port: 70000\n", "serve.yaml:3: server.port: invalid value '70000'"},
        {"model: m\nserver:\n  port: eighty\n",
         "server.port: invalid value 'eighty': expected an integer"},
        {"model: m\nkv_cache:\n  dtype: fp8_e5m2\n",
         "serve.yaml:3: kv_cache.dtype: invalid value 'fp8_e5m2': expected auto, fp32, fp16, bf16, "
         "fp8 or int8"},
        {"model: m\nkv_cache:\n  enable_prefix_caching: maybe\n",
         "kv_cache.enable_prefix_caching: invalid value 'maybe'"},
        {"model: m\nkv_cache:\n  max_pinned_fraction: 1.5\n",
         "kv_cache.max_pinned_fraction: invalid value '1.5': must be in 0..1"},
        {"model: m\nkv_cache:\n  min_pinned_tokens: -1\n",
         "kv_cache.min_pinned_tokens: invalid value '-1'"},
        {"model: m\nlog_level: loud\n", "serve.yaml:2: log_level: invalid value 'loud'"},
        {"model: m\nmax_num_seqs: 4\n", "serve.yaml:2: unknown key 'max_num_seqs'"},
        {"model: m\nscheduler:\n  max_num_seq: 4\n",
         "serve.yaml:3: unknown key 'scheduler.max_num_seq'"},
        {"model: m\nserver: 8000\n", "server: expected a map of settings"},
        {"model: m\nserver:\n  api_keys: key\n", "server.api_keys: expected a list of strings"},
        {"model: m\nserved_model_name: [a, '']\n",
         "served_model_name: invalid value '': a served model name must not be empty"},
        {"model: m\nserved_model_name: {a: b}\n",
         "served_model_name: expected a name or a list of names"},
        {"model: m\nserver:\n  api_keys: ['']\n", "server.api_keys: invalid value ''"},
        {"model: m\nserver:\n  host: ''\n", "server.host: invalid value '': must not be empty"},
        {"model: m\ntp: [1, 2]\n", "tp: expected a single value, got a list"},
        {"model: m\ntp: 0\n", "tp: invalid value '0': must be >= 1"},
        {"model: m\nserver:\n  max_body_bytes: 10\n", "server.max_body_bytes: invalid value '10'"},
        {"model: m\nserver:\n  idle_timeout_s: 0\n",
         "server.idle_timeout_s: invalid value '0': must be > 0"},
        {"model: m\nserver:\n  request_timeout_s: -1\n",
         "server.request_timeout_s: invalid value '-1'"},
        {"model: m\nkv_cache:\n  block_size: 0\n", "kv_cache.block_size: invalid value '0'"},
        {"model: m\nscheduler:\n  max_num_seqs: 64\n  max_num_batched_tokens: 32\n",
         "scheduler.max_num_batched_tokens (32) must be >= scheduler.max_num_seqs (64)"},
        {"tp: 2\n", "serve.yaml: model: required"},
        {"model: [unclosed\n", "serve.yaml:2: not valid YAML"},
        {"- a\n- b\n", "serve.yaml: expected a map of settings at the top"},
    };
    for (const Case& c : cases) {
        auto r = ParseServerConfig(c.yaml, "serve.yaml");
        ASSERT_FALSE(r.ok()) << c.yaml;
        EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.yaml;
        EXPECT_NE(r.status().message().find(c.expect), std::string::npos)
            << "yaml:\n"
            << c.yaml << "message: " << r.status().message();
    }
}

// The file's sections are the engine's own types (config/engine_config.h): the block manager
// takes kv_cache: as it is, with only the pool's size and the model's windows resolved, so every
// block manager setting of the file reaches it without a copy.
TEST(ServerConfig, SectionsAreTheEnginesTypes) {
    auto c = ParseServerConfig(R"(model: m
scheduler:
  max_num_seqs: 8
  max_num_batched_tokens: 96
  max_waiting_requests: 3
kv_cache:
  block_size: 32
  enable_prefix_caching: false
  max_pinned_fraction: 0.25
  min_pinned_tokens: 64
kv_transfer:
  mode: layerwise
  timeout_ms: 500
)",
                               "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    const SchedulerConfig scheduler = c->scheduler;
    EXPECT_TRUE(scheduler.Validate().ok());
    EXPECT_EQ(scheduler.max_waiting_requests, 3);
    BlockManagerConfig blocks = c->kv_cache;
    EXPECT_FALSE(blocks.Validate().ok()) << "num_blocks 0 in the file: serve resolves it";
    blocks.num_blocks = 100;
    ASSERT_TRUE(blocks.Validate().ok()) << blocks.Validate().ToString();
    EXPECT_EQ(blocks.block_size, 32);
    EXPECT_FALSE(blocks.enable_prefix_caching);
    EXPECT_DOUBLE_EQ(blocks.max_pinned_fraction, 0.25);
    EXPECT_EQ(blocks.min_pinned_tokens, 64);
    const KvTransferConfig handoff = c->kv_transfer;
    EXPECT_TRUE(handoff.layerwise);
    EXPECT_EQ(handoff.timeout_ms, 500);
}

// SchedulerConfig::Validate is the one check of the scheduler's settings, for the file and for
// every engine (simulate and tests build them by hand).
TEST(SchedulerConfig, ValidateNamesTheKeys) {
    struct Case {
        SchedulerConfig config;
        std::string expect;  // "" when valid
    };
    const Case cases[] = {
        {{.max_num_seqs = 4, .max_num_batched_tokens = 4}, ""},
        {{.max_num_seqs = 0, .max_num_batched_tokens = 4},
         "scheduler.max_num_seqs must be positive"},
        {{.max_num_seqs = 8, .max_num_batched_tokens = 4},
         "scheduler.max_num_batched_tokens (4) must be >= scheduler.max_num_seqs (8)"},
        {{.max_num_seqs = 4, .max_num_batched_tokens = 4, .max_waiting_requests = -1},
         "scheduler.max_waiting_requests must be >= 0, got -1"},
    };
    for (const Case& c : cases) {
        const Status st = c.config.Validate();
        if (c.expect.empty()) {
            EXPECT_TRUE(st.ok()) << st.ToString();
        } else {
            EXPECT_NE(st.message().find(c.expect), std::string::npos) << st.message();
        }
    }
}

// served_model_name: one name or a list in the file ("" is none), comma-separated in a flag;
// the flags that `kvshard serve` spells as vLLM does name themselves in errors.
TEST(ServerConfig, ServedModelNamesAndVllmFlags) {
    auto one = ParseServerConfig("model: m\nserved_model_name: smol\n", "serve.yaml");
    ASSERT_TRUE(one.ok()) << one.status().ToString();
    EXPECT_EQ(one->served_model_names, (std::vector<std::string>{"smol"}));
    auto none = ParseServerConfig("model: m\nserved_model_name: ''\n", "serve.yaml");
    ASSERT_TRUE(none.ok()) << none.status().ToString();
    EXPECT_TRUE(none->served_model_names.empty());
    auto flags = ParseServerConfig("model: m\nserved_model_name: [x]\n", "serve.yaml",
                                   {{"served_model_name", "org/a,b", "--served-model-name"},
                                    {"scheduler.max_model_len", "1024", "--max-model-len"},
                                    {"kv_cache.dtype", "int8", "--kv-cache-dtype"}});
    ASSERT_TRUE(flags.ok()) << flags.status().ToString();
    EXPECT_EQ(flags->served_model_names, (std::vector<std::string>{"org/a", "b"}));
    EXPECT_EQ(flags->scheduler.max_model_len, 1024);
    EXPECT_EQ(flags->kv_cache.dtype, KvDtype::kInt8);
    // Every KV dtype parses (every pool stores fp32, bf16, fp16, int8 and fp8),
    // vLLM's fp8_e4m3 is fp8, and auto is no dtype at all.
    for (const auto& [text, dtype] : {std::pair{"bf16", std::optional<KvDtype>(KvDtype::kBf16)},
                                      std::pair{"fp8_e4m3", std::optional<KvDtype>(KvDtype::kFp8)},
                                      std::pair{"auto", std::optional<KvDtype>()}}) {
        auto r = ParseServerConfig("model: m\nkv_cache:\n  dtype: int8\n", "serve.yaml",
                                   {{"kv_cache.dtype", text, "--kv-cache-dtype"}});
        ASSERT_TRUE(r.ok()) << text << ": " << r.status().ToString();
        EXPECT_EQ(r->kv_cache.dtype, dtype) << text;
    }
    for (const auto& [key, value, flag, expect] :
         {std::tuple{"scheduler.max_model_len", "4k", "--max-model-len",
                     "flag --max-model-len: scheduler.max_model_len: invalid value '4k': expected "
                     "an integer"},
          std::tuple{"kv_cache.dtype", "int4", "--kv-cache-dtype",
                     "flag --kv-cache-dtype: kv_cache.dtype: invalid value 'int4': expected "
                     "auto, fp32, fp16, bf16, fp8 or int8"},
          std::tuple{"served_model_name", "a,,b", "--served-model-name",
                     "flag --served-model-name: served_model_name: invalid value ''"}}) {
        auto r = ParseServerConfig("model: m\n", "serve.yaml", {{key, value, flag}});
        ASSERT_FALSE(r.ok()) << flag;
        EXPECT_NE(r.status().message().find(expect), std::string::npos) << r.status().message();
    }
}

TEST(ServerConfig, MissingFileIsNotFound) {
    auto r = LoadServerConfig("/nonexistent/serve.yaml");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
    EXPECT_NE(r.status().message().find("/nonexistent/serve.yaml"), std::string::npos);
}

// The example in config/examples parses, and docs/config.md documents every key it uses.
TEST(ServerConfig, ExampleParsesAndEveryKeyIsDocumented) {
    const std::string root = KVSHARD_SOURCE_DIR;
    auto c = LoadServerConfig(root + "/config/examples/serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    const std::string doc = testing::ReadFile(root + "/docs/config.md");
    EXPECT_EQ(ServerConfigKeys().size(), 49u);
    for (std::string_view key : ServerConfigKeys()) {
        EXPECT_NE(doc.find("`" + std::string(key) + "`"), std::string::npos) << key;
    }
}

// cuda_graphs: off unless asked; a boolean, named when it is not one.
TEST(ServerConfig, CudaGraphs) {
    auto c = ParseServerConfig("model: a.gguf\n", "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_FALSE(c->cuda_graphs);
    c = ParseServerConfig("model: a.gguf\ncuda_graphs: true\n", "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_TRUE(c->cuda_graphs);
    c = ParseServerConfig("model: a.gguf\n", "serve.yaml",
                          {{"cuda_graphs", "maybe", "--cuda-graphs"}});
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("cuda_graphs: invalid value 'maybe'"), std::string::npos)
        << c.status().ToString();
}

// GET /metrics under vLLM's names too: off unless asked, a boolean in the file or --set.
TEST(ServerConfig, MetricsVllmNames) {
    auto c = ParseServerConfig("model: a.gguf\n", "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_FALSE(c->http.metrics_vllm_names);
    c = ParseServerConfig("model: a.gguf\nserver:\n  metrics_vllm_names: true\n", "serve.yaml");
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_TRUE(c->http.metrics_vllm_names);
    auto bad = ParseServerConfig("model: a.gguf\n", "serve.yaml",
                                 {{"server.metrics_vllm_names", "vllm", "--set"}});
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("server.metrics_vllm_names: invalid value 'vllm'"),
              std::string::npos)
        << bad.status().message();
}

}  // namespace
}  // namespace kvshard
