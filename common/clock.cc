#include "common/clock.h"

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
}

}  // namespace kvshard
