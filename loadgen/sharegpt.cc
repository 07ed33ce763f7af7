#include "loadgen/sharegpt.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>

#include "loadgen/http_client.h"

namespace kvshard::loadgen {

using nlohmann::json;

namespace {

constexpr int64_t kMinTokens = 4;
constexpr int64_t kMaxPromptTokens = 1024;
constexpr int64_t kMaxTotalTokens = 2048;

// Reads the file as a stream of SAX events and keeps only each conversation's pair, so memory is
// the pairs (plus one conversation's turns), not a JSON tree several times the file's size.
class ShareGptReader {
  public:
    ShareGptReader(const std::string& name, ShareGptFile* out) : name_(name), out_(out) {}
    const std::string& error() const { return error_; }

    // nlohmann::json's SAX interface; false stops the parse (error_ says why).
    bool null() { return Scalar("null", nullptr); }
    bool boolean(bool) { return Scalar("boolean", nullptr); }
    bool number_integer(json::number_integer_t) { return Scalar("number", nullptr); }
    bool number_unsigned(json::number_unsigned_t) { return Scalar("number", nullptr); }
    bool number_float(json::number_float_t, const std::string&) {
        return Scalar("number", nullptr);
    }
    bool string(std::string& s) { return Scalar("string", &s); }
    bool binary(json::binary_t&) { return Scalar("binary", nullptr); }
    bool start_object(std::size_t) { return Open(true); }
    bool start_array(std::size_t) { return Open(false); }
    bool end_object() { return Close(); }
    bool end_array() { return Close(); }
    bool key(std::string& k) {
        if (skip_depth_ == 0) key_ = k;
        return true;
    }
    bool parse_error(std::size_t byte, const std::string&, const nlohmann::detail::exception&) {
        if (error_.empty()) error_ = name_ + ": not JSON (byte " + std::to_string(byte) + ")";
        return false;
    }

  private:
    // The containers being read, outermost first.
    enum class In { kRoot, kEntry, kConversations, kTurn };

    bool Fail(const std::string& why) {
        error_ = why;
        return false;
    }
    std::string Entry() const { return name_ + ": entry " + std::to_string(entry_); }
    std::string TurnAt() const {
        return Entry() + ": conversations[" + std::to_string(turns_.size()) + "]";
    }
    bool TurnKey() const { return key_ == "from" || key_ == "value"; }

    bool Scalar(const char* type, std::string* text) {
        if (skip_depth_ > 0) return true;
        if (stack_.empty()) {
            return Fail(name_ + ": expected a JSON list of conversations, got " + type);
        }
        switch (stack_.back()) {
            case In::kRoot:
                entry_ = out_->num_entries++;
                return Fail(Entry() + " is " + type + ", not an object");
            case In::kEntry:
                if (key_ != "conversations") return true;
                return Fail(Entry() + ": 'conversations' is " + type + ", not a list");
            case In::kConversations:
                return Fail(TurnAt() + " is " + type + ", not an object");
            case In::kTurn:
                if (!TurnKey()) return true;
                if (text == nullptr) {
                    return Fail(TurnAt() + "." + key_ + " is " + type + ", not a string");
                }
                (key_ == "from" ? from_ : value_) = std::move(*text);
                return true;
        }
        return true;
    }

    bool Open(bool object) {
        const char* type = object ? "object" : "array";
        if (skip_depth_ > 0) {
            ++skip_depth_;
            return true;
        }
        if (stack_.empty()) {
            if (object) return Fail(name_ + ": expected a JSON list of conversations, got object");
            stack_.push_back(In::kRoot);
            return true;
        }
        switch (stack_.back()) {
            case In::kRoot:
                entry_ = out_->num_entries++;
                if (!object) return Fail(Entry() + " is array, not an object");
                turns_.clear();
                has_conversations_ = false;
                key_.clear();
                stack_.push_back(In::kEntry);
                return true;
            case In::kEntry:
                if (key_ != "conversations") {
                    skip_depth_ = 1;
                    return true;
                }
                if (object) return Fail(Entry() + ": 'conversations' is object, not a list");
                has_conversations_ = true;
                turns_.clear();
                stack_.push_back(In::kConversations);
                return true;
            case In::kConversations:
                if (!object) return Fail(TurnAt() + " is array, not an object");
                from_.reset();
                value_.reset();
                key_.clear();
                stack_.push_back(In::kTurn);
                return true;
            case In::kTurn:
                if (TurnKey())
                    return Fail(TurnAt() + "." + key_ + " is " + type + ", not a string");
                skip_depth_ = 1;
                return true;
        }
        return true;
    }

    bool Close() {
        if (skip_depth_ > 0) {
            --skip_depth_;
            return true;
        }
        const In closed = stack_.back();
        stack_.pop_back();
        switch (closed) {
            case In::kRoot:
            case In::kConversations:
                key_.clear();
                return true;
            case In::kTurn:
                if (!from_) return Fail(TurnAt() + ".from is missing");
                if (!value_) return Fail(TurnAt() + ".value is missing");
                turns_.emplace_back(std::move(*from_), std::move(*value_));
                key_.clear();
                return true;
            case In::kEntry:
                if (!has_conversations_) return Fail(Entry() + ": 'conversations' is missing");
                KeepPair();
                return true;
        }
        return true;
    }

    // The first human turn and, when it is a gpt turn, the one after it.
    void KeepPair() {
        auto human = std::find_if(turns_.begin(), turns_.end(),
                                  [](const auto& turn) { return turn.first == "human"; });
        if (human == turns_.end() || human + 1 == turns_.end() || (human + 1)->first != "gpt") {
            return;
        }
        out_->pairs.push_back({std::move(human->second), std::move((human + 1)->second), entry_});
    }

    std::string name_;
    ShareGptFile* out_;
    std::string error_;
    std::vector<In> stack_;
    int64_t skip_depth_ = 0;  // > 0: inside a value nothing is read from
    std::string key_;         // the last key of the entry or turn being read
    int64_t entry_ = 0;
    bool has_conversations_ = false;
    std::vector<std::pair<std::string, std::string>> turns_;  // (from, value) of this entry
    std::optional<std::string> from_, value_;                 // of the turn being read
};

Result<ShareGptFile> Finish(bool parsed, const ShareGptReader& reader, ShareGptFile file,
                            const std::string& name) {
    if (!parsed || !reader.error().empty()) {
        return InvalidArgument(reader.error().empty() ? name + ": not JSON" : reader.error());
    }
    if (file.pairs.empty()) {
        return InvalidArgument(name + ": none of its " + std::to_string(file.num_entries) +
                               " conversations has a \"human\" turn followed by a \"gpt\" turn");
    }
    return file;
}

}  // namespace

Result<ShareGptFile> ParseShareGpt(std::string_view text, const std::string& name) {
    ShareGptFile file;
    ShareGptReader reader(name, &file);
    const bool parsed = json::sax_parse(text.begin(), text.end(), &reader);
    return Finish(parsed, reader, std::move(file), name);
}

Result<ShareGptFile> ReadShareGpt(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        return InvalidArgument("--dataset-path " + path + ": cannot open (" + std::strerror(errno) +
                               ")");
    }
    ShareGptFile file;
    ShareGptReader reader(path, &file);
    const bool parsed = json::sax_parse(in, &reader);
    if (in.bad()) return InvalidArgument("--dataset-path " + path + ": read failed");
    return Finish(parsed, reader, std::move(file), path);
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
