#include "coordinator/responses_response.h"

#include <nlohmann/json.hpp>

#include "coordinator/openai_protocol.h"

namespace kvshard {

using nlohmann::json;

namespace {

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json Optional(const std::optional<std::string>& v) { return v ? json(*v) : json(nullptr); }

}  // namespace

ResponsesResponseWriter::ResponsesResponseWriter(ResponsesContext context)
    : context_(std::move(context)) {}

std::string ResponsesResponseWriter::FinalStatus() const {
    return finish_ == FinishReason::kLength ? "incomplete" : "completed";
}

json ResponsesResponseWriter::TextPart() const {
    return {{"type", "output_text"},
            {"text", text_},
            {"annotations", json::array()},
            {"logprobs", json::array()}};
}

json ResponsesResponseWriter::Message(const std::string& status, bool with_content) const {
    return {{"type", "message"},
            {"id", context_.message_id},
            {"status", status},
            {"role", "assistant"},
            {"content", with_content ? json::array({TextPart()}) : json::array()}};
}

json ResponsesResponseWriter::Response(const std::string& status, const GenerationUsage* usage,
                                       const ApiError* error) const {
    json output = json::array();
    if (status == "completed" || status == "incomplete") output.push_back(Message(status, true));
    json r = {{"id", context_.id},
              {"object", "response"},
              {"created_at", context_.created_at},
              {"status", status},
              {"background", false},
              {"error", nullptr},
              {"incomplete_details", nullptr},
              {"instructions", Optional(context_.instructions)},
              {"max_output_tokens", context_.max_output_tokens
                                        ? json(*context_.max_output_tokens)
                                        : json(nullptr)},
              {"metadata", json::parse(context_.metadata, nullptr, false)},
              {"model", context_.model},
              {"output", std::move(output)},
              {"parallel_tool_calls", context_.parallel_tool_calls},
              {"previous_response_id", nullptr},
              {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
              {"service_tier", context_.service_tier},
              {"store", false},
              {"temperature", context_.temperature},
              {"text", {{"format", json::parse(context_.text_format, nullptr, false)}}},
              {"tool_choice", "auto"},
              {"tools", json::array()},
              {"top_p", context_.top_p},
              {"truncation", "disabled"},
              {"usage", nullptr},
              {"user", Optional(context_.user)}};
    if (status == "incomplete") r["incomplete_details"] = {{"reason", "max_output_tokens"}};
    if (error != nullptr) {
        r["error"] = {{"code", error->code.empty() ? error->type : error->code},
                      {"message", error->message}};
    }
    if (usage != nullptr) {
        r["usage"] = {{"input_tokens", usage->prompt_tokens},
                      {"input_tokens_details", {{"cached_tokens", usage->cached_tokens}}},
                      {"output_tokens", usage->completion_tokens},
                      {"output_tokens_details", {{"reasoning_tokens", 0}}},
                      {"total_tokens", usage->prompt_tokens + usage->completion_tokens}};
    }
    return r;
}

std::string ResponsesResponseWriter::Event(const std::string& type, json data) {
    data["type"] = type;
    data["sequence_number"] = sequence_++;
    return "event: " + type + "\ndata: " + Dump(data) + "\n\n";
}

std::string ResponsesResponseWriter::OpenItem() {
    if (item_open_) return "";
    item_open_ = true;
    std::string out = Event("response.output_item.added",
                            {{"output_index", 0}, {"item", Message("in_progress", false)}});
    json part = TextPart();
    part["text"] = "";
    out += Event("response.content_part.added", {{"item_id", context_.message_id},
                                                 {"output_index", 0},
                                                 {"content_index", 0},
                                                 {"part", std::move(part)}});
    return out;
}

std::string ResponsesResponseWriter::StreamStart() {
    const json r = Response("in_progress", nullptr, nullptr);
    // One statement per event: sequence numbers follow the order of the calls.
    std::string out = Event("response.created", {{"response", r}});
    out += Event("response.in_progress", {{"response", r}});
    return out;
}

std::string ResponsesResponseWriter::StreamDelta(const GenerationDelta& delta) {
    if (delta.index != 0) return "";
    if (delta.finish_reason) finish_ = delta.finish_reason;
    if (delta.text.empty()) return "";
    text_ += delta.text;
    std::string out = OpenItem();
    out += Event("response.output_text.delta", {{"item_id", context_.message_id},
                                                {"output_index", 0},
                                                {"content_index", 0},
                                                {"delta", delta.text},
                                                {"logprobs", json::array()}});
    return out;
}

std::string ResponsesResponseWriter::StreamFinish(const GenerationUsage& usage) {
    const std::string status = FinalStatus();
    std::string out = OpenItem();
    out += Event("response.output_text.done", {{"item_id", context_.message_id},
                                               {"output_index", 0},
                                               {"content_index", 0},
                                               {"text", text_},
                                               {"logprobs", json::array()}});
    out += Event("response.content_part.done", {{"item_id", context_.message_id},
                                                {"output_index", 0},
                                                {"content_index", 0},
                                                {"part", TextPart()}});
    out += Event("response.output_item.done",
                 {{"output_index", 0}, {"item", Message(status, true)}});
    out += Event(status == "completed" ? "response.completed" : "response.incomplete",
                 {{"response", Response(status, &usage, nullptr)}});
    return out;
}

std::string ResponsesResponseWriter::StreamError(const ApiError& error) {
    return Event("response.failed", {{"response", Response("failed", nullptr, &error)}});
}

void ResponsesResponseWriter::Add(const GenerationDelta& delta) {
    if (delta.index != 0) return;
    text_ += delta.text;
    if (delta.finish_reason) finish_ = delta.finish_reason;
}

std::string ResponsesResponseWriter::Body(const GenerationUsage& usage) {
    return Dump(Response(FinalStatus(), &usage, nullptr));
}

}  // namespace kvshard
