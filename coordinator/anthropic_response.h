// The response half of Anthropic's Messages API, built from the engine's GenerationDeltas:
//
//   whole   {"id": "msg_...", "type": "message", "role": "assistant", "model", "content": [text
//           and tool_use blocks], "stop_reason": end_turn | max_tokens | stop_sequence |
//           tool_use, "stop_sequence", "usage": {"input_tokens",
//           "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens"}}
//   stream  "event: <type>\ndata: <json>\n\n": message_start and ping with the first output,
//           then per block content_block_start, content_block_delta (text_delta, or one
//           input_json_delta with a call's whole arguments), content_block_stop; at the end
//           message_delta (stop_reason, stop_sequence and the final usage) and message_stop.
//           message_start's usage counts the whole prompt as input_tokens: the split into
//           cached, written and uncached tokens is known only at the end (message_delta).
//   error   {"type": "error", "error": {...}} (an "error" event in a stream).
//
// Usage adds up: input_tokens + cache_creation_input_tokens + cache_read_input_tokens = the
// prompt's tokens.
//
// Thread-safety: none; one session uses a writer at a time.
#pragma once

#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/engine_api.h"
#include "coordinator/response_writer.h"
#include "coordinator/tool_calls.h"

namespace kvshard {

struct AnthropicResponseContext {
    std::string id;     // "msg_..."
    std::string model;  // the served model name
    int64_t prompt_tokens = 0;
    std::vector<std::string> stop_sequences;
    // Set when the request offers tools: the output is parsed for calls.
    std::optional<ToolCallParserOptions> tools;
    // Decodes generated ids to text, to tell which stop sequence ended the answer.
    std::function<std::string(const std::vector<int32_t>&)> decode;
};

// The usage object of an answer.
nlohmann::json AnthropicUsageJson(const GenerationUsage& usage);

class AnthropicResponseWriter : public ResponseWriter {
  public:
    explicit AnthropicResponseWriter(AnthropicResponseContext context);

    std::string StreamStart() override;
    std::string StreamDelta(const GenerationDelta& delta) override;
    std::string StreamFinish(const GenerationUsage& usage) override;
    std::string StreamError(const ApiError& error) override;

    void Add(const GenerationDelta& delta) override;
    std::string Body(const GenerationUsage& usage) override;

  private:
    struct Block {
        std::string type;  // "text" or "tool_use"
        std::string text;
        ToolCallOutput::Call call;
    };
    // Runs a delta's text through the tool-call parser; the blocks it completes or extends.
    std::vector<ToolCallOutput> Outputs(const GenerationDelta& delta);
    std::vector<ToolCallOutput> End();
    std::string StreamOutputs(const std::vector<ToolCallOutput>& outputs);
    void AddOutputs(const std::vector<ToolCallOutput>& outputs);
    std::string MessageStart();
    std::string CloseBlock();
    std::string StopReason() const;
    std::string MatchedStopSequence() const;

    AnthropicResponseContext context_;
    std::optional<ToolCallParser> parser_;
    std::vector<Block> blocks_;  // whole answers
    bool started_ = false;       // streams: message_start sent
    bool block_open_ = false;    // streams: a text block is open
    int next_index_ = 0;         // streams: the next block's index
    int num_calls_ = 0;
    std::string text_;                // all text the engine sent
    std::vector<int32_t> token_ids_;  // all generated ids
    std::optional<FinishReason> finish_;
};

}  // namespace kvshard
