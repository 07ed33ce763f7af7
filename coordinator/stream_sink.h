// StreamSink: the RequestSink the HTTP layer gives the engine. The engine thread pushes deltas
// and the finish into a small queue and rings a wake-up that posts to the session's strand; the
// session drains the queue there. Nothing here blocks the engine thread beyond a short mutex.
//
// It measures nothing: the engine times each request once, from its arrival, and reports to the
// metrics itself (EngineObserver).
//
// Thread-safety: On* are called by the engine thread; TakeEvents and Detach by the session. The
// queue is guarded by mu_.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "coordinator/engine_api.h"

namespace kvshard {

// Lets a thread outside an io_context post into it only while it is running: the server closes
// the gate before it destroys its io_context, so a late engine callback posts nothing.
class PostGate {
  public:
    // Runs `post` (which must not block) unless the gate is closed.
    template <typename F>
    void Run(F&& post) {
        std::shared_lock<std::shared_mutex> lock(mu_);
        if (open_) post();
    }
    void Close() {
        std::unique_lock<std::shared_mutex> lock(mu_);
        open_ = false;
    }

  private:
    std::shared_mutex mu_;
    bool open_ = true;  // guarded by mu_
};

struct SinkEvent {
    std::optional<GenerationDelta> delta;  // set for a delta
    GenerationUsage usage;                 // the rest for the finish
    Status status;
    bool finished = false;
};

class StreamSink : public RequestSink {
  public:
    // `wake` is called (from the engine thread) when events arrive and the session has not yet
    // been told; it must post, not run, the session's drain.
    explicit StreamSink(std::function<void()> wake);

    void OnDelta(const GenerationDelta& delta) override;
    void OnFinish(const GenerationUsage& usage, const Status& status) override;

    // The events so far, in order; re-arms the wake-up.
    std::vector<SinkEvent> TakeEvents();
    // The session is gone: later events are dropped and nothing is woken.
    void Detach();

  private:
    void Push(SinkEvent event);

    std::mutex mu_;
    std::vector<SinkEvent> events_;  // guarded by mu_
    bool wake_pending_ = false;      // guarded by mu_
    std::function<void()> wake_;     // guarded by mu_; empty once detached
};

}  // namespace kvshard
