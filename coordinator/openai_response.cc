#include "coordinator/openai_response.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "common/utf8.h"

namespace kvshard {

using nlohmann::json;

namespace {

// Every JSON string we emit must be valid UTF-8; token bytes need not be.
std::string ValidUtf8(std::string_view bytes) {
    if (IsValidUtf8(bytes)) return std::string(bytes);
    std::string out;
    size_t pos = 0;
    while (pos < bytes.size()) AppendUtf8(DecodeUtf8(bytes, &pos), &out);
    return out;
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// The API writes -inf log probabilities as -9999.
double Logprob(float lp) { return std::isfinite(lp) ? lp : -9999.0; }

json ByteList(const std::string& bytes) {
    json list = json::array();
    for (unsigned char c : bytes) list.push_back(static_cast<int>(c));
    return list;
}

json ChatLogprobs(const std::vector<GeneratedTokenLogprob>& tokens,
                  const TokenBytesFn& token_bytes) {
    json content = json::array();
    for (const GeneratedTokenLogprob& t : tokens) {
        const std::string bytes = token_bytes(t.token_id);
        json top = json::array();
        for (const TokenLogprob& alt : t.top) {
            const std::string alt_bytes = token_bytes(alt.token_id);
            top.push_back({{"token", ValidUtf8(alt_bytes)},
                           {"logprob", Logprob(alt.logprob)},
                           {"bytes", ByteList(alt_bytes)}});
        }
        content.push_back({{"token", ValidUtf8(bytes)},
                           {"logprob", Logprob(t.logprob)},
                           {"bytes", ByteList(bytes)},
                           {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
}

json EmptyCompletionLogprobs() {
    return {{"tokens", json::array()},
            {"token_logprobs", json::array()},
            {"top_logprobs", json::array()},
            {"text_offset", json::array()}};
}

// Appends one token to a completions logprobs object; `logprob` and `top` may be null (the
// prompt's first token). `offset`, the byte offset of the token in the choice's text, is advanced
// past it.
void AppendCompletionToken(const std::string& bytes, json logprob, json top, int64_t* offset,
                           json* out) {
    (*out)["tokens"].push_back(ValidUtf8(bytes));
    (*out)["token_logprobs"].push_back(std::move(logprob));
    (*out)["top_logprobs"].push_back(std::move(top));
    (*out)["text_offset"].push_back(*offset);
    *offset += static_cast<int64_t>(bytes.size());
}

json TopJson(const std::vector<TokenLogprob>& top, const TokenBytesFn& token_bytes) {
    json out = json::object();
    for (const TokenLogprob& alt : top)
        out[ValidUtf8(token_bytes(alt.token_id))] = Logprob(alt.logprob);
    return out;
}

void AppendCompletionLogprobs(const std::vector<GeneratedTokenLogprob>& tokens,
                              const TokenBytesFn& token_bytes, int64_t* offset, json* out) {
    for (const GeneratedTokenLogprob& t : tokens) {
        AppendCompletionToken(token_bytes(t.token_id), Logprob(t.logprob),
                              TopJson(t.top, token_bytes), offset, out);
    }
}

// Echo with logprobs: the prompt's tokens, scored[i - 1] being token i's (token 0 has none).
void AppendPromptLogprobs(const std::vector<int32_t>& ids,
                          const std::vector<PromptTokenLogprob>& scored,
                          const TokenBytesFn& token_bytes, int64_t* offset, json* out) {
    for (size_t i = 0; i < ids.size(); ++i) {
        const PromptTokenLogprob* s = i > 0 && i - 1 < scored.size() ? &scored[i - 1] : nullptr;
        AppendCompletionToken(token_bytes(ids[i]), s ? json(Logprob(s->logprob)) : json(nullptr),
                              s ? TopJson(s->top, token_bytes) : json(nullptr), offset, out);
    }
}

// vLLM's prompt_logprobs: null for the first token, then {"<id>": {"logprob", "rank",
// "decoded_token"}} with the prompt token first and its top alternatives (ranked 1..k).
json VllmPromptLogprobs(const std::vector<int32_t>& ids,
                        const std::vector<PromptTokenLogprob>& scored,
                        const TokenBytesFn& token_bytes) {
    json list = json::array();
    for (size_t i = 0; i < ids.size(); ++i) {
        if (i == 0 || i - 1 >= scored.size()) {
            list.push_back(nullptr);
            continue;
        }
        const PromptTokenLogprob& s = scored[i - 1];
        json entry = json::object();
        auto add = [&](int32_t id, float logprob, int64_t rank) {
            entry[std::to_string(id)] = {{"logprob", Logprob(logprob)},
                                         {"rank", rank},
                                         {"decoded_token", ValidUtf8(token_bytes(id))}};
        };
        add(s.token_id, s.logprob, s.rank);
        for (size_t k = 0; k < s.top.size(); ++k) {
            if (s.top[k].token_id != s.token_id)
                add(s.top[k].token_id, s.top[k].logprob, static_cast<int64_t>(k + 1));
        }
        list.push_back(std::move(entry));
    }
    return list;
}

json FinishReasonJson(const std::string& reason) {
    return reason.empty() ? json(nullptr) : json(reason);
}

json ToolCallJson(const ToolCallOutput::Call& call) {
    return {{"id", call.id},
            {"type", "function"},
            {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

}  // namespace

json UsageJson(const GenerationUsage& usage) {
    return {{"prompt_tokens", usage.prompt_tokens},
            {"completion_tokens", usage.completion_tokens},
            {"total_tokens", usage.prompt_tokens + usage.completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", usage.cached_tokens}}}};
}

std::string SseEvent(const std::string& data) { return "data: " + data + "\n\n"; }

CompletionAccumulator::CompletionAccumulator(ResponseContext context, TokenBytesFn token_bytes)
    : context_(std::move(context)), token_bytes_(std::move(token_bytes)), choices_(context_.n) {
    if (context_.tools) {
        for (Choice& c : choices_) c.parser.emplace(*context_.tools);
    }
    for (size_t i = 0; i < context_.echo.size() && i < choices_.size(); ++i) {
        choices_[i].text = context_.echo[i];
    }
}

void CompletionAccumulator::Add(const GenerationDelta& delta) {
    if (delta.index < 0 || delta.index >= static_cast<int>(choices_.size())) return;
    Choice& c = choices_[delta.index];
    if (c.parser) {
        std::vector<ToolCallOutput> outputs = c.parser->Feed(delta.text);
        if (delta.finish_reason) {
            for (ToolCallOutput& o : c.parser->Finish()) outputs.push_back(std::move(o));
        }
        for (ToolCallOutput& o : outputs) {
            if (o.call) {
                c.calls.push_back(std::move(*o.call));
            } else {
                c.text += o.text;
            }
        }
    } else {
        c.text += delta.text;
    }
    c.logprobs.insert(c.logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
    if (!delta.prompt_logprobs.empty()) c.prompt_logprobs = delta.prompt_logprobs;
    if (delta.finish_reason) c.finish_reason = std::string(FinishReasonName(*delta.finish_reason));
    if (delta.finish_reason && !c.calls.empty()) c.finish_reason = "tool_calls";
}

std::string CompletionAccumulator::Body(const GenerationUsage& usage) const {
    const bool chat = context_.endpoint == ApiEndpoint::kChatCompletions;
    json choices = json::array();
    const auto per_prompt = static_cast<size_t>(std::max(1, context_.choices_per_prompt));
    // Prompt p's token ids and scores (on its first choice), when the context has them.
    auto prompt = [&](size_t choice) {
        const size_t p = choice / per_prompt;
        static const std::vector<int32_t> kNone;
        const std::vector<int32_t>& ids =
            p < context_.prompt_token_ids.size() ? context_.prompt_token_ids[p] : kNone;
        const size_t first = p * per_prompt;
        return std::make_pair(&ids, first < choices_.size() ? &choices_[first].prompt_logprobs
                                                            : &choices_[choice].prompt_logprobs);
    };
    for (size_t i = 0; i < choices_.size(); ++i) {
        const Choice& c = choices_[i];
        json choice = {{"index", i}};
        json logprobs = nullptr;
        const auto [prompt_ids, prompt_scores] = prompt(i);
        if (context_.logprobs && chat) {
            logprobs = ChatLogprobs(c.logprobs, token_bytes_);
        } else if (context_.logprobs) {
            int64_t offset = 0;
            logprobs = EmptyCompletionLogprobs();
            if (context_.echo_logprobs)
                AppendPromptLogprobs(*prompt_ids, *prompt_scores, token_bytes_, &offset, &logprobs);
            AppendCompletionLogprobs(c.logprobs, token_bytes_, &offset, &logprobs);
        }
        if (context_.prompt_logprobs && !chat) {
            choice["prompt_logprobs"] =
                VllmPromptLogprobs(*prompt_ids, *prompt_scores, token_bytes_);
        }
        if (chat && !c.calls.empty()) {
            json calls = json::array();
            for (const ToolCallOutput::Call& call : c.calls) calls.push_back(ToolCallJson(call));
            choice["message"] = {{"role", "assistant"},
                                 {"content", c.text.empty() ? json(nullptr) : json(c.text)},
                                 {"tool_calls", std::move(calls)}};
        } else if (chat) {
            choice["message"] = {{"role", "assistant"}, {"content", c.text}};
        } else {
            choice["text"] = c.text;
        }
        choice["logprobs"] = std::move(logprobs);
        choice["finish_reason"] = FinishReasonJson(c.finish_reason);
        choices.push_back(std::move(choice));
    }
    json body = {{"id", context_.id},
                 {"object", chat ? "chat.completion" : "text_completion"},
                 {"created", context_.created},
                 {"model", context_.model},
                 {"choices", std::move(choices)},
                 {"usage", UsageJson(usage)}};
    if (context_.prompt_logprobs && chat && !choices_.empty()) {
        const auto [prompt_ids, prompt_scores] = prompt(0);
        body["prompt_logprobs"] = VllmPromptLogprobs(*prompt_ids, *prompt_scores, token_bytes_);
    }
    return Dump(body);
}

StreamFormatter::StreamFormatter(ResponseContext context, TokenBytesFn token_bytes)
    : context_(std::move(context)),
      token_bytes_(std::move(token_bytes)),
      text_offsets_(context_.n, 0),
      num_calls_(context_.n, 0),
      echoed_(context_.n, false),
      prompt_scores_(context_.prompt_token_ids.size()) {
    if (context_.tools) {
        for (int i = 0; i < context_.n; ++i) parsers_.emplace_back(*context_.tools);
    }
}

std::string StreamFormatter::Chunk(const json& choices, const json* usage) const {
    const bool chat = context_.endpoint == ApiEndpoint::kChatCompletions;
    json chunk = {{"id", context_.id},
                  {"object", chat ? "chat.completion.chunk" : "text_completion"},
                  {"created", context_.created},
                  {"model", context_.model},
                  {"choices", choices}};
    // With include_usage every chunk carries "usage": null except the last, as the API does.
    if (usage != nullptr) {
        chunk["usage"] = *usage;
    } else if (context_.include_usage) {
        chunk["usage"] = nullptr;
    }
    return SseEvent(Dump(chunk));
}

// Nothing before the first token: the role opens the stream with the first generated text (as
// vLLM and llama.cpp send it), so a client that times the first event measures time to first
// token, not the time to accept the request.
std::string StreamFormatter::Start() { return ""; }

std::string StreamFormatter::RoleChunks() {
    if (context_.endpoint != ApiEndpoint::kChatCompletions || role_sent_) return "";
    role_sent_ = true;
    std::string out;
    for (int i = 0; i < context_.n; ++i) {
        json choice = {{"index", i},
                       {"delta", {{"role", "assistant"}, {"content", ""}}},
                       {"logprobs", nullptr},
                       {"finish_reason", nullptr}};
        out += Chunk(json::array({std::move(choice)}), nullptr);
    }
    return out;
}

std::string StreamFormatter::Delta(const GenerationDelta& delta) {
    if (delta.index < 0 || delta.index >= context_.n) return "";
    if (!parsers_.empty()) {
        std::string out = ToolDelta(delta);
        return out.empty() ? out : RoleChunks() + out;
    }
    const bool has_logprobs = context_.logprobs && !delta.logprobs.empty();
    const size_t p = static_cast<size_t>(delta.index / std::max(1, context_.choices_per_prompt));
    if (!delta.prompt_logprobs.empty() && p < prompt_scores_.size())
        prompt_scores_[p] = delta.prompt_logprobs;
    // Echo: the prompt's text opens the choice's first chunk (as vLLM streams it), and with
    // logprobs its tokens open the chunk's logprobs (they came before any generated token).
    std::string text = delta.text;
    json logprobs = nullptr;
    if (static_cast<size_t>(delta.index) < context_.echo.size() && !echoed_[delta.index]) {
        echoed_[delta.index] = true;
        text = context_.echo[delta.index] + text;
        if (context_.echo_logprobs && p < prompt_scores_.size()) {
            logprobs = EmptyCompletionLogprobs();
            AppendPromptLogprobs(context_.prompt_token_ids[p], prompt_scores_[p], token_bytes_,
                                 &text_offsets_[delta.index], &logprobs);
        }
    }
    if (text.empty() && !delta.finish_reason && !has_logprobs && logprobs.is_null()) return "";
    const std::string finish =
        delta.finish_reason ? std::string(FinishReasonName(*delta.finish_reason)) : "";
    json choice = {{"index", delta.index}};
    if (context_.endpoint == ApiEndpoint::kChatCompletions) {
        choice["delta"] = delta.text.empty() ? json::object() : json{{"content", delta.text}};
        if (has_logprobs) logprobs = ChatLogprobs(delta.logprobs, token_bytes_);
    } else {
        choice["text"] = text;
        if (has_logprobs) {
            if (logprobs.is_null()) logprobs = EmptyCompletionLogprobs();
            AppendCompletionLogprobs(delta.logprobs, token_bytes_, &text_offsets_[delta.index],
                                     &logprobs);
        }
    }
    choice["logprobs"] = std::move(logprobs);
    choice["finish_reason"] = FinishReasonJson(finish);
    return RoleChunks() + Chunk(json::array({std::move(choice)}), nullptr);
}

// Chat with tools: text as content deltas, each call whole as one delta.tool_calls entry; the
// finishing chunk says "tool_calls" when the choice made any.
std::string StreamFormatter::ToolDelta(const GenerationDelta& delta) {
    const int index = delta.index;
    ToolCallParser& parser = parsers_[static_cast<size_t>(index)];
    std::vector<ToolCallOutput> outputs = parser.Feed(delta.text);
    if (delta.finish_reason) {
        for (ToolCallOutput& o : parser.Finish()) outputs.push_back(std::move(o));
    }
    std::string out;
    json logprobs = nullptr;
    if (context_.logprobs && !delta.logprobs.empty()) {
        logprobs = ChatLogprobs(delta.logprobs, token_bytes_);
    }
    auto chunk = [&](json d, const std::string& finish) {
        json choice = {{"index", index},
                       {"delta", std::move(d)},
                       {"logprobs", logprobs},
                       {"finish_reason", FinishReasonJson(finish)}};
        logprobs = nullptr;  // sent once
        out += Chunk(json::array({std::move(choice)}), nullptr);
    };
    for (const ToolCallOutput& o : outputs) {
        if (!o.call) {
            if (!o.text.empty()) chunk({{"content", o.text}}, "");
            continue;
        }
        json call = ToolCallJson(*o.call);
        call["index"] = num_calls_[static_cast<size_t>(index)]++;
        chunk({{"tool_calls", json::array({std::move(call)})}}, "");
    }
    if (delta.finish_reason) {
        const std::string finish = num_calls_[static_cast<size_t>(index)] > 0
                                       ? "tool_calls"
                                       : std::string(FinishReasonName(*delta.finish_reason));
        chunk(json::object(), finish);
    } else if (!logprobs.is_null()) {
        chunk(json::object(), "");
    }
    return out;
}

std::string StreamFormatter::Finish(const GenerationUsage& usage) {
    std::string out = RoleChunks();
    if (context_.include_usage) {
        const json u = UsageJson(usage);
        out += Chunk(json::array(), &u);
    }
    return out + SseEvent("[DONE]");
}

std::string StreamFormatter::Error(const ApiError& error) {
    return SseEvent(ApiErrorBody(error)) + SseEvent("[DONE]");
}

}  // namespace kvshard
