// Helpers shared by the collective tests (threads here, processes in mpi_collective_main.cc).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "comm/collective.h"
#include "comm/local_collective.h"
#include "common/status.h"

namespace kvshard::testing {

// Rank `rank`'s input of one all-reduce: values of mixed sign and magnitude, so that the order
// of the additions shows in the bits.
inline std::vector<float> RankInput(int rank, int64_t count, uint64_t seed) {
    std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(rank) * 7919u + 17u);
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-6, 12);
    std::vector<float> values(static_cast<size_t>(count));
    for (float& v : values) v = std::ldexp(mantissa(rng), exponent(rng));
    return values;
}

// The sum every rank must hold: element by element, ranks 0..size-1 in order.
inline std::vector<float> RankOrderSum(int size, int64_t count, uint64_t seed) {
    std::vector<float> sum = RankInput(0, count, seed);
    for (int r = 1; r < size; ++r) {
        const std::vector<float> next = RankInput(r, count, seed);
        for (int64_t i = 0; i < count; ++i) sum[i] += next[i];
    }
    return sum;
}

inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Runs fn(rank, collective) on one thread per rank of a fresh group; returns each rank's Status.
inline std::vector<Status> RunLocalRanks(const std::shared_ptr<LocalGroup>& group,
                                         const std::function<Status(int, Collective&)>& fn) {
    std::vector<Status> statuses(static_cast<size_t>(group->size()));
    std::vector<std::thread> threads;
    for (int r = 0; r < group->size(); ++r) {
        threads.emplace_back([&, r] {
            std::unique_ptr<Collective> collective = group->Collective(r);
            statuses[r] = fn(r, *collective);
        });
    }
    for (std::thread& t : threads) t.join();
    return statuses;
}

}  // namespace kvshard::testing
