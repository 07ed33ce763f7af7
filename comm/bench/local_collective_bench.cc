// Times AllReduceSum of a LocalGroup: the decode-step shape of tensor parallelism (small buffers,
// two all-reduces per layer). Prints microseconds per all-reduce, the median of a few repetitions.
//
//   kvshard_local_collective_bench [ranks=2] [count=576] [iterations=10000] [repetitions=5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/local_collective.h"

namespace {

using Clock = std::chrono::steady_clock;

// Microseconds per all-reduce of `iterations` all-reduces of `count` floats on `ranks` threads.
double TimeAllReduces(int ranks, int64_t count, int iterations) {
    auto group = kvshard::LocalGroup::Create(ranks);
    std::vector<double> seconds(static_cast<size_t>(ranks), 0.0);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
            std::unique_ptr<kvshard::Collective> c = group->Collective(r);
            std::vector<float> data(static_cast<size_t>(count), 1.0f);
            // Warm up: every thread running and the buffers in cache.
            for (int i = 0; i < 100; ++i) {
                if (!c->AllReduceSum(data.data(), count).ok()) std::abort();
            }
            if (!c->Barrier().ok()) std::abort();
            const Clock::time_point start = Clock::now();
            for (int i = 0; i < iterations; ++i) {
                std::fill(data.begin(), data.end(), static_cast<float>(r + 1));
                if (!c->AllReduceSum(data.data(), count).ok()) std::abort();
            }
            seconds[r] = std::chrono::duration<double>(Clock::now() - start).count();
        });
    }
    for (std::thread& t : threads) t.join();
    return *std::max_element(seconds.begin(), seconds.end()) * 1e6 / iterations;
}

}  // namespace

int main(int argc, char** argv) {
    const int ranks = argc > 1 ? std::atoi(argv[1]) : 2;
    const int64_t count = argc > 2 ? std::atoll(argv[2]) : 576;
    const int iterations = argc > 3 ? std::atoi(argv[3]) : 10'000;
    const int repetitions = argc > 4 ? std::atoi(argv[4]) : 5;
    if (ranks < 1 || count < 0 || iterations < 1 || repetitions < 1) {
        std::fprintf(stderr, "usage: %s [ranks] [count] [iterations] [repetitions]\n", argv[0]);
        return 2;
    }
    std::vector<double> us;
    for (int i = 0; i < repetitions; ++i) us.push_back(TimeAllReduces(ranks, count, iterations));
    std::sort(us.begin(), us.end());
    std::printf(
        "ranks=%d count=%lld iterations=%d: %.2f us per all-reduce (median of %d; min %.2f, "
        "max %.2f)\n",
        ranks, static_cast<long long>(count), iterations, us[us.size() / 2], repetitions,
        us.front(), us.back());
    return 0;
}
