// libFuzzer target for the OpenAI request parser (coordinator/openai_protocol.h), both
// endpoints: the first byte picks the endpoint, the rest is the body. Parsing must never throw
// or crash; an accepted request must hold only values the validation allows, and an error must
// be a JSON error body with a message and a 4xx status.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "coordinator/fuzz/fuzz_util.h"
#include "coordinator/openai_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    using namespace kvshard;
    if (size == 0) return 0;
    const ApiEndpoint endpoint =
        (data[0] & 1) != 0 ? ApiEndpoint::kChatCompletions : ApiEndpoint::kCompletions;
    const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
    static const ServedModel model{"m", "/models/m.gguf", 258};

    ParsedRequest parsed = ParseOpenAiRequest(endpoint, body, model);
    if (const auto* e = std::get_if<ApiError>(&parsed)) {
        KVSHARD_FUZZ_CHECK(e->http_status == 400 || e->http_status == 404);
        KVSHARD_FUZZ_CHECK(!e->message.empty());
        const nlohmann::json j = nlohmann::json::parse(ApiErrorBody(*e), nullptr, false);
        KVSHARD_FUZZ_CHECK(j.is_object() && j["error"]["message"].is_string());
        return 0;
    }
    const OpenAiRequest& r = std::get<OpenAiRequest>(parsed);
    KVSHARD_FUZZ_CHECK(r.endpoint == endpoint);
    KVSHARD_FUZZ_CHECK(r.n >= 1 && r.n <= 16);
    KVSHARD_FUZZ_CHECK(r.stop.size() <= 4);
    for (const std::string& s : r.stop) KVSHARD_FUZZ_CHECK(!s.empty());
    KVSHARD_FUZZ_CHECK(r.sampling.temperature >= 0 && r.sampling.temperature <= 2);
    KVSHARD_FUZZ_CHECK(r.sampling.top_p > 0 && r.sampling.top_p <= 1);
    KVSHARD_FUZZ_CHECK(!r.max_tokens || *r.max_tokens > 0);
    KVSHARD_FUZZ_CHECK(r.num_top_logprobs >= -1 && r.num_top_logprobs <= 20);
    KVSHARD_FUZZ_CHECK(!r.include_usage || r.stream);
    if (endpoint == ApiEndpoint::kCompletions) {
        KVSHARD_FUZZ_CHECK(r.prompt_is_token_ids ? !r.prompt_token_ids.empty() : !r.prompt.empty());
        for (int32_t id : r.prompt_token_ids) KVSHARD_FUZZ_CHECK(id >= 0 && id < 258);
    } else {
        KVSHARD_FUZZ_CHECK(!r.messages.empty());
    }
    return 0;
}
