#include "worker/step_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

namespace kvshard {

void LogSoftmax(const float* logits, int64_t n, float* out) {
    float max_val = logits[0];
    for (int64_t i = 1; i < n; ++i) max_val = std::max(max_val, logits[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += std::exp(double(logits[i]) - max_val);
    const auto log_sum = static_cast<float>(std::log(sum)) + max_val;
    for (int64_t i = 0; i < n; ++i) out[i] = logits[i] - log_sum;
}

SampledToken StepRunner::SampleRow(const ScheduledSequence& seq, const float* logits) {
    const int64_t vocab = runner_.spec().vocab_size;
    auto it = samplers_.find(seq.seq_id);
    if (it == samplers_.end()) it = samplers_.emplace(seq.seq_id, Sampler(seq.sampling)).first;
    SampledToken out;
    out.seq_id = seq.seq_id;
    out.token_id = it->second.Sample(logits, vocab);
    if (seq.num_top_logprobs >= 0) {
        logprobs_.resize(static_cast<size_t>(vocab));
        LogSoftmax(logits, vocab, logprobs_.data());
        out.logprob = logprobs_[static_cast<size_t>(out.token_id)];
        const int64_t k = std::min<int64_t>(seq.num_top_logprobs, vocab);
        std::vector<int32_t> ids(static_cast<size_t>(vocab));
        std::iota(ids.begin(), ids.end(), 0);
        std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
            return logprobs_[a] > logprobs_[b] || (logprobs_[a] == logprobs_[b] && a < b);
        });
        for (int64_t i = 0; i < k; ++i) out.top_logprobs.push_back({ids[i], logprobs_[ids[i]]});
    }
    return out;
}

Result<StepResult> StepRunner::Execute(const StepPlan& plan) {
    const auto t0 = std::chrono::steady_clock::now();
    StepResult result;
    result.step_id = plan.step_id;
    for (int64_t id : plan.released_seq_ids) samplers_.erase(id);
    for (const ScheduledSequence& s : plan.sequences) {
        if (s.sample) KV_RETURN_IF_ERROR(ValidateSamplingParams(s.sampling));
    }
    std::vector<std::pair<int32_t, int32_t>> copies;
    for (const BlockCopyOp& c : plan.block_copies) copies.emplace_back(c.src_block, c.dst_block);
    KV_RETURN_IF_ERROR(runner_.CopyBlocks(copies));
    if (!plan.sequences.empty()) {
        std::vector<SequenceChunk> chunks;
        chunks.reserve(plan.sequences.size());
        for (const ScheduledSequence& s : plan.sequences) {
            chunks.push_back({.seq_id = s.seq_id, .tokens = s.token_ids, .start_pos = s.start_pos,
                              .block_table = s.block_table, .slot_mapping = s.slot_mapping});
        }
        KV_RETURN_IF_ERROR(runner_.Forward(chunks, &logits_));
        const int64_t vocab = runner_.spec().vocab_size;
        for (size_t i = 0; i < plan.sequences.size(); ++i) {
            if (plan.sequences[i].sample) {
                result.tokens.push_back(SampleRow(plan.sequences[i], &logits_[i * vocab]));
            }
        }
    }
    result.compute_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
}

}  // namespace kvshard
