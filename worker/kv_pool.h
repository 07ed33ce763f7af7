// KvPool: the physical KV cache of one worker — `num_blocks` blocks, each one contiguous region
// holding `layers_per_group` layers of `block_size` token slots for this worker's KV heads (layout
// in kernels/paged_attention.h). With one KV cache group that is every layer; with several
// (sliding-window models, kv/kv_cache_groups.h) a block belongs to one group at a time and holds
// that group's layers, layer l at slot_of_layer[l]. Block ids come from the coordinator's
// BlockManager and mean the same slots on every rank of an instance.
// Ownership: owns its memory, allocated through the worker's Backend (which must outlive the pool;
// on the CPU, untouched: pages are committed as blocks are written). Bytes per block follow
// kv::KvGeometry, the formula the capacity planner reports.
// Thread-safety: none; the worker's thread owns it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/paged_attention.h"

namespace kvshard {

struct KvPoolConfig {
    int64_t num_blocks = 0;
    int64_t block_size = 16;
    int64_t num_layers = 0;  // the model's
    // Layers a block holds (0: num_layers) and the slot of each layer in a block (empty: layer l
    // at slot l), from kv::KvCacheGroups.
    int64_t layers_per_group = 0;
    std::vector<int64_t> slot_of_layer = {};
    int64_t num_kv_heads = 0;  // this worker's
    int64_t head_dim = 0;
    KvDtype storage = KvDtype::kFp32;
};

class KvPool {
  public:
    // Validates the numbers (InvalidArgument naming the field).
    // The memory comes from `backend`; ResourceExhausted when it cannot be had.
    static Result<std::unique_ptr<KvPool>> Create(const KvPoolConfig& config, Backend& backend);

    const KvPoolConfig& config() const { return config_; }
    int64_t bytes_per_block() const { return bytes_per_block_; }
    int64_t num_bytes() const { return bytes_per_block_ * config_.num_blocks; }

    // Layer `layer` (of the model's) at its slot in every block.
    cpu::PagedKvLayer Layer(int64_t layer);
    int64_t layers_per_block() const { return layers_per_block_; }
    // The slot of layer `layer` among a block's layers. REQUIRES: 0 <= layer < num_layers.
    int64_t SlotOfLayer(int64_t layer) const;
    // The whole pool's memory (backend memory), for block copies queued on the backend.
    void* data() { return buffer_.data(); }
    // The region of one block (bytes_per_block() bytes). REQUIRES: ValidBlock(block).
    // (Host-addressable on the CPU backend, where the KV handoff packs and unpacks blocks.)
    const uint8_t* BlockData(int64_t block) const { return base() + block * bytes_per_block_; }
    uint8_t* MutableBlockData(int64_t block) { return base() + block * bytes_per_block_; }
    bool ValidBlock(int64_t block) const { return block >= 0 && block < config_.num_blocks; }

  private:
    KvPool(const KvPoolConfig& config, int64_t bytes_per_block, int64_t layers_per_block,
           BackendBuffer buffer);
    uint8_t* base() const { return buffer_.As<uint8_t>(); }

    KvPoolConfig config_;
    int64_t bytes_per_block_ = 0;
    int64_t layers_per_block_ = 0;
    BackendBuffer buffer_;
};

}  // namespace kvshard
