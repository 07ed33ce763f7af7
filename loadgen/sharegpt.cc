#include "loadgen/sharegpt.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>

#include "loadgen/http_client.h"

namespace kvshard::loadgen {

using nlohmann::json;

namespace {

constexpr int64_t kMinTokens = 4;
constexpr int64_t kMaxPromptTokens = 1024;
constexpr int64_t kMaxTotalTokens = 2048;

const char* TypeName(const json& j) { return j.type_name(); }

// The string field `key` of turn `t` of entry `e`, or an error naming both.
Result<std::string> TurnField(const json& turn, const char* key, const std::string& where) {
    auto it = turn.find(key);
    if (it == turn.end()) return InvalidArgument(where + "." + key + " is missing");
    if (!it->is_string()) {
        return InvalidArgument(where + "." + key + " is " + TypeName(*it) + ", not a string");
    }
    return it->get<std::string>();
}

}  // namespace

Result<ShareGptFile> ParseShareGpt(std::string_view text, const std::string& name) {
    json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded()) {
        // Parse again with exceptions for the byte offset of the error.
        try {
            root = json::parse(text);
        } catch (const json::parse_error& e) {
            return InvalidArgument(name + ": not JSON (byte " + std::to_string(e.byte) + ")");
        }
    }
    if (!root.is_array()) {
        return InvalidArgument(name + ": expected a JSON list of conversations, got " +
                               TypeName(root));
    }
    ShareGptFile file;
    file.num_entries = static_cast<int64_t>(root.size());
    for (size_t i = 0; i < root.size(); ++i) {
        const json& entry = root[i];
        const std::string where = name + ": entry " + std::to_string(i);
        if (!entry.is_object()) {
            return InvalidArgument(where + " is " + TypeName(entry) + ", not an object");
        }
        auto conv = entry.find("conversations");
        if (conv == entry.end()) return InvalidArgument(where + ": 'conversations' is missing");
        if (!conv->is_array()) {
            return InvalidArgument(where + ": 'conversations' is " + TypeName(*conv) +
                                   ", not a list");
        }
        std::vector<std::pair<std::string, std::string>> turns;  // (from, value)
        for (size_t t = 0; t < conv->size(); ++t) {
            const json& turn = (*conv)[t];
            const std::string turn_where = where + ": conversations[" + std::to_string(t) + "]";
            if (!turn.is_object()) {
                return InvalidArgument(turn_where + " is " + TypeName(turn) + ", not an object");
            }
            KV_ASSIGN_OR_RETURN(std::string from, TurnField(turn, "from", turn_where));
            KV_ASSIGN_OR_RETURN(std::string value, TurnField(turn, "value", turn_where));
            turns.emplace_back(std::move(from), std::move(value));
        }
        auto human = std::find_if(turns.begin(), turns.end(),
                                  [](const auto& turn) { return turn.first == "human"; });
        if (human == turns.end() || human + 1 == turns.end() || (human + 1)->first != "gpt") {
            continue;
        }
        file.pairs.push_back(
            {std::move(human->second), std::move((human + 1)->second), static_cast<int64_t>(i)});
    }
    if (file.pairs.empty()) {
        return InvalidArgument(name + ": none of its " + std::to_string(file.num_entries) +
                               " conversations has a \"human\" turn followed by a \"gpt\" turn");
    }
    return file;
}

Result<ShareGptFile> ReadShareGpt(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        return InvalidArgument("--dataset-path " + path + ": cannot open (" + std::strerror(errno) +
                               ")");
    }
    std::ostringstream text;
    text << in.rdbuf();
    if (in.bad()) return InvalidArgument("--dataset-path " + path + ": read failed");
    return ParseShareGpt(text.str(), path);
}

bool KeepShareGptPair(int64_t prompt_tokens, int64_t output_tokens, bool fixed_output_len) {
    const bool prompt_too_short = prompt_tokens < kMinTokens;
    const bool output_too_short = !fixed_output_len && output_tokens < kMinTokens;
    const bool prompt_too_long = prompt_tokens > kMaxPromptTokens;
    const bool total_too_long = prompt_tokens + output_tokens > kMaxTotalTokens;
    return !(prompt_too_short || output_too_short || prompt_too_long || total_too_long);
}

Result<ShareGptSample> SampleShareGpt(const ShareGptFile& file, const ShareGptOptions& o,
                                      const TokenCounter& count_tokens) {
    if (o.num_prompts < 1) {
        return InvalidArgument("--num-prompts must be >= 1, got " + std::to_string(o.num_prompts));
    }
    if (o.output_len < 0) {
        return InvalidArgument("--output-len must be >= 0, got " + std::to_string(o.output_len));
    }
    std::vector<size_t> order(file.pairs.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::mt19937_64 rng(o.seed);
    std::shuffle(order.begin(), order.end(), rng);
    ShareGptSample sample;
    const bool fixed = o.output_len > 0;
    for (size_t i : order) {
        if (static_cast<int64_t>(sample.prompts.size()) >= o.num_prompts) break;
        const ShareGptPair& pair = file.pairs[i];
        ++sample.measured;
        KV_ASSIGN_OR_RETURN(int64_t prompt_tokens, count_tokens(pair.prompt, true));
        int64_t output_tokens = o.output_len;
        if (!fixed) {
            KV_ASSIGN_OR_RETURN(output_tokens, count_tokens(pair.completion, false));
        }
        if (!KeepShareGptPair(prompt_tokens, output_tokens, fixed)) continue;
        BenchPrompt p;
        p.text = pair.prompt;
        p.prompt_tokens = prompt_tokens;
        p.output_len = output_tokens;
        sample.prompts.push_back(std::move(p));
    }
    if (sample.prompts.empty()) {
        return InvalidArgument(
            "ShareGPT: none of the " + std::to_string(sample.measured) +
            " pairs measured passed the length filter (prompt 4..1024 tokens, answer >= 4, "
            "together <= 2048)");
    }
    return sample;
}

TokenCounter ServerTokenCounter(const BaseUrl& url, const std::string& model,
                                const std::string& api_key, double timeout_s) {
    return [url, model, api_key, timeout_s](const std::string& text,
                                            bool add_special_tokens) -> Result<int64_t> {
        const json body = {
            {"model", model}, {"prompt", text}, {"add_special_tokens", add_special_tokens}};
        // Servers without vLLM's route (llama.cpp's takes "content") can be measured locally.
        const std::string hint = " (--tokenizer MODEL_FILE counts with a local model instead)";
        Result<std::string> answer =
            HttpPost(url, "/tokenize", body.dump(-1, ' ', false, json::error_handler_t::replace),
                     api_key, timeout_s);
        if (!answer.ok()) {
            return Status(answer.status().code(), answer.status().message() + hint);
        }
        const json j = json::parse(*answer, nullptr, false);
        if (!j.is_object() || !j.contains("count") || !j["count"].is_number_integer()) {
            return Status(StatusCode::kUnavailable,
                          "POST /tokenize answered without an integer 'count': " +
                              answer->substr(0, 200) + hint);
        }
        return j["count"].get<int64_t>();
    };
}

}  // namespace kvshard::loadgen
