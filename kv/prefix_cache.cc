#include "kv/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>

#include "common/check.h"

namespace kvshard::kv {

uint64_t ChainHash(uint64_t parent_hash, std::span<const int32_t> token_ids) {
    return XXH3_64bits_withSeed(token_ids.data(), token_ids.size_bytes(), parent_hash);
}

uint64_t GroupRootHash(int64_t group) {
    if (group == 0) return kRootHash;
    // splitmix64 of the group number: any fixed, distinct, nonzero seed would do.
    uint64_t z = static_cast<uint64_t>(group) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

PrefixCache::PrefixCache(int64_t num_blocks, int64_t block_size)
    : block_size_(block_size),
      entries_(static_cast<size_t>(num_blocks)),
      token_ids_(static_cast<size_t>(num_blocks * block_size)) {
    KV_CHECK_GT(num_blocks, 0);
    KV_CHECK_GT(block_size, 0);
}

std::optional<BlockId> PrefixCache::Find(uint64_t hash, uint64_t parent_content_id,
                                         std::span<const int32_t> token_ids, int32_t group) const {
    auto it = by_hash_.find(hash);
    if (it == by_hash_.end()) return std::nullopt;
    const BlockId block = it->second;
    if (entries_[block].parent_content_id != parent_content_id) return std::nullopt;
    if (entries_[block].group != group) return std::nullopt;
    std::span<const int32_t> stored = TokenIds(block);
    if (!std::equal(stored.begin(), stored.end(), token_ids.begin(), token_ids.end())) {
        return std::nullopt;
    }
    return block;
}

uint64_t PrefixCache::Insert(BlockId block, uint64_t hash, uint64_t parent_content_id,
                             std::span<const int32_t> token_ids, int32_t group) {
    KV_CHECK(!IsCached(block)) << "block " << block;
    KV_CHECK(!ContainsHash(hash)) << "hash " << hash;
    KV_CHECK_EQ(static_cast<int64_t>(token_ids.size()), block_size_);
    Entry& e = entries_[block];
    e.content_id = next_content_id_++;
    e.hash = hash;
    e.parent_content_id = parent_content_id;
    e.group = group;
    e.evictable = false;
    std::copy(token_ids.begin(), token_ids.end(), token_ids_.begin() + block * block_size_);
    by_hash_.emplace(hash, block);
    return e.content_id;
}

uint64_t PrefixCache::ContentId(BlockId block) const {
    KV_CHECK(IsCached(block)) << "block " << block;
    return entries_[block].content_id;
}

uint64_t PrefixCache::Hash(BlockId block) const {
    KV_CHECK(IsCached(block)) << "block " << block;
    return entries_[block].hash;
}

uint64_t PrefixCache::ParentContentId(BlockId block) const {
    KV_CHECK(IsCached(block)) << "block " << block;
    return entries_[block].parent_content_id;
}

int32_t PrefixCache::Group(BlockId block) const {
    KV_CHECK(IsCached(block)) << "block " << block;
    return entries_[block].group;
}

std::span<const int32_t> PrefixCache::TokenIds(BlockId block) const {
    return {token_ids_.data() + block * block_size_, static_cast<size_t>(block_size_)};
}

void PrefixCache::Release(BlockId block) {
    Entry& e = entries_[block];
    KV_CHECK(e.content_id != 0 && !e.evictable) << "block " << block;
    e.evictable = true;
    e.lru_prev = lru_tail_;
    e.lru_next = kNoBlock;
    if (lru_tail_ != kNoBlock) {
        entries_[lru_tail_].lru_next = block;
    } else {
        lru_head_ = block;
    }
    lru_tail_ = block;
    ++num_evictable_;
}

void PrefixCache::Acquire(BlockId block) {
    KV_CHECK(IsEvictable(block)) << "block " << block;
    Unlink(block);
}

void PrefixCache::Unlink(BlockId block) {
    Entry& e = entries_[block];
    if (e.lru_prev != kNoBlock) {
        entries_[e.lru_prev].lru_next = e.lru_next;
    } else {
        lru_head_ = e.lru_next;
    }
    if (e.lru_next != kNoBlock) {
        entries_[e.lru_next].lru_prev = e.lru_prev;
    } else {
        lru_tail_ = e.lru_prev;
    }
    e.lru_prev = e.lru_next = kNoBlock;
    e.evictable = false;
    --num_evictable_;
}

BlockId PrefixCache::EvictLru() {
    KV_CHECK_GT(num_evictable_, 0);
    const BlockId block = lru_head_;
    Unlink(block);
    Entry& e = entries_[block];
    by_hash_.erase(e.hash);
    e = Entry{};
    return block;
}

std::vector<BlockId> PrefixCache::EvictionOrder() const {
    std::vector<BlockId> order;
    order.reserve(static_cast<size_t>(num_evictable_));
    for (BlockId b = lru_head_; b != kNoBlock; b = entries_[b].lru_next) order.push_back(b);
    return order;
}

}  // namespace kvshard::kv
