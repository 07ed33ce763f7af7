#include "coordinator/stream_sink.h"

namespace kvshard {

StreamSink::StreamSink(std::function<void()> wake) : wake_(std::move(wake)) {}

void StreamSink::OnDelta(const GenerationDelta& delta) {
    SinkEvent e;
    e.delta = delta;
    Push(std::move(e));
}

void StreamSink::OnFinish(const GenerationUsage& usage, const Status& status) {
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
