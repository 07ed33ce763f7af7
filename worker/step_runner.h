// StepRunner: executes StepPlans on one ModelRunner — block copies, the forward pass over every
// scheduled chunk, and sampling (with per-sequence samplers whose RNG state persists across steps,
// so a seeded request is reproducible however it is batched).
// Thread-safety: none; one thread drives it.
#pragma once

#include <unordered_map>

#include "comm/step_executor.h"
#include "worker/model_runner.h"
#include "worker/sampler.h"

namespace kvshard {

class StepRunner : public StepExecutor {
public:
    explicit StepRunner(ModelRunner& runner) : runner_(runner) {}

    Result<StepResult> Execute(const StepPlan& plan) override;

    // Samples from one row of logits for `seq` (creating its sampler on first use) and fills the
    // requested logprobs.
    SampledToken SampleRow(const ScheduledSequence& seq, const float* logits);
    size_t num_samplers() const { return samplers_.size(); }

private:
    ModelRunner& runner_;
    std::unordered_map<int64_t, Sampler> samplers_;
    std::vector<float> logits_;
    std::vector<float> logprobs_;
};

// log-softmax of `n` logits into `out`.
void LogSoftmax(const float* logits, int64_t n, float* out);

}  // namespace kvshard
