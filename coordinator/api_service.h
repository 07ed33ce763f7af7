// ApiService: what the HTTP endpoints do, without the sockets. It turns a request body into a
// GenerationRequest for the engine (validate, apply the chat template, tokenize, check the
// context), and answers the small GET endpoints. HttpSession (http_session.h) does the I/O.
//
// Thread-safety: every method may be called from any HTTP thread at once; the service holds no
// mutable state besides the metrics (thread-safe) and an atomic request counter.
// Ownership: the engine, tokenizer and metrics outlive the service.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "coordinator/engine_api.h"
#include "coordinator/metrics.h"
#include "coordinator/openai_protocol.h"
#include "coordinator/openai_response.h"
#include "model/chat_template.h"
#include "model/tokenizer.h"

namespace kvshard {

struct ApiServiceOptions {
    ServedModel model;                          // name, path, vocabulary size
    std::optional<ChatTemplate> chat_template;  // nullopt: chat requests get 400
    std::vector<std::string> api_keys;          // empty: no authentication
};

// A request ready for Engine::Submit, and what its answer needs.
struct PreparedGeneration {
    GenerationRequest request;
    ResponseContext context;
    bool stream = false;
};

class ApiService {
  public:
    ApiService(Engine& engine, const Tokenizer& tokenizer, std::shared_ptr<ServerMetrics> metrics,
               ApiServiceOptions options);

    // True when no keys are configured or `authorization` is "Bearer <one of the keys>".
    bool Authorized(std::string_view authorization) const;

    std::variant<PreparedGeneration, ApiError> Prepare(ApiEndpoint endpoint,
                                                       std::string_view body) const;

    std::string ModelsBody() const;   // GET /v1/models
    // GET /health: 200 {"status":"ok"}, or 503 {"status":"unavailable","error":"..."} when the
    // engine cannot serve (Engine::Health).
    std::pair<int, std::string> Health() const;
    std::string MetricsBody() const;  // GET /metrics

    // The error a client sees for a failed Submit or a request that ended in failure.
    static ApiError ErrorFromStatus(const Status& status);

    Engine& engine() const { return engine_; }
    const std::shared_ptr<ServerMetrics>& metrics() const { return metrics_; }
    // Token bytes for logprobs: the token's text, or its piece for control tokens ("<|im_end|>").
    TokenBytesFn token_bytes() const;

  private:
    std::variant<std::vector<int32_t>, ApiError> Tokenize(const OpenAiRequest& request) const;
    std::string NewRequestId(ApiEndpoint endpoint) const;
    uint64_t RandomSeed() const;

    Engine& engine_;
    const Tokenizer& tokenizer_;
    std::shared_ptr<ServerMetrics> metrics_;
    ApiServiceOptions options_;
    int64_t created_ = 0;  // server start, Unix seconds (for /v1/models)
    uint64_t boot_nonce_ = 0;
    mutable std::atomic<uint64_t> counter_{0};
};

}  // namespace kvshard
