// Helpers the BlockManager tests share: token runs, and admission that asserts it succeeded.
#pragma once

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kv/block_manager.h"

namespace kvshard::kv {

// n consecutive token ids from `first`.
inline std::vector<int32_t> Tokens(int64_t n, int32_t first = 1000) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    std::iota(t.begin(), t.end(), first);
    return t;
}

inline std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

inline void ExpectValid(const BlockManager& bm) {
    const Status s = bm.CheckInvariants();
    EXPECT_TRUE(s.ok()) << s.ToString();
}

// Allocates and asserts success; returns the cached token count (-1 when it could not).
inline int64_t MustAllocate(BlockManager& bm, SeqId id, const std::vector<int32_t>& prompt) {
    SequenceRequest r{id, prompt};
    EXPECT_TRUE(bm.CanAllocate(r)) << "seq " << id;
    if (!bm.CanAllocate(r)) return -1;
    const int64_t cached = bm.Allocate(r);
    ExpectValid(bm);
    return cached;
}

}  // namespace kvshard::kv
