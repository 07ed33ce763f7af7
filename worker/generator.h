// Generate: one sequence from prompt to finish on one ModelRunner — the loop behind
// `kvshard generate`. (Serving many sequences at once is the coordinator's scheduler.)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/tokenizer.h"
#include "worker/model_runner.h"
#include "worker/sampler.h"

namespace kvshard {

struct GenerateOptions {
    int64_t max_tokens = 256;
    SamplingParams sampling;
    std::vector<std::string> stop_strings;
    std::vector<int32_t> stop_token_ids;  // e.g. EOS; and BOS for llama2.c models
    // false: recompute the whole context every step (demonstration and verification only).
    bool use_kv_cache = true;
};

struct GenerateResult {
    std::string text;
    std::vector<int32_t> token_ids;  // generated, including a stop token if one ended the run
    FinishReason finish_reason = FinishReason::kLength;
    int64_t tokens_processed = 0;  // token positions pushed through the network
    double prefill_seconds = 0;    // first forward pass
    double decode_seconds = 0;     // every later pass
};

// Generates from `prompt_ids` (REQUIRES: not empty). `on_text` receives the completion text as it
// becomes final (UTF-8 complete, never part of a stop string); may be empty.
// `seq_id` names the sequence in the runner's cache; it is released at the end.
Result<GenerateResult> Generate(ModelRunner& runner, const Tokenizer& tokenizer,
                                const std::vector<int32_t>& prompt_ids,
                                const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text = {},
                                int64_t seq_id = 0);

}  // namespace kvshard
