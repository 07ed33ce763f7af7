#include "coordinator/engine_snapshot.h"

#include "kv/prefix_cache.h"

namespace kvshard {
namespace {

size_t ShardOf(uint64_t hash) { return static_cast<size_t>(hash % PrefixIndex::kShards); }

}  // namespace

const PrefixIndex::Entry* PrefixIndex::Find(uint64_t hash) const {
    const std::shared_ptr<const Shard>& shard = shards_[ShardOf(hash)];
    if (shard == nullptr) return nullptr;
    auto it = shard->find(hash);
    return it == shard->end() ? nullptr : &it->second;
}

PrefixIndex::Match PrefixIndex::MatchPrefix(std::span<const int32_t> token_ids) const {
    Match m;
    if (!enabled_ || token_ids.empty() || num_entries_ == 0) return m;
    const int64_t bs = block_size_;
    // As the block manager: at least one token is left to compute.
    const int64_t max_blocks = (static_cast<int64_t>(token_ids.size()) - 1) / bs;
    uint64_t parent_hash = kv::kRootHash;
    uint64_t parent_content = kv::kRootContentId;
    for (int64_t i = 0; i < max_blocks; ++i) {
        const uint64_t hash = kv::ChainHash(parent_hash, token_ids.subspan(i * bs, bs));
        const Entry* e = Find(hash);
        if (e == nullptr || e->parent_content_id != parent_content) break;
        m.blocks = i + 1;
        if (e->pinned) m.through_last_pinned = i + 1;
        parent_hash = hash;
        parent_content = e->content_id;
    }
    return m;
}

int64_t PrefixIndex::CachedPrefixTokens(std::span<const int32_t> token_ids) const {
    return MatchPrefix(token_ids).blocks * block_size_;
}

int64_t PrefixIndex::PinnedPrefixTokens(std::span<const int32_t> token_ids) const {
    if (num_pinned_ == 0) return 0;
    return MatchPrefix(token_ids).through_last_pinned * block_size_;
}

PrefixIndex PrefixIndexBuilder::Update(const kv::BlockManager& blocks) {
    const kv::PrefixCache& cache = blocks.prefix_cache();
    const auto n = static_cast<size_t>(blocks.num_blocks());
    if (seen_.size() != n) {
        seen_.assign(n, Seen{});
        last_ = PrefixIndex();
        for (auto& shard : last_.shards_) shard = std::make_shared<const PrefixIndex::Shard>();
    }
    PrefixIndex out = last_;
    out.enabled_ = blocks.config().enable_prefix_caching;
    out.block_size_ = blocks.block_size();

    // What changed since the last update: entries to drop, then entries to add (a hash may move
    // from an evicted block to a new one between two updates).
    std::vector<uint64_t> removed;
    std::vector<std::pair<uint64_t, PrefixIndex::Entry>> added;
    for (size_t b = 0; b < n; ++b) {
        const auto id = static_cast<kv::BlockId>(b);
        Seen now;
        if (cache.IsCached(id)) {
            now.hash = cache.Hash(id);
            now.entry = {cache.ContentId(id), cache.ParentContentId(id), blocks.PinCount(id) > 0};
        }
        Seen& before = seen_[b];
        if (now.hash == before.hash && now.entry == before.entry) continue;
        if (before.entry.content_id != 0) removed.push_back(before.hash);
        if (now.entry.content_id != 0) added.emplace_back(now.hash, now.entry);
        before = now;
    }
    if (removed.empty() && added.empty()) {
        last_ = out;
        return out;
    }
    // Copy each shard a change falls in once; the others stay shared with the last index.
    std::array<std::shared_ptr<PrefixIndex::Shard>, PrefixIndex::kShards> copies;
    auto writable = [&](uint64_t hash) -> PrefixIndex::Shard& {
        const size_t s = ShardOf(hash);
        if (copies[s] == nullptr) {
            copies[s] = std::make_shared<PrefixIndex::Shard>(*out.shards_[s]);
            out.shards_[s] = copies[s];
        }
        return *copies[s];
    };
    for (uint64_t hash : removed) {
        PrefixIndex::Shard& shard = writable(hash);
        auto it = shard.find(hash);
        if (it == shard.end()) continue;
        out.num_entries_--;
        if (it->second.pinned) out.num_pinned_--;
        shard.erase(it);
    }
    for (const auto& [hash, entry] : added) {
        PrefixIndex::Shard& shard = writable(hash);
        auto it = shard.find(hash);
        if (it == shard.end()) {
            shard.emplace(hash, entry);
            out.num_entries_++;
        } else {
            if (it->second.pinned) out.num_pinned_--;
            it->second = entry;
        }
        if (entry.pinned) out.num_pinned_++;
    }
    last_ = out;
    return out;
}

}  // namespace kvshard
