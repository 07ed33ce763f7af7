// KvPool: the physical KV cache of one worker — `num_blocks` blocks, each one contiguous region
// holding every layer of `block_size` token slots for this worker's KV heads (layout in
// kernels/paged_attention.h). Block ids come from the coordinator's BlockManager and mean the
// same slots on every rank of an instance.
// Ownership: owns its memory (allocated untouched; pages are committed as blocks are written).
// Thread-safety: none; the worker's thread owns it.
#pragma once

#include <cstdint>
#include <memory>

#include "common/status.h"
#include "kernels/paged_attention.h"

namespace kvshard {

struct KvPoolConfig {
    int64_t num_blocks = 0;
    int64_t block_size = 16;
    int64_t num_layers = 0;
    int64_t num_kv_heads = 0;  // this worker's
    int64_t head_dim = 0;
    cpu::KvStorage storage = cpu::KvStorage::kF32;
};

class KvPool {
  public:
    // Validates the numbers (InvalidArgument naming the field).
    static Result<std::unique_ptr<KvPool>> Create(const KvPoolConfig& config);

    const KvPoolConfig& config() const { return config_; }
    int64_t bytes_per_block() const { return bytes_per_block_; }
    int64_t num_bytes() const { return bytes_per_block_ * config_.num_blocks; }

    cpu::PagedKvLayer Layer(int64_t layer);
    // Copies every layer of block `src` to block `dst` (copy-on-write of a shared partial block).
    // REQUIRES: both in range.
    void CopyBlock(int32_t src, int32_t dst);
    // The region of one block (bytes_per_block() bytes). REQUIRES: ValidBlock(block).
    const uint8_t* BlockData(int64_t block) const { return data_.get() + block * bytes_per_block_; }
    uint8_t* MutableBlockData(int64_t block) { return data_.get() + block * bytes_per_block_; }
    bool ValidBlock(int64_t block) const { return block >= 0 && block < config_.num_blocks; }

  private:
    explicit KvPool(const KvPoolConfig& config);

    KvPoolConfig config_;
    int64_t bytes_per_block_ = 0;
    std::unique_ptr<uint8_t[]> data_;
};

}  // namespace kvshard
