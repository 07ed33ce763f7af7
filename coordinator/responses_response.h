// The response half of OpenAI's Responses API (POST /v1/responses; the request half is
// responses_protocol.h): one assistant message with one output_text part.
//
//   whole    {"id": "resp_...", "object": "response", "created_at", "status": "completed" |
//            "incomplete" (max_output_tokens reached: incomplete_details.reason), "model",
//            "output": [{"type": "message", "id": "msg_...", "role": "assistant", "status",
//            "content": [{"type": "output_text", "text", "annotations": [], "logprobs": []}]}],
//            "usage": {"input_tokens", "input_tokens_details": {"cached_tokens"},
//            "output_tokens", "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens"},
//            and the request's settings echoed (instructions, max_output_tokens, temperature,
//            top_p, metadata, user, ...)}
//   stream   "event: <type>\ndata: <json>\n\n" with increasing sequence_number:
//            response.created, response.in_progress (at once), then with the first text
//            response.output_item.added and response.content_part.added, a
//            response.output_text.delta per piece of text, and at the end
//            response.output_text.done, response.content_part.done, response.output_item.done
//            and response.completed (or response.incomplete); an error mid-stream is
//            response.failed with the error. No "[DONE]" (the Responses API sends none).
//
// Thread-safety: none; one session uses a writer at a time.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

#include "coordinator/engine_api.h"
#include "coordinator/response_writer.h"

namespace kvshard {

struct ResponsesContext {
    std::string id;          // "resp_..."
    std::string message_id;  // "msg_..."
    int64_t created_at = 0;  // Unix seconds
    std::string model;
    // The request's settings, echoed.
    std::optional<std::string> instructions;
    std::optional<int64_t> max_output_tokens;
    double temperature = 1.0;
    double top_p = 1.0;
    std::string metadata = "{}";  // JSON object text
    std::optional<std::string> user;
    std::string service_tier = "auto";
    bool parallel_tool_calls = true;
    std::string text_format = R"({"type":"text"})";  // text.format, JSON object text
};

class ResponsesResponseWriter : public ResponseWriter {
  public:
    explicit ResponsesResponseWriter(ResponsesContext context);

    std::string StreamStart() override;
    std::string StreamDelta(const GenerationDelta& delta) override;
    std::string StreamFinish(const GenerationUsage& usage) override;
    std::string StreamError(const ApiError& error) override;
    void Add(const GenerationDelta& delta) override;
    std::string Body(const GenerationUsage& usage) override;

  private:
    // The response object: "in_progress" (no usage), "completed", "incomplete" or "failed".
    nlohmann::json Response(const std::string& status, const GenerationUsage* usage,
                            const ApiError* error) const;
    nlohmann::json Message(const std::string& status, bool with_content) const;
    nlohmann::json TextPart() const;
    std::string Event(const std::string& type, nlohmann::json data);
    std::string OpenItem();  // output_item.added and content_part.added, once
    std::string FinalStatus() const;  // "completed" or "incomplete"

    ResponsesContext context_;
    std::string text_;
    std::optional<FinishReason> finish_;
    bool item_open_ = false;
    int64_t sequence_ = 0;
};

}  // namespace kvshard
