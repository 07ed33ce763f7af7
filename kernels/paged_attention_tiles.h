// The work plan of cpu::PagedAttentionBatched (kernels/paged_attention_batched.cc): what one call
// reads, and its cut into tiles for the threads (kernels/paged_attention_tiles.cc). Internal to
// the CPU kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/paged_attention.h"

namespace kvshard::cpu::paged_attention {

constexpr int64_t kVecLanes = 16;
constexpr int kMaxVecs = 4;
constexpr int64_t kMaxLanes = kVecLanes * kMaxVecs;  // lanes of one tile
constexpr int64_t kChunk = 64;                       // KV positions per step of a tile's walk
// A split of a KV walk covers at least this many positions (one chunk). At 256, batch-1 decode
// of a model with fewer KV heads than twice the threads (SmolLM2-135M: 3 tiles on 2 threads) left
// one thread idle for a third of every layer's attention below a context of 256; split in chunks,
// the merge of a few partial results is still well under a microsecond.
constexpr int64_t kMinSplitPositions = kChunk;

// What every tile of one call reads.
struct Problem {
    const float* q;
    int64_t q_stride;
    const PagedKvLayer& kv;
    const PagedAttentionBatch& batch;
    float* out;
    int64_t num_heads;
    float scale;
    std::vector<int32_t> heads;         // query heads grouped by KV head
    std::vector<int32_t> group_starts;  // num_kv_heads + 1, into heads
};

// One unit of scheduled work: lanes (rows [row_begin, row_end) × heads [head_begin, head_end) of KV
// head kv_head's group) over KV positions [kv_begin, kv_end).
struct Tile {
    int32_t seq;
    int32_t kv_head;
    int32_t head_begin, head_end;  // indices into the group's list of query heads
    int32_t row_begin, row_end;    // query rows of the step
    int32_t kv_begin, kv_end;      // kv_begin is a multiple of kChunk
    int32_t partial;               // -1: writes out; else the first of its splits' partial results
    int32_t num_splits;            // of the tile this one was split from (1: not split)
    int32_t split;                 // which of them this one is (0: the first, which merges)
    int64_t cost;                  // lanes × positions, for ordering
};

// Tiles of every sequence and KV head, longest first (for the dynamic schedule), with the longest
// KV walks split when there are too few tiles for the threads. Returns the number of partial
// results the splits need.
int64_t PlanTiles(const Problem& p, int threads, std::vector<Tile>& tiles);

}  // namespace kvshard::cpu::paged_attention
