// Benchmark datasets: the prompts `kvshard bench` sends. Prompts are text made of words drawn
// (seeded) from a fixed list of common English words, so any server with any tokenizer can be
// measured; one word is about one token for the BPE vocabularies of Llama-family models, and the
// report gives the prompt tokens the server counted.
//
//   random         input_len words (uniform in [input_len*(1-r), input_len*(1+r)], r =
//                  range_ratio), output_len tokens likewise.
//   shared-prefix  num_groups groups; every prompt of a group starts with the same prefix_len
//                  words (a long system prompt) followed by suffix_len words of its own; requests
//                  go round-robin over the groups. Measures what a prefix cache saves.
//   chat           a chat-like mix of lengths: input and output lengths are log-normal with
//                  medians input_len and output_len (sigma 0.8 for inputs, 0.6 for outputs: a
//                  few long prompts and answers among many short ones, the shape of public chat
//                  logs), clipped to [4, 8 x median] words and [1, 8 x median] tokens.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard::loadgen {

// kShareGpt is read from a file (loadgen/sharegpt.h), not made by MakeDataset.
enum class DatasetKind { kRandom, kSharedPrefix, kChat, kShareGpt };

// "random", "shared-prefix", "chat", "sharegpt"; InvalidArgument naming the value otherwise.
Result<DatasetKind> ParseDatasetKind(std::string_view name);

struct DatasetOptions {
    DatasetKind kind = DatasetKind::kRandom;
    int64_t num_requests = 100;
    int64_t input_len = 256;   // words (random, chat: median)
    int64_t output_len = 128;  // tokens to generate (random, shared-prefix; chat: median)
    double range_ratio = 0.0;  // random: lengths vary by +-range_ratio, in [0, 1)
    int64_t num_groups = 4;    // shared-prefix
    int64_t prefix_len = 512;  // shared-prefix: words of the shared prefix
    int64_t suffix_len = 32;   // shared-prefix: words of each request's own part
    uint64_t seed = 0;
};

struct BenchPrompt {
    std::string prefix;  // shared-prefix: the group's prefix (the system message on chat); else ""
    std::string text;    // the rest of the prompt (the user message on chat)
    int64_t num_words = 0;   // of prefix and text together
    int64_t output_len = 0;  // max_tokens, sent with ignore_eos
    int64_t prompt_tokens = -1;  // as the dataset measured them (sharegpt); -1: not measured
};

// The same options and seed give the same prompts. InvalidArgument for out-of-range options and
// for kShareGpt.
Result<std::vector<BenchPrompt>> MakeDataset(const DatasetOptions& options);

// The word list prompts are drawn from.
const std::vector<std::string_view>& BenchWords();

}  // namespace kvshard::loadgen
