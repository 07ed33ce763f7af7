#include "common/clock.h"

#include <algorithm>

#include "common/check.h"

namespace kvshard {
namespace {

class RealClock final : public Clock {
  public:
    time_point Now() const override { return std::chrono::steady_clock::now(); }
};

}  // namespace

const Clock& Clock::Real() {
    static const RealClock clock;
    return clock;
}

void VirtualClock::Set(time_point t) {
    const duration::rep to = t.time_since_epoch().count();
    KV_CHECK(to >= ticks_.load()) << "a virtual clock cannot go back";
    ticks_.store(to);
    if (num_listeners_.load() == 0) return;  // the simulator's case: no lock per move
    std::lock_guard<std::mutex> lock(listeners_mu_);
    for (ClockListener* l : listeners_) l->OnClockMoved(t);
}

void VirtualClock::AddListener(ClockListener* listener) const {
    std::lock_guard<std::mutex> lock(listeners_mu_);
    listeners_.push_back(listener);
    num_listeners_.store(listeners_.size());
}

void VirtualClock::RemoveListener(ClockListener* listener) const {
    std::lock_guard<std::mutex> lock(listeners_mu_);
    listeners_.erase(std::remove(listeners_.begin(), listeners_.end(), listener), listeners_.end());
    num_listeners_.store(listeners_.size());
}

}  // namespace kvshard
