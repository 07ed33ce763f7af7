#include "coordinator/openai_sampling_request.h"

#include <algorithm>
#include <limits>

#include "coordinator/json_fields.h"
#include "coordinator/openai_request_fields.h"

namespace kvshard::openai_request {

using json_fields::Field;
using json_fields::Number;
using json_fields::TypeName;
using nlohmann::json;

namespace {

constexpr int kMaxStopStrings = 4;
constexpr int kMaxChoices = 16;
constexpr size_t kMaxLogitBias = 1024;
constexpr size_t kMaxStopTokenIds = 64;

void ReadStop(const json& body, OpenAiRequest& r) {
    const json* v = Field(body, "stop");
    if (v == nullptr) return;
    if (v->is_string()) {
        r.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
        if (v->size() > kMaxStopStrings) {
            Fail("'stop' holds at most " + std::to_string(kMaxStopStrings) + " strings, got " +
                     std::to_string(v->size()),
                 "stop");
        }
        for (const json& s : *v) {
            if (!s.is_string()) Fail("'stop' must be a string or an array of strings", "stop");
            r.stop.push_back(s.get<std::string>());
        }
    } else {
        Fail("'stop' must be a string or an array of strings, got " + TypeName(*v), "stop");
    }
    for (const std::string& s : r.stop) {
        if (s.empty()) Fail("'stop' strings must not be empty", "stop");
    }
}

void ReadSampling(const json& body, OpenAiRequest& r) {
    r.sampling.temperature = 1.0f;
    if (auto t = OptNumber(body, "temperature")) {
        if (*t < 0 || *t > 2)
            Fail("'temperature' must be in [0, 2], got " + Number(*t), "temperature");
        r.sampling.temperature = static_cast<float>(*t);
    }
    if (auto p = OptNumber(body, "top_p")) {
        if (!(*p > 0 && *p <= 1)) Fail("'top_p' must be in (0, 1], got " + Number(*p), "top_p");
        r.sampling.top_p = static_cast<float>(*p);
    }
    if (auto k = OptInt(body, "top_k", -1, std::numeric_limits<int32_t>::max(),
                        "must be -1 or 0 (off) or a positive count")) {
        r.sampling.top_k = *k <= 0 ? 0 : static_cast<int>(*k);
    }
    if (auto m = OptNumber(body, "min_p")) {
        if (*m < 0 || *m > 1) Fail("'min_p' must be in [0, 1], got " + Number(*m), "min_p");
        r.sampling.min_p = static_cast<float>(*m);
    }
    if (auto s = OptInt(body, "seed", std::numeric_limits<int64_t>::min(),
                        std::numeric_limits<int64_t>::max(), "")) {
        r.sampling.seed = static_cast<uint64_t>(*s);
        r.has_seed = true;
    }
    if (auto x = OptNumber(body, "presence_penalty")) {
        if (*x < -2 || *x > 2)
            Fail("'presence_penalty' must be in [-2, 2], got " + Number(*x), "presence_penalty");
        r.sampling.presence_penalty = static_cast<float>(*x);
    }
    if (auto x = OptNumber(body, "frequency_penalty")) {
        if (*x < -2 || *x > 2)
            Fail("'frequency_penalty' must be in [-2, 2], got " + Number(*x), "frequency_penalty");
        r.sampling.frequency_penalty = static_cast<float>(*x);
    }
    if (auto x = OptNumber(body, "repetition_penalty")) {
        if (!(*x > 0 && *x <= 10)) {
            Fail("'repetition_penalty' must be in (0, 10] (1: off), got " + Number(*x),
                 "repetition_penalty");
        }
        r.sampling.repetition_penalty = static_cast<float>(*x);
    }
    if (auto m =
            OptInt(body, "min_tokens", 0, std::numeric_limits<int64_t>::max(), "must be >= 0")) {
        r.sampling.min_tokens = *m;
    }
}

// logit_bias: {"<token id>": bias in [-100, 100], ...}, as OpenAI defines it.
void ReadLogitBias(const json& body, const ServedModel& model, OpenAiRequest& r) {
    const json* b = Field(body, "logit_bias");
    if (b == nullptr) return;
    if (!b->is_object()) {
        Fail("'logit_bias' must be an object of token ids to biases, got " + TypeName(*b),
             "logit_bias");
    }
    if (b->size() > kMaxLogitBias) {
        Fail("'logit_bias' holds at most " + std::to_string(kMaxLogitBias) + " tokens, got " +
                 std::to_string(b->size()),
             "logit_bias");
    }
    for (const auto& [key, value] : b->items()) {
        int64_t id = -1;
        const bool digits = !key.empty() && key.size() <= 10 &&
                            key.find_first_not_of("0123456789") == std::string::npos;
        if (digits) id = std::stoll(key);
        if (!digits || id >= model.vocab_size) {
            Fail("'logit_bias' key '" + key + "' is not a token id of the vocabulary (0.." +
                     std::to_string(model.vocab_size - 1) + ")",
                 "logit_bias");
        }
        if (!value.is_number() || value.get<double>() < -100 || value.get<double>() > 100) {
            Fail("'logit_bias' value for token " + key + " must be a number in [-100, 100]",
                 "logit_bias");
        }
        r.sampling.logit_bias.push_back({static_cast<int32_t>(id), value.get<float>()});
    }
    std::sort(r.sampling.logit_bias.begin(), r.sampling.logit_bias.end(),
              [](const TokenBias& a, const TokenBias& b) { return a.token_id < b.token_id; });
    for (size_t i = 1; i < r.sampling.logit_bias.size(); ++i) {
        if (r.sampling.logit_bias[i].token_id == r.sampling.logit_bias[i - 1].token_id) {
            Fail("'logit_bias' names token " + std::to_string(r.sampling.logit_bias[i].token_id) +
                     " twice",
                 "logit_bias");
        }
    }
}

// vLLM's output controls: stop_token_ids, include_stop_str_in_output, skip_special_tokens.
void ReadOutputControls(const json& body, const ServedModel& model, OpenAiRequest& r) {
    if (const json* ids = Field(body, "stop_token_ids")) {
        if (!ids->is_array()) {
            Fail("'stop_token_ids' must be an array of token ids, got " + TypeName(*ids),
                 "stop_token_ids");
        }
        if (ids->size() > kMaxStopTokenIds) {
            Fail("'stop_token_ids' holds at most " + std::to_string(kMaxStopTokenIds) +
                     " ids, got " + std::to_string(ids->size()),
                 "stop_token_ids");
        }
        for (const json& t : *ids) {
            if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
                t.get<int64_t>() >= model.vocab_size) {
                Fail("'stop_token_ids' must hold token ids of the vocabulary (0.." +
                         std::to_string(model.vocab_size - 1) + ")",
                     "stop_token_ids");
            }
            r.stop_token_ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
        }
    }
    r.include_stop_str_in_output = OptBool(body, "include_stop_str_in_output").value_or(false);
    r.skip_special_tokens = OptBool(body, "skip_special_tokens").value_or(true);
}

// Options of vLLM's and OpenAI's APIs that kvshard does not implement: refused by name rather
// than ignored, so that no client believes it was obeyed. A value that asks for the default
// behaviour is accepted.
void RefuseUnimplemented(const json& body) {
    if (Field(body, "truncate_prompt_tokens") != nullptr) {
        Fail("'truncate_prompt_tokens' is not supported by this server", "truncate_prompt_tokens");
    }
    for (const char* name :
         {"use_beam_search", "return_tokens_as_token_ids", "continue_final_message"}) {
        if (OptBool(body, name).value_or(false)) {
            Fail(std::string("'") + name + "' is not supported by this server (only false)", name);
        }
    }
    if (auto t = OptNumber(body, "typical_p"); t && *t != 1) {
        Fail("'typical_p' is not supported by this server (only 1)", "typical_p");
    }
    if (auto p = OptInt(body, "priority", std::numeric_limits<int64_t>::min(),
                        std::numeric_limits<int64_t>::max(), "");
        p && *p != 0) {
        Fail(
            "'priority' is not supported: this server schedules first come, first served "
            "(only 0)",
            "priority");
    }
}

// vLLM's prompt_logprobs (the answer's "prompt_logprobs"), and completions' echo with logprobs
// (the prompt's tokens lead the "logprobs" object): both have the engine score the prompt.
// REQUIRES: num_top_logprobs, echo and stream read.
void ReadPromptLogprobs(const json& body, OpenAiRequest& r) {
    if (auto k = OptInt(body, "prompt_logprobs", 0, kMaxLogprobs, "must be in 0..20")) {
        if (r.stream) {
            Fail("'prompt_logprobs' is not supported with 'stream' (echo with logprobs is)",
                 "prompt_logprobs");
        }
        r.prompt_logprobs = static_cast<int32_t>(*k);
    }
    r.num_prompt_logprobs = r.prompt_logprobs.value_or(-1);
    if (r.echo && r.num_top_logprobs >= 0)
        r.num_prompt_logprobs = std::max(r.num_prompt_logprobs, r.num_top_logprobs);
    if (r.max_tokens == 0 && !r.echo && !r.prompt_logprobs) {
        Fail("'max_tokens' 0 asks for no output; it needs 'echo' or 'prompt_logprobs'",
             "max_tokens");
    }
}

}  // namespace

void ReadCommon(const json& body, const ServedModel& model, OpenAiRequest& r) {
    RefuseUnimplemented(body);
    ReadSampling(body, r);
    ReadLogitBias(body, model, r);
    ReadOutputControls(body, model, r);
    ReadStop(body, r);
    if (auto n = OptInt(body, "n", 1, kMaxChoices, "must be in 1..16")) r.n = static_cast<int>(*n);
    r.stream = OptBool(body, "stream").value_or(false);
    if (const json* so = Field(body, "stream_options")) {
        if (!so->is_object()) Fail("'stream_options' must be an object", "stream_options");
        if (!r.stream)
            Fail("'stream_options' is only allowed when 'stream' is true", "stream_options");
        if (const json* usage = Field(*so, "include_usage")) {
            if (!usage->is_boolean()) {
                Fail("'stream_options.include_usage' must be a boolean, got " + TypeName(*usage),
                     "stream_options.include_usage");
            }
            r.include_usage = usage->get<bool>();
        }
    }
    r.ignore_eos = OptBool(body, "ignore_eos").value_or(false);
    if (OptBool(body, "echo").value_or(false)) {
        if (r.endpoint != ApiEndpoint::kCompletions) {
            Fail("'echo' is not supported on chat completions", "echo");
        }
        r.echo = true;
    }
    ReadPromptLogprobs(body, r);
    if (auto best_of = OptInt(body, "best_of", 1, kMaxChoices, "must be in 1..16");
        best_of && *best_of != r.n) {
        Fail("'best_of' is not supported (only equal to n)", "best_of");
    }
    OptString(body, "user");
}

}  // namespace kvshard::openai_request
