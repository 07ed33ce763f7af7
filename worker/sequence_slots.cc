#include "worker/sequence_slots.h"

#include "common/check.h"

namespace kvshard {

FixedBlockTables::FixedBlockTables(int64_t num_sequences, int64_t max_len, int64_t block_size)
    : num_sequences_(num_sequences),
      blocks_per_sequence_((max_len + block_size - 1) / block_size),
      block_size_(block_size),
      slots_(static_cast<size_t>(num_sequences)) {
    KV_CHECK(num_sequences > 0 && max_len > 0 && block_size > 0)
        << "sequences " << num_sequences << " max_len " << max_len << " block " << block_size;
    tables_.resize(static_cast<size_t>(num_blocks()));
    for (int64_t b = 0; b < num_blocks(); ++b) tables_[static_cast<size_t>(b)] = int32_t(b);
}

void FixedBlockTables::Place(int64_t index, SequenceChunk* chunk) {
    KV_CHECK(index >= 0 && index < num_sequences_) << index;
    const int32_t* table = &tables_[static_cast<size_t>(index * blocks_per_sequence_)];
    chunk->block_table = std::span<const int32_t>(table, static_cast<size_t>(blocks_per_sequence_));
    std::vector<int64_t>& slots = slots_[static_cast<size_t>(index)];
    slots.resize(chunk->tokens.size());
    for (size_t i = 0; i < slots.size(); ++i) {
        const int64_t pos = chunk->start_pos + static_cast<int64_t>(i);
        slots[i] = int64_t(table[pos / block_size_]) * block_size_ + pos % block_size_;
    }
    chunk->slot_mapping = slots;
}

}  // namespace kvshard
