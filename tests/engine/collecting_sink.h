// A RequestSink for engine tests: collects each choice's text, token ids, logprobs and finish
// reason, and the prompt logprobs (with the number of tokens of any choice seen before them), and
// lets the test wait for OnFinish.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator/engine_api.h"

namespace kvshard {

class CollectingSink : public RequestSink {
  public:
    explicit CollectingSink(int n) : text_(n), ids_(n), finish_(n) {}
    void OnDelta(const GenerationDelta& d) override {
        std::lock_guard<std::mutex> lock(mu_);
        text_[d.index] += d.text;
        ids_[d.index].insert(ids_[d.index].end(), d.token_ids.begin(), d.token_ids.end());
        if (d.finish_reason) finish_[d.index] = *d.finish_reason;
        logprobs_.insert(logprobs_.end(), d.logprobs.begin(), d.logprobs.end());
        if (!d.prompt_logprobs.empty()) {
            prompt_logprobs_ = d.prompt_logprobs;
            prompt_deltas_++;
            tokens_before_prompt_logprobs_ = tokens_;
        }
        tokens_ += static_cast<int>(d.token_ids.size());
        deltas_++;
    }
    void OnFinish(const GenerationUsage& usage, const Status& status) override {
        std::lock_guard<std::mutex> lock(mu_);
        usage_ = usage;
        status_ = status;
        done_ = true;
        cv_.notify_all();
    }
    void Wait() {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return done_; });
    }
    int deltas() {
        std::lock_guard<std::mutex> lock(mu_);
        return deltas_;
    }

    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::string> text_;
    std::vector<std::vector<int32_t>> ids_;
    std::vector<FinishReason> finish_;
    GenerationUsage usage_;
    Status status_;
    bool done_ = false;
    int deltas_ = 0;
    std::vector<GeneratedTokenLogprob> logprobs_;  // every choice's, in arrival order
    std::vector<PromptTokenLogprob> prompt_logprobs_;
    int prompt_deltas_ = 0;
    int tokens_ = 0;
    int tokens_before_prompt_logprobs_ = -1;
};

}  // namespace kvshard
