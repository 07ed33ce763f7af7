#include "worker/sequence_slots.h"

#include "common/check.h"

namespace kvshard {

FixedBlockTables::FixedBlockTables(int64_t num_sequences, int64_t max_len, int64_t block_size,
                                   int64_t num_groups)
    : num_sequences_(num_sequences),
      blocks_per_sequence_((max_len + block_size - 1) / block_size),
      block_size_(block_size),
      num_groups_(num_groups) {
    KV_CHECK(num_sequences > 0 && max_len > 0 && block_size > 0 && num_groups > 0)
        << "sequences " << num_sequences << " max_len " << max_len << " block " << block_size
        << " groups " << num_groups;
    const auto n = static_cast<size_t>(num_sequences);
    const auto groups = static_cast<size_t>(num_groups);
    tables_.assign(n, std::vector<std::vector<int32_t>>(groups));
    slots_.assign(n, std::vector<std::vector<int64_t>>(groups));
    int32_t next = 0;
    for (auto& by_group : tables_) {
        for (std::vector<int32_t>& table : by_group) {
            for (int64_t b = 0; b < blocks_per_sequence_; ++b) table.push_back(next++);
        }
    }
}

void FixedBlockTables::Place(int64_t index, SequenceChunk* chunk) {
    KV_CHECK(index >= 0 && index < num_sequences_) << index;
    const std::vector<std::vector<int32_t>>& tables = tables_[static_cast<size_t>(index)];
    std::vector<std::vector<int64_t>>& slots = slots_[static_cast<size_t>(index)];
    for (size_t g = 0; g < tables.size(); ++g) {
        slots[g].resize(chunk->tokens.size());
        for (size_t i = 0; i < slots[g].size(); ++i) {
            const int64_t pos = chunk->start_pos + static_cast<int64_t>(i);
            slots[g][i] = int64_t(tables[g][static_cast<size_t>(pos / block_size_)]) * block_size_ +
                          pos % block_size_;
        }
    }
    chunk->block_table = tables[0];
    chunk->slot_mapping = slots[0];
    chunk->group_block_tables = std::span<const std::vector<int32_t>>(tables).subspan(1);
    chunk->group_slot_mappings = std::span<const std::vector<int64_t>>(slots).subspan(1);
}

}  // namespace kvshard
