#include "worker/kv_pool.h"

#include <cstring>
#include <string>

namespace kvshard {

Result<std::unique_ptr<KvPool>> KvPool::Create(const KvPoolConfig& c) {
    auto positive = [](const char* name, int64_t v) -> Status {
        if (v <= 0) return InvalidArgument(std::string("KV pool: ") + name + " must be positive, got " + std::to_string(v));
        return Status::Ok();
    };
    KV_RETURN_IF_ERROR(positive("num_blocks", c.num_blocks));
    KV_RETURN_IF_ERROR(positive("block_size", c.block_size));
    KV_RETURN_IF_ERROR(positive("num_layers", c.num_layers));
    KV_RETURN_IF_ERROR(positive("num_kv_heads", c.num_kv_heads));
    KV_RETURN_IF_ERROR(positive("head_dim", c.head_dim));
    return std::unique_ptr<KvPool>(new KvPool(c));
}

KvPool::KvPool(const KvPoolConfig& c)
    : config_(c),
      bytes_per_block_(c.num_layers *
                       cpu::PagedLayerBytes(c.storage, c.block_size, c.num_kv_heads, c.head_dim)),
      // Not value-initialized on purpose: untouched pages cost no memory until blocks are used.
      data_(new uint8_t[static_cast<size_t>(bytes_per_block_ * c.num_blocks)]) {}

cpu::PagedKvLayer KvPool::Layer(int64_t layer) {
    return cpu::MakePagedKvLayer(data_.get(), bytes_per_block_, layer, config_.storage,
                                 config_.block_size, config_.num_kv_heads, config_.head_dim);
}

void KvPool::CopyBlock(int32_t src, int32_t dst) {
    KV_CHECK(ValidBlock(src) && ValidBlock(dst)) << "src=" << src << " dst=" << dst;
    std::memcpy(data_.get() + dst * bytes_per_block_, data_.get() + src * bytes_per_block_,
                static_cast<size_t>(bytes_per_block_));
}

}  // namespace kvshard
