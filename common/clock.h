// Clock: the time the engine, its scheduler and router, heartbeats and metrics read. The real clock
// is std::chrono::steady_clock; a VirtualClock is set by whoever drives the code — tests that step
// an engine without sleeping, and `kvshard simulate`, which runs the coordinator's own engine on
// simulated GPUs and moves time forward by each step's modelled cost.
#pragma once

#include <atomic>
#include <chrono>

namespace kvshard {

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
};

// Time that moves only when told. Starts at the epoch of time_point (0 s). Now() may be read from
// any thread; Set and Advance belong to one driver thread.
class VirtualClock final : public Clock {
  public:
    time_point Now() const override { return time_point(duration(ticks_.load())); }
    // Moves to `t`; REQUIRES t >= Now() (time never goes back).
    void Set(time_point t);
    void Advance(duration d) { Set(Now() + d); }
    void AdvanceSeconds(double s) {
        Advance(std::chrono::duration_cast<duration>(std::chrono::duration<double>(s)));
    }
    double NowSeconds() const { return std::chrono::duration<double>(Now().time_since_epoch()).count(); }

  private:
    std::atomic<duration::rep> ticks_{0};
};

}  // namespace kvshard
