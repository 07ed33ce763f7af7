// KV cache groups: how the layers of a model share the blocks of one pool when some of them attend
// over a sliding window (vLLM's hybrid KV cache manager is the model; docs/kv.md "Sliding-window
// KV"). Layers with the same window (0: full attention) form a type; every type is cut into groups
// of `layers_per_group` layers, the greatest common divisor of the types' layer counts, so no
// group is padded and a block (block_size slots of layers_per_group layers) fits every group. A
// model with one type has one group of all its layers: a block is what it always was.
// The block manager keeps a block table per group (BlockManagerConfig::group_windows); a layer's
// KV lives in its group's blocks, at its slot among the group's layers.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "config/arch_config.h"
#include "config/model_spec.h"

namespace kvshard::kv {

struct KvCacheGroups {
    int64_t layers_per_group = 0;  // layer slots of one block
    // By group: the attention window (0: full attention; the full groups first, then windows
    // from the smallest) and the layers, in increasing order.
    std::vector<int64_t> windows;
    std::vector<std::vector<int64_t>> layers;
    // By layer: its group and its slot among the group's layers.
    std::vector<int64_t> group_of_layer;
    std::vector<int64_t> slot_of_layer;

    int64_t num_groups() const { return static_cast<int64_t>(windows.size()); }
    // BlockManagerConfig::group_windows: empty for one full-attention group (the path of models
    // without windows), else `windows`.
    std::vector<int64_t> BlockManagerWindows() const;
};

// From each layer's window (0: full attention). InvalidArgument for no layers or a negative
// window, naming the layer.
Result<KvCacheGroups> MakeKvCacheGroups(std::span<const int64_t> layer_windows);

// Each layer's window: sliding_window for a windowed layer, else 0.
std::vector<int64_t> LayerWindows(const ModelSpec& spec);
std::vector<int64_t> LayerWindows(const ArchConfig& arch);

}  // namespace kvshard::kv
