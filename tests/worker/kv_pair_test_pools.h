// The small model, pools and ops the KV pair path's tests share (kv_handoff_pairs_test.cc,
// kv_handoff_pairs_staging_test.cc): a spec of 4 KV heads, one rank's pool on a given backend
// filled with random bytes, the bytes of one global head of a block and layer (which a receiving
// rank must hold exactly as the sending rank did), and a transfer's send and receive ops.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "comm/step_plan.h"
#include "kernels/backend.h"
#include "kernels/paged_attention.h"
#include "config/model_spec.h"
#include "worker/kv_pool.h"
#include "worker/shard.h"

namespace kvshard::testing {

inline constexpr int64_t kPairLayers = 2, kPairBlockSize = 4, kPairHeadDim = 8, kPairBlocks = 6;

inline ModelSpec PairSpec() {
    ModelSpec s;
    s.num_heads = 8;
    s.num_kv_heads = 4;
    s.head_dim = kPairHeadDim;
    s.hidden_size = 64;
    s.ffn_size = 64;
    s.vocab_size = 32;
    s.num_layers = kPairLayers;
    return s;
}

// Rank `rank` of tp `tp`'s layout of PairSpec().
inline ShardLayout PairLayout(int rank, int tp) {
    Result<ShardLayout> layout = MakeShardLayout(PairSpec(), {.rank = rank, .tp = tp});
    KV_CHECK(layout.ok()) << layout.status().ToString();
    return *layout;
}

// A pool of the layout's heads on `backend`, every byte random from `seed`.
inline std::unique_ptr<KvPool> RandomPairPool(const ShardLayout& layout, Backend& backend,
                                              uint32_t seed) {
    KvPoolConfig config{.num_blocks = kPairBlocks,
                        .block_size = kPairBlockSize,
                        .num_layers = kPairLayers,
                        .num_kv_heads = layout.num_kv_heads(),
                        .head_dim = kPairHeadDim,
                        .storage = KvDtype::kFp32};
    Result<std::unique_ptr<KvPool>> pool = KvPool::Create(config, backend);
    KV_CHECK(pool.ok()) << pool.status().ToString();
    std::mt19937 rng(seed);
    for (int64_t blk = 0; blk < kPairBlocks; ++blk) {
        uint8_t* p = (*pool)->MutableBlockData(blk);
        for (int64_t i = 0; i < (*pool)->bytes_per_block(); ++i) p[i] = uint8_t(rng());
    }
    return std::move(*pool);
}

// K then V of global head `head`, layer `layer`, block `block` of a pool holding `layout`'s heads.
inline std::vector<uint8_t> PairHeadBytes(const KvPool& pool, const ShardLayout& layout,
                                          int64_t block, int64_t layer, int64_t head) {
    const KvPoolConfig& c = pool.config();
    const cpu::PagedKvLayer l = cpu::MakePagedKvLayer(
        nullptr, 0, pool.SlotOfLayer(layer), c.storage, c.block_size, c.num_kv_heads, c.head_dim);
    const int64_t h = head - layout.kv_heads.begin;
    const int64_t data = c.block_size * c.head_dim * KvDtypeBytes(c.storage);
    const uint8_t* b = pool.BlockData(block);
    std::vector<uint8_t> out;
    for (int64_t off : {l.k_offset + h * data, l.v_offset + h * data})
        out.insert(out.end(), b + off, b + off + data);
    return out;
}

// The send and receive ops of transfer `id` from instance "prefill" to instance "decode".
inline KvSendOp PairSendOp(uint64_t id) {
    KvSendOp op;
    op.transfer_id = id;
    op.dst_instance = "decode";
    return op;
}
inline KvRecvOp PairRecvOp(uint64_t id) {
    KvRecvOp op;
    op.transfer_id = id;
    op.src_instance = "prefill";
    return op;
}

}  // namespace kvshard::testing
