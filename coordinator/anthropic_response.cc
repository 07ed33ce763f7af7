#include "coordinator/anthropic_response.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "coordinator/anthropic_protocol.h"
#include "coordinator/json_fields.h"

namespace kvshard {

using nlohmann::json;

namespace {

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string Event(std::string_view type, const json& data) {
    return "event: " + std::string(type) + "\ndata: " + Dump(data) + "\n\n";
}

json Input(const std::string& arguments) {
    json input = json_fields::ParseJson(arguments);
    return input.is_object() ? input : json::object();
}

json Nullable(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

}  // namespace

json AnthropicUsageJson(const GenerationUsage& usage) {
    const int64_t uncached = std::max<int64_t>(
        0, usage.prompt_tokens - usage.cached_tokens - usage.cache_creation_tokens);
    return {{"input_tokens", uncached},
            {"cache_creation_input_tokens", usage.cache_creation_tokens},
            {"cache_read_input_tokens", usage.cached_tokens},
            {"output_tokens", usage.completion_tokens}};
}

AnthropicResponseWriter::AnthropicResponseWriter(AnthropicResponseContext context)
    : context_(std::move(context)) {
    if (context_.tools) parser_.emplace(*context_.tools);
}

std::vector<ToolCallOutput> AnthropicResponseWriter::Outputs(const GenerationDelta& delta) {
    text_ += delta.text;
    token_ids_.insert(token_ids_.end(), delta.token_ids.begin(), delta.token_ids.end());
    std::vector<ToolCallOutput> out;
    if (parser_) {
        out = parser_->Feed(delta.text);
        if (delta.finish_reason) {
            for (ToolCallOutput& o : parser_->Finish()) out.push_back(std::move(o));
        }
    } else if (!delta.text.empty()) {
        out.push_back({delta.text, std::nullopt});
    }
    if (delta.finish_reason) finish_ = delta.finish_reason;
    for (const ToolCallOutput& o : out) num_calls_ += o.call ? 1 : 0;
    return out;
}

// The answer ended without a finishing delta (it failed or was cut short): what the parser
// still holds.
std::vector<ToolCallOutput> AnthropicResponseWriter::End() {
    if (finish_) return {};
    GenerationDelta end;
    end.finish_reason = FinishReason::kAbort;
    return Outputs(end);
}

std::string AnthropicResponseWriter::MatchedStopSequence() const {
    if (finish_ != FinishReason::kStop || context_.stop_sequences.empty() || !context_.decode) {
        return "";
    }
    // The engine's text ends before the stop sequence; the generated ids still hold it. A few
    // bytes of slack: a decode of the whole output may differ from the streamed text in a
    // leading space.
    const std::string full = context_.decode(token_ids_);
    const size_t from =
        std::min(full.size(), text_.size()) >= 4 ? std::min(full.size(), text_.size()) - 4 : 0;
    std::string best;
    size_t best_at = std::string::npos;
    for (const std::string& s : context_.stop_sequences) {
        const size_t at = full.find(s, from);
        if (at != std::string::npos && (best_at == std::string::npos || at < best_at)) {
            best = s;
            best_at = at;
        }
    }
    return best;
}

std::string AnthropicResponseWriter::StopReason() const {
    if (num_calls_ > 0) return "tool_use";
    if (finish_ == FinishReason::kLength) return "max_tokens";
    if (!MatchedStopSequence().empty()) return "stop_sequence";
    return "end_turn";
}

std::string AnthropicResponseWriter::MessageStart() {
    started_ = true;
    GenerationUsage prompt;
    prompt.prompt_tokens = context_.prompt_tokens;
    const json message = {{"id", context_.id},        {"type", "message"},
                          {"role", "assistant"},      {"model", context_.model},
                          {"content", json::array()}, {"stop_reason", nullptr},
                          {"stop_sequence", nullptr}, {"usage", AnthropicUsageJson(prompt)}};
    return Event("message_start", {{"type", "message_start"}, {"message", message}}) +
           Event("ping", {{"type", "ping"}});
}

std::string AnthropicResponseWriter::CloseBlock() {
    if (!block_open_) return "";
    block_open_ = false;
    return Event("content_block_stop", {{"type", "content_block_stop"}, {"index", next_index_++}});
}

std::string AnthropicResponseWriter::StreamOutputs(const std::vector<ToolCallOutput>& outputs) {
    std::string out;
    for (const ToolCallOutput& o : outputs) {
        if (!o.call) {
            if (o.text.empty()) continue;
            if (!block_open_) {
                block_open_ = true;
                out += Event("content_block_start",
                             {{"type", "content_block_start"},
                              {"index", next_index_},
                              {"content_block", {{"type", "text"}, {"text", ""}}}});
            }
            out += Event("content_block_delta",
                         {{"type", "content_block_delta"},
                          {"index", next_index_},
                          {"delta", {{"type", "text_delta"}, {"text", o.text}}}});
            continue;
        }
        out += CloseBlock();
        const int index = next_index_++;
        out += Event("content_block_start", {{"type", "content_block_start"},
                                             {"index", index},
                                             {"content_block",
                                              {{"type", "tool_use"},
                                               {"id", o.call->id},
                                               {"name", o.call->name},
                                               {"input", json::object()}}}});
        out +=
            Event("content_block_delta",
                  {{"type", "content_block_delta"},
                   {"index", index},
                   {"delta", {{"type", "input_json_delta"}, {"partial_json", o.call->arguments}}}});
        out += Event("content_block_stop", {{"type", "content_block_stop"}, {"index", index}});
    }
    return out;
}

std::string AnthropicResponseWriter::StreamStart() { return ""; }

std::string AnthropicResponseWriter::StreamDelta(const GenerationDelta& delta) {
    if (delta.index != 0 || finish_) return "";
    std::vector<ToolCallOutput> outputs = Outputs(delta);
    std::string out;
    if (!started_ && (!outputs.empty() || finish_)) out += MessageStart();
    out += StreamOutputs(outputs);
    if (finish_) out += CloseBlock();
    return out;
}

std::string AnthropicResponseWriter::StreamFinish(const GenerationUsage& usage) {
    std::string out;
    if (!started_) out += MessageStart();
    out += StreamOutputs(End());
    out += CloseBlock();
    const json delta = {{"stop_reason", StopReason()},
                        {"stop_sequence", Nullable(MatchedStopSequence())}};
    out +=
        Event("message_delta",
              {{"type", "message_delta"}, {"delta", delta}, {"usage", AnthropicUsageJson(usage)}});
    out += Event("message_stop", {{"type", "message_stop"}});
    return out;
}

std::string AnthropicResponseWriter::StreamError(const ApiError& error) {
    return "event: error\ndata: " + AnthropicErrorBody(error) + "\n\n";
}

void AnthropicResponseWriter::AddOutputs(const std::vector<ToolCallOutput>& outputs) {
    for (const ToolCallOutput& o : outputs) {
        if (o.call) {
            blocks_.push_back({"tool_use", "", *o.call});
        } else if (!o.text.empty()) {
            if (blocks_.empty() || blocks_.back().type != "text")
                blocks_.push_back({"text", "", {}});
            blocks_.back().text += o.text;
        }
    }
}

void AnthropicResponseWriter::Add(const GenerationDelta& delta) {
    if (delta.index != 0 || finish_) return;
    AddOutputs(Outputs(delta));
}

std::string AnthropicResponseWriter::Body(const GenerationUsage& usage) {
    AddOutputs(End());
    json content = json::array();
    for (const Block& b : blocks_) {
        if (b.type == "text") {
            content.push_back({{"type", "text"}, {"text", b.text}});
        } else {
            content.push_back({{"type", "tool_use"},
                               {"id", b.call.id},
                               {"name", b.call.name},
                               {"input", Input(b.call.arguments)}});
        }
    }
    const json body = {{"id", context_.id},
                       {"type", "message"},
                       {"role", "assistant"},
                       {"model", context_.model},
                       {"content", std::move(content)},
                       {"stop_reason", StopReason()},
                       {"stop_sequence", Nullable(MatchedStopSequence())},
                       {"usage", AnthropicUsageJson(usage)}};
    return Dump(body);
}

}  // namespace kvshard
