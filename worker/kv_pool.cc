#include "worker/kv_pool.h"

#include <string>

#include "kv/kv_geometry.h"

namespace kvshard {

Result<std::unique_ptr<KvPool>> KvPool::Create(const KvPoolConfig& c, Backend& backend) {
    auto positive = [](const char* name, int64_t v) -> Status {
        if (v <= 0) {
            return InvalidArgument(std::string("KV pool: ") + name + " must be positive, got " +
                                   std::to_string(v));
        }
        return Status::Ok();
    };
    KV_RETURN_IF_ERROR(positive("num_blocks", c.num_blocks));
    KV_RETURN_IF_ERROR(positive("block_size", c.block_size));
    KV_RETURN_IF_ERROR(positive("num_layers", c.num_layers));
    KV_RETURN_IF_ERROR(positive("num_kv_heads", c.num_kv_heads));
    KV_RETURN_IF_ERROR(positive("head_dim", c.head_dim));
    const int64_t layers_per_block = c.layers_per_group > 0 ? c.layers_per_group : c.num_layers;
    if (layers_per_block > c.num_layers) {
        return InvalidArgument("KV pool: layers_per_group " + std::to_string(layers_per_block) +
                               " exceeds the " + std::to_string(c.num_layers) + " layers");
    }
    if (!c.slot_of_layer.empty()) {
        if (static_cast<int64_t>(c.slot_of_layer.size()) != c.num_layers) {
            return InvalidArgument("KV pool: slot_of_layer has " +
                                   std::to_string(c.slot_of_layer.size()) + " entries for " +
                                   std::to_string(c.num_layers) + " layers");
        }
        for (int64_t slot : c.slot_of_layer) {
            if (slot < 0 || slot >= layers_per_block) {
                return InvalidArgument("KV pool: layer slot " + std::to_string(slot) +
                                       " outside a block of " + std::to_string(layers_per_block) +
                                       " layers");
            }
        }
    } else if (layers_per_block != c.num_layers) {
        return InvalidArgument("KV pool: layers_per_group " + std::to_string(layers_per_block) +
                               " without slot_of_layer");
    }
    // One formula for the bytes of a block: the geometry's, which the capacity planner reports
    // (8-bit storage keeps an fp32 scale per token per head for each of K and V).
    const kv::KvGeometry geometry{.num_layers = layers_per_block,
                                  .num_kv_heads = c.num_kv_heads,
                                  .head_dim = c.head_dim,
                                  .dtype = c.storage,
                                  .block_size = c.block_size};
    const int64_t bytes_per_block = geometry.BytesPerBlock();
    KV_CHECK_EQ(bytes_per_block,
                layers_per_block *
                    cpu::PagedLayerBytes(c.storage, c.block_size, c.num_kv_heads, c.head_dim));
    KV_ASSIGN_OR_RETURN(BackendBuffer buffer,
                        backend.Allocate(static_cast<size_t>(bytes_per_block * c.num_blocks),
                                         Backend::BufferUse::kResident));
    return std::unique_ptr<KvPool>(
        new KvPool(c, bytes_per_block, layers_per_block, std::move(buffer)));
}

KvPool::KvPool(const KvPoolConfig& c, int64_t bytes_per_block, int64_t layers_per_block,
               BackendBuffer buffer)
    : config_(c),
      bytes_per_block_(bytes_per_block),
      layers_per_block_(layers_per_block),
      buffer_(std::move(buffer)) {}

int64_t KvPool::SlotOfLayer(int64_t layer) const {
    return config_.slot_of_layer.empty() ? layer
                                         : config_.slot_of_layer[static_cast<size_t>(layer)];
}

cpu::PagedKvLayer KvPool::Layer(int64_t layer) {
    return cpu::MakePagedKvLayer(base(), bytes_per_block_, SlotOfLayer(layer), config_.storage,
                                 config_.block_size, config_.num_kv_heads, config_.head_dim);
}

}  // namespace kvshard
