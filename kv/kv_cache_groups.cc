#include "kv/kv_cache_groups.h"

#include <map>
#include <numeric>
#include <string>

namespace kvshard::kv {

std::vector<int64_t> KvCacheGroups::BlockManagerWindows() const {
    if (windows.size() == 1 && windows[0] == 0) return {};
    return windows;
}

Result<KvCacheGroups> MakeKvCacheGroups(std::span<const int64_t> layer_windows) {
    if (layer_windows.empty()) return InvalidArgument("KV cache groups: the model has no layers");
    // The layers of each window, windows in increasing order (0, full attention, first).
    std::map<int64_t, std::vector<int64_t>> by_window;
    for (size_t l = 0; l < layer_windows.size(); ++l) {
        if (layer_windows[l] < 0) {
            return InvalidArgument("KV cache groups: layer " + std::to_string(l) +
                                   " has window " + std::to_string(layer_windows[l]) +
                                   " (0: full attention)");
        }
        by_window[layer_windows[l]].push_back(static_cast<int64_t>(l));
    }
    KvCacheGroups g;
    for (const auto& [window, layers] : by_window)
        g.layers_per_group = std::gcd(g.layers_per_group, static_cast<int64_t>(layers.size()));
    g.group_of_layer.assign(layer_windows.size(), 0);
    g.slot_of_layer.assign(layer_windows.size(), 0);
    for (const auto& [window, layers] : by_window) {
        for (size_t i = 0; i < layers.size(); ++i) {
            if (i % static_cast<size_t>(g.layers_per_group) == 0) {
                g.windows.push_back(window);
                g.layers.emplace_back();
            }
            const int64_t layer = layers[i];
            g.group_of_layer[static_cast<size_t>(layer)] = g.num_groups() - 1;
            g.slot_of_layer[static_cast<size_t>(layer)] = static_cast<int64_t>(g.layers.back().size());
            g.layers.back().push_back(layer);
        }
    }
    return g;
}

std::vector<int64_t> LayerWindows(const ModelSpec& spec) {
    std::vector<int64_t> w(static_cast<size_t>(spec.num_layers), 0);
    for (int64_t l = 0; l < spec.num_layers; ++l)
        w[static_cast<size_t>(l)] = spec.IsWindowed(l) ? spec.sliding_window : 0;
    return w;
}

std::vector<int64_t> LayerWindows(const ArchConfig& arch) {
    std::vector<int64_t> w(arch.layer_attention.size(), 0);
    for (size_t l = 0; l < arch.layer_attention.size(); ++l)
        w[l] = arch.layer_attention[l] == LayerAttention::kSliding ? arch.sliding_window : 0;
    return w;
}

}  // namespace kvshard::kv
