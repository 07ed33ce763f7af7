#include "worker/generator.h"

#include <algorithm>
#include <chrono>

namespace kvshard {

std::string_view FinishReasonName(FinishReason reason) {
    switch (reason) {
        case FinishReason::kStop: return "stop";
        case FinishReason::kLength: return "length";
    }
    return "length";
}

Result<GenerateResult> Generate(ModelRunner& runner, const Tokenizer& tokenizer,
                                const std::vector<int32_t>& prompt_ids, const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text,
                                int64_t seq_id) {
    if (prompt_ids.empty()) return InvalidArgument("the prompt has no tokens");
    if (options.max_tokens < 0) return InvalidArgument("max_tokens must be >= 0");
    KV_RETURN_IF_ERROR(ValidateSamplingParams(options.sampling));
    const auto prompt_len = static_cast<int64_t>(prompt_ids.size());
    if (prompt_len > runner.max_context()) {
        return OutOfRange("the prompt has " + std::to_string(prompt_len) +
                          " tokens, more than the context of " + std::to_string(runner.max_context()));
    }

    GenerateResult result;
    Sampler sampler(options.sampling);
    TextStream stream(tokenizer, options.stop_strings, prompt_ids.back());
    auto emit = [&](const std::string& s) {
        result.text += s;
        if (on_text && !s.empty()) on_text(s);
    };

    std::vector<int32_t> context = prompt_ids;  // every token so far
    std::vector<float> logits;
    const int64_t processed_before = runner.tokens_processed();
    runner.Release(seq_id);
    using Clock = std::chrono::steady_clock;
    bool finished = false;
    for (int64_t step = 0; step < options.max_tokens && !finished; ++step) {
        const auto ctx_len = static_cast<int64_t>(context.size());
        if (ctx_len > runner.max_context()) break;  // the context is full: finish as "length"
        SequenceChunk chunk;
        chunk.seq_id = seq_id;
        if (options.use_kv_cache) {
            const int64_t cached = runner.CachedLength(seq_id);
            chunk.tokens = std::span<const int32_t>(context).subspan(static_cast<size_t>(cached));
            chunk.start_pos = cached;
        } else {
            runner.Release(seq_id);
            chunk.tokens = context;
            chunk.start_pos = 0;
        }
        const auto t0 = Clock::now();
        Status st = runner.Forward(std::span<const SequenceChunk>(&chunk, 1), &logits);
        if (!st.ok()) {
            runner.Release(seq_id);
            return st;
        }
        const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        (step == 0 ? result.prefill_seconds : result.decode_seconds) += secs;

        const int32_t token = sampler.Sample(logits.data(), runner.spec().vocab_size);
        result.token_ids.push_back(token);
        if (std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), token) !=
            options.stop_token_ids.end()) {
            result.finish_reason = FinishReason::kStop;
            finished = true;
            break;
        }
        emit(stream.Push(token));
        if (stream.stopped()) {
            result.finish_reason = FinishReason::kStop;
            finished = true;
            break;
        }
        context.push_back(token);
    }
    if (!stream.stopped()) emit(stream.Finish());
    result.tokens_processed = runner.tokens_processed() - processed_before;
    runner.Release(seq_id);
    return result;
}

}  // namespace kvshard
