// StripRanges: how kernels/cpu_matmul.cc splits a product's output columns over an OpenMP team
// (each member streams one contiguous range of weight rows, and steals from the others' ranges
// when it is done). Internal to kernels/cpu_matmul.cc.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "common/check.h"

namespace kvshard::cpu::matmul_internal {

// The split of a product's output columns over the calling thread's OpenMP team, in strips of
// strip_rows columns (the last may be short). Each member owns one contiguous range (the kernels
// prefetch the strips ahead of the one they compute, so a thread that walks its own range streams
// its weights without a restart), takes it from the front kClaimStrips at a time, and when it is
// done takes the back half of what is left of another member's range, until nothing is left. A
// static split left each thread waiting at the product's closing barrier ~10% of batch-1 decode
// time (the two halves of a product do not take the same time when the threads share the memory
// system with other processes); a dynamic split of small chunks lost the streams
// (docs/benchmarks.md, issue 10). Strips are the tiles' 4 columns, or kInterleaveRows for the
// interleaved kernel (whose groups must not be cut: a group's rows are computed together, so the
// split never changes a result). Thread-safety: Run is called by the team's members concurrently
// (each range's bounds are one atomic word); the ranges are built by the calling thread before the
// parallel region.
class StripRanges {
  public:
    // Ranges for `members` threads over n columns. REQUIRES: 1 <= members, 1 <= strip_rows.
    StripRanges(int64_t n, int members, int64_t strip_rows)
        : n_(n), members_(members), strip_rows_(strip_rows) {
        const int64_t strips = (n + strip_rows - 1) / strip_rows;
        KV_CHECK(strips < (int64_t{1} << 31)) << "n=" << n;
        if (static_cast<size_t>(members) > Slots().size()) Slots() = std::vector<Slot>(members);
        for (int t = 0; t < members; ++t) {
            Slots()[t].bounds.store(Pack(strips * t / members, strips * (t + 1) / members),
                                    std::memory_order_relaxed);
        }
        slots_ = Slots().data();
    }

    // Calls f(n0, n1) on column ranges until the product is done: member t's own range first,
    // then what it can take from the others'. REQUIRES: 0 <= t < members.
    template <typename F>
    void Run(int t, F&& f) {
        int64_t s0;
        int64_t s1;
        while (Take(t, /*steal=*/false, &s0, &s1)) f(Column(s0), Column(s1));
        for (int d = 1; d < members_; ++d) {
            const int victim = (t + d) % members_;
            while (Take(victim, /*steal=*/true, &s0, &s1)) f(Column(s0), Column(s1));
        }
    }

  private:
    struct alignas(64) Slot {
        std::atomic<uint64_t> bounds{0};  // [lo, hi) in strips: lo in the low 32 bits
    };
    // Strips an owner takes at a time (16 weight rows).
    static constexpr int64_t kClaimStrips = 4;

    // One array per calling thread (a tensor-parallel rank thread has its own team), reused.
    static std::vector<Slot>& Slots() {
        thread_local std::vector<Slot> slots;
        return slots;
    }
    static uint64_t Pack(int64_t lo, int64_t hi) {
        return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32);
    }
    int64_t Column(int64_t strip) const { return std::min(n_, strip * strip_rows_); }

    // Takes strips [*s0, *s1) of slot `t`: its front kClaimStrips for the owner, the back half
    // of what is left for a thief. False when the slot is empty.
    bool Take(int t, bool steal, int64_t* s0, int64_t* s1) {
        std::atomic<uint64_t>& bounds = slots_[t].bounds;
        uint64_t v = bounds.load(std::memory_order_relaxed);
        while (true) {
            const int64_t lo = static_cast<int64_t>(v & 0xFFFFFFFFu);
            const int64_t hi = static_cast<int64_t>(v >> 32);
            if (lo >= hi) return false;
            uint64_t next;
            if (steal) {
                *s1 = hi;
                *s0 = hi - std::max<int64_t>(1, (hi - lo) / 2);
                next = Pack(lo, *s0);
            } else {
                *s0 = lo;
                *s1 = std::min(hi, lo + kClaimStrips);
                next = Pack(*s1, hi);
            }
            if (bounds.compare_exchange_weak(v, next, std::memory_order_relaxed)) return true;
        }
    }

    int64_t n_;
    int members_;
    int64_t strip_rows_;
    Slot* slots_ = nullptr;
};

}  // namespace kvshard::cpu::matmul_internal
