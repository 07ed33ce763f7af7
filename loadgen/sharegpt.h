// ShareGPT datasets for `kvshard bench --dataset sharegpt --dataset-path FILE`: real chat prompts
// with the length of the answer a person got, as vLLM's benchmark reads them.
//
// The file is a JSON list of conversations, {"id": ..., "conversations": [{"from": "human" |
// "gpt" | ..., "value": "text"}, ...]} (ShareGPT_V3_unfiltered_cleaned_split.json and its
// cousins). A conversation gives one pair: its first "human" turn as the prompt and the turn right
// after it, when that is a "gpt" turn, as the reference answer; conversations without such a pair
// are skipped (other "from" values, e.g. "system", are allowed and not used).
//
// Sampling (SampleShareGpt): the pairs are shuffled with the seed, then taken in order, each
// measured in tokens of the served model; a pair is kept unless (vLLM's is_valid_sequence, from
// the pruning rule of its original sample_sharegpt_requests) the prompt has fewer than 4 tokens,
// the answer fewer than 4 (not checked when a fixed output length is given), the prompt more than
// 1024, or prompt and answer together more than 2048. Sampling stops at num_prompts kept pairs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "loadgen/dataset.h"
#include "loadgen/http_client.h"

namespace kvshard::loadgen {

struct ShareGptPair {
    std::string prompt;      // the first human turn
    std::string completion;  // the gpt turn that follows it
    int64_t entry = 0;       // its conversation's index in the file
};

struct ShareGptFile {
    std::vector<ShareGptPair> pairs;
    int64_t num_entries = 0;  // conversations in the file, with and without a pair
};

// Parses `text`; `name` (the file's path) starts every error. InvalidArgument, on one line, for
// what is not the format: not JSON (with the byte offset), not a list, an entry that is not an
// object, `conversations` missing or not a list, a turn that is not an object or whose `from` or
// `value` is missing or not a string (the entry's index and the field named), or no pair at all.
Result<ShareGptFile> ParseShareGpt(std::string_view text, const std::string& name);
// Reads the file as a stream: memory holds the pairs, not the file or a JSON tree of it.
Result<ShareGptFile> ReadShareGpt(const std::string& path);

// The tokens of `text` as the served model counts them; `add_special_tokens` adds BOS where the
// tokenizer asks for one (a prompt as the server sees it) or not (an answer's own tokens).
using TokenCounter =
    std::function<Result<int64_t>(const std::string& text, bool add_special_tokens)>;

// Counts with the server's POST /tokenize (vLLM's and kvshard's route: {"prompt", "model",
// "add_special_tokens"} -> {"count"}), one request per text.
TokenCounter ServerTokenCounter(const BaseUrl& url, const std::string& model,
                                const std::string& api_key, double timeout_s);

struct ShareGptOptions {
    int64_t num_prompts = 100;
    uint64_t seed = 0;
    int64_t output_len = 0;  // > 0: every request asks this many tokens instead of the answer's
};

// vLLM's length filter (see the file comment). `fixed_output_len` skips the answer's minimum.
bool KeepShareGptPair(int64_t prompt_tokens, int64_t output_tokens, bool fixed_output_len);

struct ShareGptSample {
    std::vector<BenchPrompt> prompts;  // with prompt_tokens measured
    int64_t measured = 0;              // pairs tokenized to find them
};

// Shuffles the pairs with the seed and keeps the first num_prompts that pass the filter; fewer
// when the file has fewer. Errors: a counter's failure (the server's /tokenize), or no pair kept.
Result<ShareGptSample> SampleShareGpt(const ShareGptFile& file, const ShareGptOptions& options,
                                      const TokenCounter& count_tokens);

}  // namespace kvshard::loadgen
