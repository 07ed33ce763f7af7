#include "coordinator/engine_snapshot.h"

#include <algorithm>

#include "common/check.h"
#include "kv/prefix_cache.h"

namespace kvshard {
namespace {

// REQUIRES: num_shards is a power of two.
size_t ShardOf(uint64_t hash, size_t num_shards) {
    return static_cast<size_t>(hash) & (num_shards - 1);
}

bool HashLess(const std::pair<uint64_t, PrefixIndex::Entry>& e, uint64_t hash) {
    return e.first < hash;
}

}  // namespace

const PrefixIndex::Entry* PrefixIndex::Find(uint64_t hash) const {
    if (shards_ == nullptr) return nullptr;
    const Shard& shard = *(*shards_)[ShardOf(hash, shards_->size())];
    auto it = std::lower_bound(shard.begin(), shard.end(), hash, HashLess);
    return it == shard.end() || it->first != hash ? nullptr : &it->second;
}

int64_t PrefixIndex::num_shards_shared_with(const PrefixIndex& other) const {
    if (shards_ == nullptr || other.shards_ == nullptr || shards_->size() != other.shards_->size())
        return 0;
    int64_t shared = 0;
    for (size_t s = 0; s < shards_->size(); ++s) shared += (*shards_)[s] == (*other.shards_)[s];
    return shared;
}

PrefixIndex::Match PrefixIndex::MatchPrefix(std::span<const int32_t> token_ids) const {
    Match m;
    if (!enabled_ || token_ids.empty() || num_entries_ == 0) return m;
    const int64_t bs = block_size_;
    auto block_tokens = [&](int64_t i) { return token_ids.subspan(i * bs, bs); };
    // As the block manager: at least one token is left to compute.
    const int64_t max_blocks = (static_cast<int64_t>(token_ids.size()) - 1) / bs;
    // Group 0, the anchor: its chain must be cached whole.
    std::vector<const Entry*> anchor;
    uint64_t parent_hash = kv::GroupRootHash(0);
    uint64_t parent_content = kv::kRootContentId;
    for (int64_t i = 0; i < max_blocks; ++i) {
        const uint64_t hash = kv::ChainHash(parent_hash, block_tokens(i));
        const Entry* e = Find(hash);
        if (e == nullptr || e->parent_content_id != parent_content) break;
        anchor.push_back(e);
        parent_hash = hash;
        parent_content = e->content_id;
    }
    auto h = static_cast<int64_t>(anchor.size());
    // The other groups: block i under the group's chain hash, the anchor's block i - 1 as parent.
    // missing[g][i]: the blocks of group g not found among the first i.
    const auto num_groups = static_cast<int64_t>(windows_.size());
    std::vector<std::vector<int64_t>> missing(static_cast<size_t>(num_groups));
    for (int64_t g = 1; g < num_groups && h > 0; ++g) {
        std::vector<int64_t>& miss = missing[static_cast<size_t>(g)];
        miss.assign(static_cast<size_t>(h + 1), 0);
        uint64_t hash = kv::GroupRootHash(g);
        for (int64_t i = 0; i < h; ++i) {
            hash = kv::ChainHash(hash, block_tokens(i));
            const uint64_t parent =
                i == 0 ? kv::kRootContentId : anchor[static_cast<size_t>(i - 1)]->content_id;
            const Entry* e = Find(hash);
            const bool hit = e != nullptr && e->parent_content_id == parent;
            miss[static_cast<size_t>(i + 1)] = miss[static_cast<size_t>(i)] + (hit ? 0 : 1);
        }
    }
    // The longest hit every group can serve: a group needs the blocks its window reads from the
    // first computed position on (BlockManager::NumReleasable).
    auto releasable = [&](int64_t g, int64_t num_computed) -> int64_t {
        const int64_t window = windows_[static_cast<size_t>(g)];
        const int64_t first_read = num_computed - window + 1;
        return window == 0 || first_read <= 0 ? 0 : first_read / bs;
    };
    for (; h > 0; --h) {
        bool ok = true;
        for (int64_t g = 1; g < num_groups && ok; ++g) {
            const std::vector<int64_t>& miss = missing[static_cast<size_t>(g)];
            ok = miss[static_cast<size_t>(h)] == miss[static_cast<size_t>(releasable(g, h * bs))];
        }
        if (ok) break;
    }
    m.blocks = h;
    for (int64_t i = 0; i < h; ++i) {
        if (anchor[static_cast<size_t>(i)]->pinned) m.through_last_pinned = i + 1;
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

void PrefixIndexBuilder::Check(const kv::BlockManager& blocks, kv::BlockId block) {
    const kv::PrefixCache& cache = blocks.prefix_cache();
    Seen& before = seen_[static_cast<size_t>(block)];
    const bool pinned = blocks.PinCount(block) > 0;
    if (!cache.IsCached(block)) {
        if (before.entry.content_id == 0) return;
        removed_.push_back(before.hash);
        before = Seen{};
        return;
    }
    // Content ids are never reused: the same id is the same hash and parent.
    const uint64_t content = cache.ContentId(block);
    if (content == before.entry.content_id && pinned == before.entry.pinned) return;
    if (before.entry.content_id != 0) removed_.push_back(before.hash);
    before.hash = cache.Hash(block);
    before.entry = {content, cache.ParentContentId(block), pinned};
    added_.emplace_back(before.hash, before.entry);
}

PrefixIndex PrefixIndexBuilder::Update(const kv::BlockManager& blocks) {
    const auto n = static_cast<size_t>(blocks.num_blocks());
    if (seen_.size() != n) {
        seen_.assign(n, Seen{});
        last_ = PrefixIndex();
        int64_t num_shards = PrefixIndex::kMinShards;
        while (num_shards * PrefixIndex::kBlocksPerShard < static_cast<int64_t>(n)) num_shards *= 2;
        last_.shards_ = std::make_shared<const PrefixIndex::Shards>(
            static_cast<size_t>(num_shards), std::make_shared<const PrefixIndex::Shard>());
    }
    for (size_t b = 0; b < n; ++b) Check(blocks, static_cast<kv::BlockId>(b));
    return Apply(blocks);
}

PrefixIndex PrefixIndexBuilder::UpdateBlocks(const kv::BlockManager& blocks,
                                             std::span<const kv::BlockId> changed) {
    KV_CHECK(seen_.size() == static_cast<size_t>(blocks.num_blocks()));
    for (kv::BlockId b : changed) {
        KV_CHECK(b >= 0 && b < blocks.num_blocks())
            << "block " << b << " of " << blocks.num_blocks();
        Check(blocks, b);
    }
    return Apply(blocks);
}

PrefixIndex PrefixIndexBuilder::Apply(const kv::BlockManager& blocks) {
    PrefixIndex out = last_;
    out.enabled_ = blocks.config().enable_prefix_caching;
    out.block_size_ = blocks.block_size();
    out.windows_.resize(static_cast<size_t>(blocks.num_groups()));
    for (int64_t g = 0; g < blocks.num_groups(); ++g)
        out.windows_[static_cast<size_t>(g)] = blocks.group_window(g);
    // Removals first: a hash may move from an evicted block to a new one between two updates.
    if (removed_.empty() && added_.empty()) {
        last_ = out;
        return out;
    }
    auto table = std::make_shared<PrefixIndex::Shards>(*out.shards_);
    std::vector<PrefixIndex::Shard*> copies(table->size(), nullptr);  // this update's own
    auto writable = [&](uint64_t hash) -> PrefixIndex::Shard& {
        const size_t s = ShardOf(hash, table->size());
        if (copies[s] == nullptr) {
            auto copy = std::make_shared<PrefixIndex::Shard>(*(*table)[s]);
            copies[s] = copy.get();
            (*table)[s] = std::move(copy);
        }
        return *copies[s];
    };
    for (uint64_t hash : removed_) {
        PrefixIndex::Shard& shard = writable(hash);
        auto it = std::lower_bound(shard.begin(), shard.end(), hash, HashLess);
        if (it == shard.end() || it->first != hash) continue;
        out.num_entries_--;
        if (it->second.pinned) out.num_pinned_--;
        shard.erase(it);
    }
    for (const auto& [hash, entry] : added_) {
        PrefixIndex::Shard& shard = writable(hash);
        auto it = std::lower_bound(shard.begin(), shard.end(), hash, HashLess);
        if (it == shard.end() || it->first != hash) {
            shard.emplace(it, hash, entry);
            out.num_entries_++;
        } else {
            if (it->second.pinned) out.num_pinned_--;
            it->second = entry;
        }
        if (entry.pinned) out.num_pinned_++;
    }
    out.shards_ = std::move(table);
    removed_.clear();
    added_.clear();
    last_ = out;
    return out;
}

}  // namespace kvshard
