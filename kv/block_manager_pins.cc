// BlockManager's pins (kv/block_manager.h, docs/prompt-caching.md): the published full blocks of a
// prefix kept out of LRU eviction until a TTL after their last use, within the pool's pinned share.
#include <algorithm>
#include <set>

#include "common/check.h"
#include "kv/block_manager.h"

namespace kvshard::kv {

// ---- Pins ----

int64_t BlockManager::SetTime(Clock::time_point now) {
    if (now > now_) now_ = now;
    int64_t lapsed = 0;
    while (!pins_by_expiry_.empty() && pins_by_expiry_.begin()->first <= now_) {
        Unpin(pins_by_expiry_.begin()->second);
        ++pins_expired_;
        ++lapsed;
    }
    return lapsed;
}

PinResult BlockManager::Pin(SeqId seq, int64_t prefix_tokens, Clock::duration ttl) {
    KV_CHECK(ttl > Clock::duration::zero()) << "seq " << seq;
    PinResult r;
    if (!config_.enable_prefix_caching || max_pinned_blocks_ == 0) return r;  // kDisabled
    if (prefix_tokens < config_.min_pinned_tokens) {
        r.outcome = PinResult::Outcome::kTooShort;
        return r;
    }
    const Sequence& s = Get(seq);
    const int64_t bs = config_.block_size;
    const GroupTable& anchor = s.groups[0];
    const auto want = std::min({prefix_tokens / bs, static_cast<int64_t>(s.token_ids.size()) / bs,
                                static_cast<int64_t>(anchor.chain_content_ids.size())});
    // The anchor's published blocks along the chain, up to the first that is gone.
    std::vector<BlockId> anchor_blocks;
    anchor_blocks.reserve(static_cast<size_t>(std::max<int64_t>(want, 0)));
    for (int64_t i = 0; i < want; ++i) {
        const BlockId b = PublishedBlock(s, 0, i);
        if (b == kNoBlock) break;
        anchor_blocks.push_back(b);
    }
    // The longest prefix whose hit every other group could serve: a group's published blocks
    // from where its window reads at the prefix's end. The pin holds those blocks, the other
    // groups' first, the anchor's last.
    std::vector<BlockId> blocks;
    auto n = static_cast<int64_t>(anchor_blocks.size());
    for (; n > 0; --n) {
        blocks.clear();
        bool ok = true;
        for (int64_t g = num_groups() - 1; g >= 1 && ok; --g) {
            const GroupTable& t = s.groups[static_cast<size_t>(g)];
            for (int64_t i = NumReleasable(g, n * bs); i < n && ok; ++i) {
                const BlockId b = i < static_cast<int64_t>(t.chain_content_ids.size())
                                      ? PublishedBlock(s, g, i)
                                      : kNoBlock;
                ok = b != kNoBlock;
                if (ok) blocks.push_back(b);
            }
        }
        if (ok) break;
    }
    if (n == 0) {
        r.outcome = PinResult::Outcome::kNothingCached;
        return r;
    }
    blocks.insert(blocks.end(), anchor_blocks.begin(), anchor_blocks.begin() + n);
    const uint64_t key = anchor.chain_content_ids[static_cast<size_t>(n - 1)];
    if (auto it = pins_.find(key); it != pins_.end()) {
        TouchPin(key, std::max(it->second.ttl, ttl));
        r.outcome = PinResult::Outcome::kRefreshed;
        r.pinned_tokens = n * bs;
        return r;
    }
    if (n > max_pinned_blocks_) {
        ++pins_refused_;
        r.outcome = PinResult::Outcome::kNoRoom;
        return r;
    }
    auto new_blocks = [&] {
        int64_t k = 0;
        for (BlockId b : blocks) k += pin_counts_[b] == 0 ? 1 : 0;
        return k;
    };
    // Make room: the least recently used pins lapse first, except the pins of a prefix of this
    // one (their blocks are this pin's too: letting them lapse frees nothing).
    std::set<uint64_t> own_prefixes(anchor.chain_content_ids.begin(),
                                    anchor.chain_content_ids.begin() + static_cast<ptrdiff_t>(n));
    for (auto it = pins_by_use_.begin();
         num_pinned_blocks_ + new_blocks() > max_pinned_blocks_ && it != pins_by_use_.end();) {
        const uint64_t victim = it->second;
        ++it;
        if (own_prefixes.contains(victim)) continue;
        Unpin(victim);  // erases only the victim's entry: `it` stays valid
        ++pins_refused_;
    }
    KV_CHECK_LE(num_pinned_blocks_ + new_blocks(), max_pinned_blocks_);
    for (BlockId b : blocks) PinBlock(b);
    PinState& p = pins_[key];
    p.blocks = std::move(blocks);
    p.ttl = ttl;
    p.expiry = now_ + ttl;
    p.last_used = now_;
    pins_by_expiry_.emplace(p.expiry, key);
    pins_by_use_.emplace(p.last_used, key);
    r.outcome = PinResult::Outcome::kPinned;
    r.pinned_tokens = n * bs;
    return r;
}

bool BlockManager::LapseOldestPin() {
    if (pins_by_use_.empty()) return false;
    Unpin(pins_by_use_.begin()->second);
    ++pins_refused_;
    return true;
}

void BlockManager::TouchPin(uint64_t key, Clock::duration ttl) {
    PinState& p = pins_.at(key);
    pins_by_expiry_.erase({p.expiry, key});
    pins_by_use_.erase({p.last_used, key});
    p.ttl = ttl;
    p.expiry = std::max(p.expiry, now_ + ttl);
    p.last_used = now_;
    pins_by_expiry_.emplace(p.expiry, key);
    pins_by_use_.emplace(p.last_used, key);
}

void BlockManager::Unpin(uint64_t key) {
    auto it = pins_.find(key);
    KV_CHECK(it != pins_.end()) << "pin " << key;
    PinState p = std::move(it->second);
    pins_.erase(it);
    pins_by_expiry_.erase({p.expiry, key});
    pins_by_use_.erase({p.last_used, key});
    // Last block first, as Free does: the prefix's first blocks are evicted last.
    for (auto b = p.blocks.rbegin(); b != p.blocks.rend(); ++b) UnpinBlock(*b);
}

void BlockManager::PinBlock(BlockId b) {
    KV_CHECK(cache_.IsCached(b)) << "block " << b;
    if (pin_counts_[b]++ > 0) return;
    ++num_pinned_blocks_;
    if (ref_counts_[b] == 0) {
        cache_.Acquire(b);  // out of the LRU list
        ++num_pinned_idle_blocks_;
    }
}

void BlockManager::UnpinBlock(BlockId b) {
    KV_CHECK_GT(pin_counts_[b], 0) << "block " << b;
    if (--pin_counts_[b] > 0) return;
    --num_pinned_blocks_;
    if (ref_counts_[b] == 0) {
        --num_pinned_idle_blocks_;
        cache_.Release(b);  // back to LRU, most recently released; still cached
    }
}

}  // namespace kvshard::kv
