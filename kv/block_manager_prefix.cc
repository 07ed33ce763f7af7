// BlockManager's side of the prefix cache (kv/block_manager.h): matching a prompt against the
// published chains of every group, publishing a sequence's computed full blocks, the releases of
// windowed groups, and the log of blocks that left the cache. Admission, appends and the block
// states are in block_manager.cc.
#include <algorithm>

#include "common/check.h"
#include "kv/block_manager.h"

namespace kvshard::kv {

// ---- Matching ----

BlockManager::PrefixMatch BlockManager::MatchPrefix(std::span<const int32_t> token_ids) const {
    PrefixMatch m;
    if (!config_.enable_prefix_caching || token_ids.empty()) return m;
    const int64_t bs = config_.block_size;
    const int64_t num_groups = this->num_groups();
    auto block_tokens = [&](int64_t i) { return token_ids.subspan(i * bs, bs); };
    // Leave at least one token to compute: its logits start the generation.
    const int64_t max_blocks = (static_cast<int64_t>(token_ids.size()) - 1) / bs;
    // The anchor, group 0: its chain must be cached whole.
    GroupMatch anchor;
    uint64_t parent_hash = GroupRootHash(0);
    uint64_t parent_content = kRootContentId;
    for (int64_t i = 0; i < max_blocks; ++i) {
        const uint64_t hash = ChainHash(parent_hash, block_tokens(i));
        std::optional<BlockId> hit = cache_.Find(hash, parent_content, block_tokens(i));
        if (!hit) break;
        anchor.blocks.push_back(*hit);
        anchor.hashes.push_back(hash);
        parent_hash = hash;
        parent_content = cache_.ContentId(*hit);
        anchor.content_ids.push_back(parent_content);
    }
    auto h = static_cast<int64_t>(anchor.blocks.size());
    if (h == 0) return m;
    m.groups.resize(static_cast<size_t>(num_groups));
    m.groups[0] = std::move(anchor);
    // The other groups: each block found under its group's chain hash with the anchor's block
    // before it as parent; missing[g][i]: blocks not found among the first i.
    std::vector<std::vector<int64_t>> missing(static_cast<size_t>(num_groups));
    for (int64_t g = 1; g < num_groups; ++g) {
        GroupMatch& gm = m.groups[static_cast<size_t>(g)];
        std::vector<int64_t>& miss = missing[static_cast<size_t>(g)];
        miss.assign(static_cast<size_t>(h + 1), 0);
        uint64_t hash = GroupRootHash(g);
        for (int64_t i = 0; i < h; ++i) {
            hash = ChainHash(hash, block_tokens(i));
            const uint64_t parent = i == 0 ? kRootContentId : m.groups[0].content_ids[i - 1];
            std::optional<BlockId> hit =
                cache_.Find(hash, parent, block_tokens(i), static_cast<int32_t>(g));
            gm.hashes.push_back(hash);
            gm.blocks.push_back(hit ? *hit : kNoBlock);
            gm.content_ids.push_back(hit ? cache_.ContentId(*hit) : 0);
            miss[i + 1] = miss[i] + (hit ? 0 : 1);
        }
    }
    // The longest hit every group can serve: a group needs the blocks its window reads from the
    // first computed position (h * bs) on.
    for (; h > 0; --h) {
        bool ok = true;
        for (int64_t g = 1; g < num_groups && ok; ++g) {
            const std::vector<int64_t>& miss = missing[static_cast<size_t>(g)];
            ok = miss[h] - miss[NumReleasable(g, h * bs)] == 0;
        }
        if (ok) break;
    }
    if (h == 0) {
        m.groups.clear();
        return m;
    }
    m.num_blocks = h;
    for (int64_t g = 0; g < num_groups; ++g) {
        GroupMatch& gm = m.groups[static_cast<size_t>(g)];
        gm.blocks.resize(static_cast<size_t>(h));
        gm.hashes.resize(static_cast<size_t>(h));
        gm.content_ids.resize(static_cast<size_t>(h));
        for (int64_t i = NumReleasable(g, h * bs); i < h; ++i) {
            const BlockId b = gm.blocks[static_cast<size_t>(i)];
            ++m.num_referenced;
            // A pinned unreferenced block is not among the available blocks to begin with.
            if (ref_counts_[b] == 0 && cache_.IsEvictable(b)) ++m.num_cached_unreferenced;
        }
    }
    return m;
}

int64_t BlockManager::CachedPrefixTokens(std::span<const int32_t> token_ids) const {
    return MatchPrefix(token_ids).num_blocks * config_.block_size;
}

int64_t BlockManager::PinnedPrefixTokens(std::span<const int32_t> token_ids) const {
    if (pins_.empty()) return 0;
    const PrefixMatch m = MatchPrefix(token_ids);
    int64_t pinned = 0;
    for (int64_t i = 0; i < m.num_blocks; ++i) {
        if (pin_counts_[m.groups[0].blocks[static_cast<size_t>(i)]] > 0) pinned = i + 1;
    }
    return pinned * config_.block_size;
}

BlockId BlockManager::PublishedBlock(const Sequence& s, int64_t group, int64_t i) const {
    const GroupTable& t = s.groups[static_cast<size_t>(group)];
    const uint64_t content = t.chain_content_ids[static_cast<size_t>(i)];
    if (content == 0) return kNoBlock;  // a hit's block released at admission, never found
    const BlockId own = t.blocks[static_cast<size_t>(i)];
    if (own != kNoBlock && cache_.IsCached(own) && cache_.ContentId(own) == content) return own;
    const int64_t bs = config_.block_size;
    std::span<const int32_t> tokens(s.token_ids.data() + i * bs, static_cast<size_t>(bs));
    const uint64_t parent =
        i == 0 ? kRootContentId : s.groups[0].chain_content_ids[static_cast<size_t>(i - 1)];
    std::optional<BlockId> twin = cache_.Find(t.chain_hashes[static_cast<size_t>(i)], parent,
                                              tokens, static_cast<int32_t>(group));
    if (!twin || cache_.ContentId(*twin) != content) return kNoBlock;  // the published one is gone
    return *twin;
}

// ---- Publishing and windows ----

void BlockManager::PublishGroup(Sequence& s, int64_t group, int64_t full_blocks, SeqId seq) {
    const int64_t bs = config_.block_size;
    GroupTable& t = s.groups[static_cast<size_t>(group)];
    const GroupTable& anchor = s.groups[0];
    // A group other than the anchor chains to the anchor's blocks: it goes no further than they.
    const int64_t limit =
        group == 0 ? full_blocks
                   : std::min(full_blocks, static_cast<int64_t>(anchor.chain_content_ids.size()));
    for (auto i = static_cast<int64_t>(t.chain_hashes.size()); i < limit && !t.chain_broken; ++i) {
        const uint64_t parent_hash = i == 0 ? GroupRootHash(group) : t.chain_hashes[i - 1];
        const uint64_t parent_content =
            i == 0 ? kRootContentId : anchor.chain_content_ids[static_cast<size_t>(i - 1)];
        std::span<const int32_t> tokens(s.token_ids.data() + i * bs, static_cast<size_t>(bs));
        const uint64_t hash = ChainHash(parent_hash, tokens);
        const BlockId b = t.blocks[static_cast<size_t>(i)];
        const auto g32 = static_cast<int32_t>(group);
        uint64_t content;
        if (b == kNoBlock) {
            // Released before it could be published (not reached: publishing comes first).
            t.chain_broken = true;
            break;
        } else if (cache_.IsCached(b)) {
            // Shared with the fork or sequence that published it: same tokens, same prefix.
            KV_CHECK_EQ(cache_.Hash(b), hash)
                << "seq " << seq << " group " << group << " block " << i;
            content = cache_.ContentId(b);
        } else if (std::optional<BlockId> twin = cache_.Find(hash, parent_content, tokens, g32)) {
            // Computed twice (e.g. two prompts admitted before either was published): keep the
            // first; this block stays private and is freed, not cached, when the sequence ends.
            content = cache_.ContentId(*twin);
        } else if (cache_.ContainsHash(hash)) {
            t.chain_broken = true;
            break;
        } else {
            content = cache_.Insert(b, hash, parent_content, tokens, g32);
        }
        t.chain_hashes.push_back(hash);
        t.chain_content_ids.push_back(content);
    }
}

void BlockManager::ReleaseOutOfWindow(GroupTable& t, int64_t group, int64_t num_computed) {
    const int64_t releasable = NumReleasable(group, num_computed);
    // Oldest first: the earliest blocks, which later prefix hits need least, are evicted first.
    for (int64_t i = t.num_released; i < releasable; ++i) {
        const BlockId b = t.blocks[static_cast<size_t>(i)];
        t.blocks[static_cast<size_t>(i)] = kNoBlock;
        if (b != kNoBlock) {
            DropRef(b);
            ++num_window_released_;
        }
    }
    t.num_released = std::max(t.num_released, releasable);
}

void BlockManager::MarkComputed(SeqId seq, int64_t num_computed_tokens) {
    Sequence& s = Get(seq);
    KV_CHECK_LE(num_computed_tokens, static_cast<int64_t>(s.token_ids.size()));
    s.num_computed = std::max(s.num_computed, num_computed_tokens);
    if (config_.enable_prefix_caching) {
        // The anchor first: the other groups' blocks take its content ids as parents.
        for (int64_t g = 0; g < num_groups(); ++g)
            PublishGroup(s, g, num_computed_tokens / config_.block_size, seq);
    }
    for (int64_t g = 0; g < num_groups(); ++g)
        ReleaseOutOfWindow(s.groups[static_cast<size_t>(g)], g, s.num_computed);
}

// ---- Leaving the cache ----

void BlockManager::LogUncached(BlockId b) {
    if (uncached_log_full_) return;
    if (static_cast<int64_t>(uncached_log_.size()) >= config_.num_blocks) {
        uncached_log_full_ = true;
        uncached_log_.clear();
        return;
    }
    uncached_log_.push_back(b);
}

std::optional<std::vector<BlockId>> BlockManager::TakeUncachedBlocks() {
    std::optional<std::vector<BlockId>> out;
    if (!uncached_log_full_) out = std::move(uncached_log_);
    uncached_log_.clear();
    uncached_log_full_ = false;
    return out;
}

int64_t BlockManager::DropCachedBlocks() {
    while (!pins_.empty()) Unpin(pins_.begin()->first);
    int64_t dropped = 0;
    while (cache_.num_evictable() > 0) {
        const BlockId b = cache_.EvictLru();
        LogUncached(b);
        block_num_tokens_[b] = 0;
        free_list_.push_back(b);
        in_free_list_[b] = 1;
        ++dropped;
    }
    return dropped;
}

}  // namespace kvshard::kv
