// FakeEngine: an Engine for the HTTP tests. Its own thread plays a scripted token stream into
// each request's sink, one token per choice per "step", interleaving all active requests like a
// continuous-batching engine; it records every request and abort.
//
// Token i of a choice has id kFirstTokenId + i, text script[i % script.size()], and (when asked)
// log probability -0.5 with top alternatives kFirstTokenId..+k-1 at -1, -2, ... A request stops
// with "length" after max_tokens tokens. With hold_after >= 0 a request parks after that many
// tokens until it is aborted or Release()d (to test disconnects, timeouts and draining).
// FailAll ends every request with an error status, as the real engine's Stop() does.
// With an observer, it reports each request's latencies and end as the real engine does (pool
// "default", times on Engine::clock() from GenerationRequest::arrival).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/engine_api.h"

namespace kvshard::testing {

class FakeEngine : public Engine {
  public:
    static constexpr int32_t kFirstTokenId = 'a';

    struct Options {
        int64_t max_context = 4096;
        std::vector<std::string> script = {"Hello", ",", " world", "!"};
        int64_t hold_after = -1;
        Status submit_status;  // returned by every Submit when not OK
        int64_t cached_tokens = 0;
        size_t max_active = 1 << 20;  // Submit says ResourceExhausted beyond this many requests
        Status health;                // what Health() returns
        EngineObserver* observer = nullptr;  // not owned; may be null
    };

    explicit FakeEngine(Options options) : options_(std::move(options)) {
        thread_ = std::thread([this] { Loop(); });
    }
    FakeEngine() : FakeEngine(Options{}) {}
    ~FakeEngine() override {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }

    Status Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink) override {
        std::lock_guard<std::mutex> lock(mu_);
        if (!options_.submit_status.ok()) return options_.submit_status;
        if (active_.size() >= options_.max_active) {
            return {StatusCode::kResourceExhausted, "the queue is full"};
        }
        submitted_.push_back(request);
        Active a;
        a.request = std::move(request);
        a.sink = std::move(sink);
        a.produced.assign(static_cast<size_t>(a.request.n), 0);
        a.arrival = a.request.arrival.value_or(clock().Now());
        active_.push_back(std::move(a));
        cv_.notify_all();
        return Status::Ok();
    }

    void Abort(const std::string& request_id) override {
        std::lock_guard<std::mutex> lock(mu_);
        aborted_.insert(request_id);
        cv_.notify_all();
    }

    EngineStats Stats() const override {
        std::lock_guard<std::mutex> lock(mu_);
        EngineStats s;
        s.num_running = static_cast<int64_t>(active_.size());
        s.num_waiting = 0;
        s.kv_cache_usage = 0.25;
        s.prefix_cache_queries_tokens = 100;
        s.prefix_cache_hits_tokens = 40;
        return s;
    }

    int64_t max_context() const override { return options_.max_context; }
    Status Health() const override { return options_.health; }

    // Held requests go on, and later ones are not held.
    void Release() {
        std::lock_guard<std::mutex> lock(mu_);
        options_.hold_after = -1;
        cv_.notify_all();
    }

    // Every active request finishes with `status` (no further deltas), from the engine thread.
    void FailAll(Status status) {
        std::lock_guard<std::mutex> lock(mu_);
        fail_status_ = std::move(status);
        fail_all_ = true;
        cv_.notify_all();
    }

    // Waits until `request_id` (or, with "", any request) is aborted; false after `timeout`.
    bool WaitForAbort(const std::string& request_id, std::chrono::milliseconds timeout) {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, timeout, [&] {
            return request_id.empty() ? !aborted_.empty() : aborted_.count(request_id) > 0;
        });
    }
    // Waits until `count` requests have been submitted; false after `timeout`.
    bool WaitForSubmitted(size_t count, std::chrono::milliseconds timeout) {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, timeout, [&] { return submitted_.size() >= count; });
    }
    // Waits until no request is active; false after `timeout`.
    bool WaitIdle(std::chrono::milliseconds timeout) {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, timeout, [&] { return active_.empty(); });
    }
    std::vector<GenerationRequest> submitted() const {
        std::lock_guard<std::mutex> lock(mu_);
        return submitted_;
    }
    std::set<std::string> aborted() const {
        std::lock_guard<std::mutex> lock(mu_);
        return aborted_;
    }

  private:
    struct Active {
        GenerationRequest request;
        std::shared_ptr<RequestSink> sink;
        std::vector<int64_t> produced;  // tokens per choice
        bool finished = false;
        Clock::time_point arrival, last_token;  // the last token of any choice (one per step)
    };

    // Latencies of one step's tokens of `a` (every choice got its next token now).
    void ObserveTokens(Active& a) {
        if (options_.observer == nullptr) return;
        const Clock::time_point now = clock().Now();
        const auto seconds = [](Clock::duration d) {
            return std::chrono::duration<double>(d).count();
        };
        if (a.produced[0] == 1) {
            options_.observer->OnFirstToken("default", seconds(now - a.arrival));
        } else {
            for (int c = 0; c < a.request.n; ++c)
                options_.observer->OnInterToken("default", seconds(now - a.last_token));
        }
        a.last_token = now;
    }
    void ObserveEnd(const Active& a, const GenerationUsage& usage, const Status& status,
                    bool aborted) {
        if (options_.observer == nullptr) return;
        FinishedRequestStats st;
        st.e2e_seconds = std::chrono::duration<double>(clock().Now() - a.arrival).count();
        st.failed = !status.ok();
        st.finished_reason = st.failed ? "error" : aborted ? "abort" : "length";
        st.prompt_tokens = usage.prompt_tokens;
        st.generation_tokens = usage.completion_tokens;
        st.n = a.request.n;
        st.max_tokens = a.request.max_tokens;
        options_.observer->OnRequestFinished(st);
    }

    bool Held(const Active& a) const {
        return options_.hold_after >= 0 && a.produced[0] >= options_.hold_after &&
               aborted_.count(a.request.request_id) == 0;
    }
    bool CanAdvance() const {
        if (fail_all_ && !active_.empty()) return true;
        for (const Active& a : active_) {
            if (!Held(a)) return true;
        }
        return false;
    }

    // One step: every active, unheld request gets one token per choice (or finishes).
    void Loop() {
        std::unique_lock<std::mutex> lock(mu_);
        while (true) {
            cv_.wait(lock, [&] { return stop_ || CanAdvance(); });
            if (stop_) return;
            if (fail_all_) {
                std::vector<std::shared_ptr<RequestSink>> failed;
                for (Active& a : active_) {
                    ObserveEnd(a, GenerationUsage{}, fail_status_, false);
                    failed.push_back(a.sink);
                }
                active_.clear();
                fail_all_ = false;
                const Status status = fail_status_;
                lock.unlock();
                for (auto& sink : failed) sink->OnFinish(GenerationUsage{}, status);
                lock.lock();
                cv_.notify_all();
                continue;
            }
            std::vector<std::pair<std::shared_ptr<RequestSink>, std::vector<GenerationDelta>>> out;
            std::vector<std::pair<std::shared_ptr<RequestSink>, GenerationUsage>> finished;
            for (Active& a : active_) {
                if (Held(a)) continue;
                std::vector<GenerationDelta> deltas;
                const bool abort = aborted_.count(a.request.request_id) > 0;
                for (int c = 0; c < a.request.n; ++c) {
                    GenerationDelta d;
                    d.index = c;
                    if (abort) {
                        d.finish_reason = FinishReason::kAbort;
                    } else {
                        const int64_t i = a.produced[c]++;
                        d.text = options_.script[i % options_.script.size()];
                        d.token_ids = {kFirstTokenId + static_cast<int32_t>(i % 26)};
                        if (a.request.num_top_logprobs >= 0) {
                            GeneratedTokenLogprob t;
                            t.token_id = d.token_ids[0];
                            t.logprob = -0.5f;
                            for (int k = 0; k < a.request.num_top_logprobs; ++k) {
                                t.top.push_back({kFirstTokenId + k, -1.0f - k});
                            }
                            d.logprobs.push_back(t);
                        }
                        if (a.produced[c] >= a.request.max_tokens)
                            d.finish_reason = FinishReason::kLength;
                    }
                    deltas.push_back(std::move(d));
                }
                out.emplace_back(a.sink, std::move(deltas));
                if (!abort) ObserveTokens(a);
                if (abort || a.produced[0] >= a.request.max_tokens) {
                    a.finished = true;
                    GenerationUsage u;
                    u.prompt_tokens = static_cast<int64_t>(a.request.prompt_token_ids.size());
                    for (int64_t p : a.produced) u.completion_tokens += p;
                    u.cached_tokens = options_.cached_tokens;
                    ObserveEnd(a, u, Status::Ok(), abort);
                    finished.emplace_back(a.sink, u);
                }
            }
            std::erase_if(active_, [](const Active& a) { return a.finished; });
            // Call the sinks without the lock, as a real engine thread would.
            lock.unlock();
            for (auto& [sink, deltas] : out) {
                for (const GenerationDelta& d : deltas) sink->OnDelta(d);
            }
            for (auto& [sink, usage] : finished) sink->OnFinish(usage, Status::Ok());
            lock.lock();
            cv_.notify_all();
        }
    }

    Options options_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Active> active_;  // guarded by mu_
    std::vector<GenerationRequest> submitted_;
    std::set<std::string> aborted_;
    bool stop_ = false;
    bool fail_all_ = false;
    Status fail_status_;
    std::thread thread_;
};

}  // namespace kvshard::testing
