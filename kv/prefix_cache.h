// PrefixCache: which physical KV blocks hold which full blocks of tokens, so a new sequence whose
// prompt starts like an earlier one reuses that KV instead of recomputing it.
//
// Every cached block holds exactly `block_size` tokens. It is found by a chain hash of (the hash of
// the block before it, its token ids), but the hash is only an index: a lookup returns a block only
// when its stored token ids equal the query's and its stored parent is the block the query matched
// one position earlier. Parents are named by content ids (never reused, unlike block ids), so by
// induction a hit at position i means the whole prefix [0, (i + 1) * block_size) is equal, token
// for token, whatever the hash does.
//
// The cache does not own blocks or count references (the BlockManager does). It keeps the cached
// blocks that no sequence references in a least-recently-released list and gives them up oldest
// first when the BlockManager needs a block. A referenced cached block is never in that list.
//
// Thread-safety: none; owned by one BlockManager on the instance's engine thread.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/kv_types.h"

namespace kvshard::kv {

// The parent hash and parent content id of the first block of a sequence.
inline constexpr uint64_t kRootHash = 0;
inline constexpr uint64_t kRootContentId = 0;

// Chain hash (xxh3-64 seeded with the parent's hash) of one full block of token ids.
uint64_t ChainHash(uint64_t parent_hash, std::span<const int32_t> token_ids);

// The parent hash of the first block of a sequence in KV cache group `group` (block_manager.h):
// kRootHash for group 0, so a model with one group hashes exactly as before groups existed; a
// distinct seed for every other group, so the same tokens in two groups (whose blocks hold
// different layers) are cached under different hashes.
uint64_t GroupRootHash(int64_t group);

class PrefixCache {
  public:
    PrefixCache(int64_t num_blocks, int64_t block_size);

    // The cached block of KV cache group `group` with chain hash `hash`, token ids `token_ids` and
    // parent `parent_content_id` (kRootContentId for the first block of a sequence), or nullopt.
    std::optional<BlockId> Find(uint64_t hash, uint64_t parent_content_id,
                                std::span<const int32_t> token_ids, int32_t group = 0) const;
    // True when some block is cached under `hash` (whatever its tokens).
    bool ContainsHash(uint64_t hash) const { return by_hash_.contains(hash); }

    // Publishes `block` (referenced by a sequence, so not evictable) and returns its new content
    // id. REQUIRES: !IsCached(block); !ContainsHash(hash); token_ids.size() == block_size.
    uint64_t Insert(BlockId block, uint64_t hash, uint64_t parent_content_id,
                    std::span<const int32_t> token_ids, int32_t group = 0);

    bool IsCached(BlockId block) const { return entries_[block].content_id != 0; }
    // REQUIRES: IsCached(block).
    uint64_t ContentId(BlockId block) const;
    uint64_t Hash(BlockId block) const;
    uint64_t ParentContentId(BlockId block) const;
    int32_t Group(BlockId block) const;
    std::span<const int32_t> TokenIds(BlockId block) const;

    // The last reference to cached `block` was dropped: it becomes the most recently released
    // evictable block. REQUIRES: IsCached(block) && !IsEvictable(block).
    void Release(BlockId block);
    // A sequence references cached `block` again: it leaves the evictable list.
    // REQUIRES: IsEvictable(block).
    void Acquire(BlockId block);
    bool IsEvictable(BlockId block) const { return entries_[block].evictable; }

    // Forgets the least recently released evictable block and returns it (now an ordinary block).
    // REQUIRES: num_evictable() > 0.
    BlockId EvictLru();
    // The evictable blocks, least recently released first (tests and invariant checks).
    std::vector<BlockId> EvictionOrder() const;

    int64_t num_cached() const { return static_cast<int64_t>(by_hash_.size()); }
    int64_t num_evictable() const { return num_evictable_; }
    int64_t block_size() const { return block_size_; }

  private:
    struct Entry {
        uint64_t content_id = 0;  // 0: not cached
        uint64_t hash = 0;
        uint64_t parent_content_id = 0;
        int32_t group = 0;  // the KV cache group whose layers the block holds
        bool evictable = false;
        BlockId lru_prev = kNoBlock;  // towards the least recently released end
        BlockId lru_next = kNoBlock;
    };

    void Unlink(BlockId block);

    int64_t block_size_;
    std::vector<Entry> entries_;      // by block id
    std::vector<int32_t> token_ids_;  // block_size_ per block id
    std::unordered_map<uint64_t, BlockId> by_hash_;
    uint64_t next_content_id_ = 1;
    BlockId lru_head_ = kNoBlock;  // least recently released
    BlockId lru_tail_ = kNoBlock;  // most recently released
    int64_t num_evictable_ = 0;
};

}  // namespace kvshard::kv
