// FixedBlockTables: block tables for callers that drive a ModelRunner without a coordinator's
// BlockManager (benchmarks, tools, tests): sequence index i owns, in KV cache group g of
// `num_groups` (ModelRunner::kv_groups(); 1 without sliding windows), the blocks
// [(i * num_groups + g) * blocks_per_sequence, ... + blocks_per_sequence) of the runner's pool,
// so its positions 0 .. max_len - 1 always have the same slots. Nothing is released by windows.
// Thread-safety: none; one owner.
#pragma once

#include <cstdint>
#include <vector>

#include "worker/model_runner.h"

namespace kvshard {

class FixedBlockTables {
  public:
    // REQUIRES: positive arguments.
    FixedBlockTables(int64_t num_sequences, int64_t max_len, int64_t block_size,
                     int64_t num_groups = 1);

    // Blocks the runner's pool needs (RunnerOptions::num_kv_blocks).
    int64_t num_blocks() const { return num_sequences_ * num_groups_ * blocks_per_sequence_; }
    int64_t blocks_per_sequence() const { return blocks_per_sequence_; }

    // Points chunk->block_table (and group_block_tables) at sequence `index`'s blocks and fills
    // chunk->slot_mapping (and group_slot_mappings) for its tokens at chunk->start_pos (spans into
    // this object, valid until the next Place of the same index).
    // REQUIRES: 0 <= index < num_sequences.
    void Place(int64_t index, SequenceChunk* chunk);

  private:
    int64_t num_sequences_;
    int64_t blocks_per_sequence_;
    int64_t block_size_;
    int64_t num_groups_;
    // Per sequence, by group: its table, and its current chunk's slots.
    std::vector<std::vector<std::vector<int32_t>>> tables_;
    std::vector<std::vector<std::vector<int64_t>>> slots_;
};

}  // namespace kvshard
