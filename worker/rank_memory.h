// RankMemory: what one worker holds in memory after loading — its weights, its KV pool, and the
// process's resident set — for the "each rank reads only its slices" check of tensor parallelism.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/collective.h"
#include "common/status.h"
#include "worker/model_runner.h"

namespace kvshard {

struct RankMemory {
    int64_t weight_bytes = 0;   // fp32 weights of this rank
    int64_t kv_pool_bytes = 0;  // the paged pool's reserved size (pages commit as blocks fill)
    // /proc/self/statm: resident pages of the whole process, and the file-backed part of them
    // (mostly the mapped model file's pages that loading touched; reclaimable).
    int64_t rss_bytes = 0;
    int64_t rss_file_bytes = 0;

    int64_t rss_anonymous_bytes() const { return rss_bytes - rss_file_bytes; }
    std::string ToString() const;  // MiB figures on one line
};

// REQUIRES: Linux (/proc); the RSS fields stay 0 elsewhere.
RankMemory MeasureRankMemory(const ModelRunner& runner);

// Every rank's figures, in rank order, on every rank (one AllGather; collective over the group;
// nullptr: this rank's alone).
Result<std::vector<RankMemory>> GatherRankMemory(const RankMemory& mine, Collective* collective);

}  // namespace kvshard
