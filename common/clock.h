// Clock: the time the engine, its scheduler and router, heartbeats and metrics read. The real clock
// is std::chrono::steady_clock; a VirtualClock is set by whoever drives the code — tests that step
// an engine without sleeping, and `kvshard simulate`, which runs the coordinator's own engine on
// simulated GPUs and moves time forward by each step's modelled cost.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

namespace kvshard {

class ClockListener;

class Clock {
  public:
    using duration = std::chrono::steady_clock::duration;
    using time_point = std::chrono::steady_clock::time_point;

    virtual ~Clock() = default;
    virtual time_point Now() const = 0;

    // steady_clock. Never null, lives for the whole process.
    static const Clock& Real();

    double SecondsSince(time_point t) const {
        return std::chrono::duration<double>(Now() - t).count();
    }

    // Code that waits for a time on this clock (FrameChannel's heartbeats) asks what moves it:
    // on the real clock, time itself (wait on steady_clock: a timer); on a virtual clock, its
    // driver, who tells every listener each time it moves the clock (AddListener).
    virtual bool is_virtual() const { return false; }
    // Registers `listener` to be told of every move (a no-op on the real clock). Not owned;
    // RemoveListener before it is destroyed. Any thread.
    virtual void AddListener(ClockListener* /*listener*/) const {}
    // After it returns, `listener` is not being called and will not be called again.
    virtual void RemoveListener(ClockListener* /*listener*/) const {}
};

class ClockListener {
  public:
    virtual ~ClockListener() = default;
    // The clock moved to `now`; called on the thread that moved it, before Set returns (so what
    // the listener does at that time is done when the driver goes on). Must not move the clock.
    virtual void OnClockMoved(Clock::time_point now) = 0;
};

// Time that moves only when told. Starts at the epoch of time_point (0 s). Now() may be read from
// any thread; Set and Advance belong to one driver thread.
class VirtualClock final : public Clock {
  public:
    time_point Now() const override { return time_point(duration(ticks_.load())); }
    bool is_virtual() const override { return true; }
    void AddListener(ClockListener* listener) const override;
    void RemoveListener(ClockListener* listener) const override;
    // Moves to `t` and tells the listeners; REQUIRES t >= Now() (time never goes back).
    void Set(time_point t);
    void Advance(duration d) { Set(Now() + d); }
    void AdvanceSeconds(double s) {
        Advance(std::chrono::duration_cast<duration>(std::chrono::duration<double>(s)));
    }
    double NowSeconds() const { return std::chrono::duration<double>(Now().time_since_epoch()).count(); }

  private:
    std::atomic<duration::rep> ticks_{0};
    mutable std::mutex listeners_mu_;  // held while listeners are told
    mutable std::vector<ClockListener*> listeners_;
    mutable std::atomic<size_t> num_listeners_{0};
};

}  // namespace kvshard
