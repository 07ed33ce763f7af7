// EngineSnapshot: what an instance's engine thread publishes after each PlanStep and CompleteStep
// for other threads to read — the router's prefix lookups and the stats — so that no thread but
// the engine's ever touches its BlockManager ("one owner thread", kv/block_manager.h).
//
// A snapshot is immutable: a reader holds a shared_ptr<const EngineSnapshot> for as long as it
// likes while the engine goes on and publishes newer ones. Its PrefixIndex answers the two
// questions the router asks of an instance, with the BlockManager's answers as of the publish:
//   CachedPrefixTokens(prompt)  the tokens of `prompt` a prefix hit would serve from the cache;
//   PinnedPrefixTokens(prompt)  of those, the tokens up to the last block a pin covers.
// It keeps, for every published block, its chain hash, content id, parent content id and whether
// a pin covers it, and walks a prompt's chain hashes as the block manager does (the parent of each
// hit must be the block matched one position earlier; with KV cache groups, group 0's chain is
// the anchor and every other group must hold the blocks its window reads). The one difference: it
// compares hashes, not token ids (it keeps none), so a 64-bit chain-hash collision could make it
// count a block the cache would refuse — a placement off by one block, never a wrong KV read.
//
// Cost: the index is sharded by hash into copy-on-write sorted vectors, one shard per
// kBlocksPerShard blocks of the BlockManager (at least kMinShards, a power of two), and an update
// copies only the shards a change falls in (about kBlocksPerShard entries each) plus the table of
// shard pointers; an unchanged shard is shared between consecutive snapshots. So an update costs
// O(changes * kBlocksPerShard + num_blocks / kBlocksPerShard), not O(cached blocks): a full cache
// of a large GPU (tens of thousands of blocks) is not copied every step.
// PrefixIndexBuilder::Update compares every block with what it published last (O(num_blocks));
// UpdateBlocks only the blocks the caller names, for when it knows which may have changed (the
// engine: those its last step computed or received, when nothing was evicted and no pin changed).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "coordinator/engine_api.h"
#include "kv/block_manager.h"

namespace kvshard {

class PrefixIndex {
  public:
    static constexpr int64_t kMinShards = 64;
    static constexpr int64_t kBlocksPerShard = 16;

    struct Entry {
        uint64_t content_id = 0;
        uint64_t parent_content_id = 0;
        bool pinned = false;
        friend bool operator==(const Entry&, const Entry&) = default;
    };
    using Shard = std::vector<std::pair<uint64_t, Entry>>;  // (chain hash, block), by hash

    // Answers as BlockManager::CachedPrefixTokens / PinnedPrefixTokens did when it was built.
    int64_t CachedPrefixTokens(std::span<const int32_t> token_ids) const;
    int64_t PinnedPrefixTokens(std::span<const int32_t> token_ids) const;
    int64_t num_blocks() const { return num_entries_; }  // published blocks indexed
    int64_t num_shards() const { return shards_ ? static_cast<int64_t>(shards_->size()) : 0; }
    // Shards this index shares with `other` (the same copy, not equal contents): what an update
    // did not copy. For tests of the update's cost.
    int64_t num_shards_shared_with(const PrefixIndex& other) const;

  private:
    friend class PrefixIndexBuilder;
    // The matched blocks of `token_ids`, and how many of the first of them end with a pinned one.
    struct Match {
        int64_t blocks = 0;
        int64_t through_last_pinned = 0;
    };
    Match MatchPrefix(std::span<const int32_t> token_ids) const;
    const Entry* Find(uint64_t hash) const;

    bool enabled_ = false;
    int64_t block_size_ = 16;
    std::vector<int64_t> windows_ = {0};  // by KV cache group (0: full attention)
    int64_t num_entries_ = 0;
    int64_t num_pinned_ = 0;
    using Shards = std::vector<std::shared_ptr<const Shard>>;  // size: a power of two
    std::shared_ptr<const Shards> shards_;
};

// Builds successive PrefixIndexes of one BlockManager, on its owner thread.
class PrefixIndexBuilder {
  public:
    // The index of `blocks` now. REQUIRES: the same BlockManager (or one of the same num_blocks)
    // at every call.
    PrefixIndex Update(const kv::BlockManager& blocks);
    // The same, when only `changed` can differ from the last update (ids may repeat).
    // REQUIRES: Update was called before.
    PrefixIndex UpdateBlocks(const kv::BlockManager& blocks, std::span<const kv::BlockId> changed);
    const PrefixIndex& last() const { return last_; }

  private:
    struct Seen {
        uint64_t hash = 0;
        PrefixIndex::Entry entry;  // content_id 0: not published
    };
    // Compares `block` with what was published; records the change.
    void Check(const kv::BlockManager& blocks, kv::BlockId block);
    // Applies the recorded changes to a copy of the last index.
    PrefixIndex Apply(const kv::BlockManager& blocks);
    std::vector<uint64_t> removed_;
    std::vector<std::pair<uint64_t, PrefixIndex::Entry>> added_;
    std::vector<Seen> seen_;  // by block id, as last published
    PrefixIndex last_;
};

struct EngineSnapshot {
    uint64_t version = 0;  // grows by one with each publish
    PrefixIndex prefix;
    EngineStats stats;  // instances[0].up as of the publish (InstanceEngine::Stats reads it now)
    kv::BlockManagerStats blocks;
};

}  // namespace kvshard
