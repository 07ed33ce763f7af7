#include "coordinator/stream_sink.h"

namespace kvshard {

namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

StreamSink::StreamSink(std::shared_ptr<ServerMetrics> metrics, const Clock& clock,
                       Clock::time_point arrival, int n, std::function<void()> wake)
    : metrics_(std::move(metrics)),
      wake_(std::move(wake)),
      clock_(clock),
      arrival_(arrival),
      last_token_at_(static_cast<size_t>(n > 0 ? n : 1), arrival) {}

void StreamSink::OnDelta(const GenerationDelta& delta) {
    const Clock::time_point now = clock_.Now();
    const size_t num_tokens = delta.token_ids.size();
    if (num_tokens > 0 && metrics_) {
        const size_t choice = static_cast<size_t>(delta.index) < last_token_at_.size()
                                  ? static_cast<size_t>(delta.index)
                                  : 0;
        if (!first_token_seen_) {
            first_token_seen_ = true;
            metrics_->ObserveTimeToFirstToken(Seconds(now - arrival_));
        } else if (last_token_at_[choice] != arrival_) {
            // A delta of several tokens spreads its gap over them.
            const double gap =
                Seconds(now - last_token_at_[choice]) / static_cast<double>(num_tokens);
            for (size_t i = 0; i < num_tokens; ++i) metrics_->ObserveInterTokenLatency(gap);
        }
        last_token_at_[choice] = now;
    }
    if (delta.finish_reason) finish_reason_ = std::string(FinishReasonName(*delta.finish_reason));
    SinkEvent e;
    e.delta = delta;
    Push(std::move(e));
}

void StreamSink::OnFinish(const GenerationUsage& usage, const Status& status) {
    if (metrics_) {
        metrics_->ObserveRequestFinished(Seconds(clock_.Now() - arrival_), usage,
                                         status.ok() ? finish_reason_ : "error");
    }
    SinkEvent e;
    e.usage = usage;
    e.status = status;
    e.finished = true;
    Push(std::move(e));
}

void StreamSink::Push(SinkEvent event) {
    std::function<void()> wake;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!wake_) return;  // detached: nobody will read it
        events_.push_back(std::move(event));
        if (wake_pending_) return;
        wake_pending_ = true;
        wake = wake_;
    }
    wake();
}

std::vector<SinkEvent> StreamSink::TakeEvents() {
    std::lock_guard<std::mutex> lock(mu_);
    wake_pending_ = false;
    std::vector<SinkEvent> out;
    out.swap(events_);
    return out;
}

void StreamSink::Detach() {
    std::lock_guard<std::mutex> lock(mu_);
    wake_ = nullptr;
    events_.clear();
}

}  // namespace kvshard
