// BlockManager::CheckInvariants (kv/block_manager.h): every count recomputed from the block tables
// and the pins, and compared. For tests and debug builds.
#include <algorithm>
#include <string>

#include "kv/block_manager.h"

namespace kvshard::kv {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

Status BlockManager::CheckInvariants() const {
    const int64_t bs = config_.block_size;
    const int64_t nb = config_.num_blocks;
    auto fail = [](const std::string& what) { return Internal("block manager: " + what); };

    std::vector<int32_t> refs(static_cast<size_t>(nb), 0);
    std::vector<int32_t> expected_tokens(static_cast<size_t>(nb), -1);
    std::vector<SeqId> last_holder(static_cast<size_t>(nb), -1);  // catches a block held twice
    SeqId seq_index = 0;
    for (const auto& [id, s] : seqs_) {
        const auto len = static_cast<int64_t>(s.token_ids.size());
        const std::string who = "seq " + Str(id);  // short: fits the small-string buffer
        ++seq_index;
        if (len == 0) return fail(who + " has no tokens");
        if (static_cast<int64_t>(s.groups.size()) != num_groups())
            return fail(who + " has " + Str(s.groups.size()) + " block tables");
        if (s.num_computed > len) return fail(who + " computed past its tokens");
        for (int64_t g = 0; g < num_groups(); ++g) {
            const GroupTable& t = s.groups[static_cast<size_t>(g)];
            const std::string where = who + " group " + Str(g);
            if (static_cast<int64_t>(t.blocks.size()) != CeilDiv(len, bs)) {
                return fail(where + " has " + Str(len) + " tokens in " + Str(t.blocks.size()) +
                            " blocks");
            }
            if (t.num_released != NumReleasable(g, s.num_computed)) {
                return fail(where + " released " + Str(t.num_released) + " blocks, its window " +
                            Str(NumReleasable(g, s.num_computed)));
            }
            for (size_t i = 0; i < t.blocks.size(); ++i) {
                const BlockId b = t.blocks[i];
                if (static_cast<int64_t>(i) < t.num_released) {
                    if (b != kNoBlock) return fail(where + " holds released entry " + Str(i));
                    continue;
                }
                if (b < 0 || b >= nb) return fail(where + " holds block id " + Str(b));
                if (last_holder[b] == seq_index)
                    return fail(who + " holds block " + Str(b) + " twice");
                last_holder[b] = seq_index;
                ++refs[b];
                const int64_t want = std::min(bs, len - static_cast<int64_t>(i) * bs);
                if (expected_tokens[b] != -1 && expected_tokens[b] != want) {
                    return fail("block " + Str(b) +
                                " is shared by sequences that disagree on its fill");
                }
                expected_tokens[b] = static_cast<int32_t>(want);
            }
            if (t.chain_hashes.size() != t.chain_content_ids.size() ||
                static_cast<int64_t>(t.chain_hashes.size()) > len / bs ||
                (g > 0 && t.chain_hashes.size() > s.groups[0].chain_hashes.size())) {
                return fail(where + " has a chain of " + Str(t.chain_hashes.size()) + " blocks");
            }
            uint64_t parent_hash = GroupRootHash(g);
            for (size_t i = 0; i < t.chain_hashes.size(); ++i) {
                std::span<const int32_t> tokens(s.token_ids.data() + i * bs,
                                                static_cast<size_t>(bs));
                const uint64_t hash = ChainHash(parent_hash, tokens);
                if (hash != t.chain_hashes[i])
                    return fail(where + " chain hash " + Str(i) + " is stale");
                parent_hash = hash;
                const BlockId b = t.blocks[i];
                if (b != kNoBlock && cache_.IsCached(b)) {
                    std::span<const int32_t> stored = cache_.TokenIds(b);
                    if (!std::equal(stored.begin(), stored.end(), tokens.begin(), tokens.end())) {
                        return fail(where + " block " + Str(i) + " (id " + Str(b) +
                                    ") differs from its cached tokens");
                    }
                    // The content id may differ: when this block was registered as the twin of a
                    // block since evicted, a fork sharing it may have published it under a new id.
                    if (cache_.Hash(b) != hash || cache_.Group(b) != g) {
                        return fail(where + " block " + Str(i) +
                                    " is cached under another hash or group");
                    }
                }
            }
        }
    }

    // Pins: the counts their block lists give, the orders, the share.
    std::vector<int32_t> pins_on(static_cast<size_t>(nb), 0);
    for (const auto& [key, p] : pins_) {
        if (p.blocks.empty()) return fail("pin " + Str(static_cast<int64_t>(key)) + " is empty");
        for (BlockId b : p.blocks) {
            if (b < 0 || b >= nb || !cache_.IsCached(b)) {
                return fail("pin " + Str(static_cast<int64_t>(key)) + " covers block " + Str(b) +
                            ", not cached");
            }
            ++pins_on[b];
        }
        if (cache_.ContentId(p.blocks.back()) != key) return fail("pin key is not its last block");
        if (!pins_by_expiry_.contains({p.expiry, key}) ||
            !pins_by_use_.contains({p.last_used, key}))
            return fail("pin missing from its orders");
    }
    if (pins_by_expiry_.size() != pins_.size() || pins_by_use_.size() != pins_.size())
        return fail("pin orders disagree with the pins");
    int64_t pinned = 0, pinned_idle = 0;
    for (BlockId b = 0; b < nb; ++b) {
        if (pins_on[b] != pin_counts_[b]) return fail("block " + Str(b) + " pin count");
        pinned += pin_counts_[b] > 0;
        pinned_idle += pin_counts_[b] > 0 && ref_counts_[b] == 0;
    }
    if (pinned != num_pinned_blocks_ || pinned_idle != num_pinned_idle_blocks_)
        return fail("pinned block counts " + Str(num_pinned_blocks_) + "/" +
                    Str(num_pinned_idle_blocks_) + ", blocks say " + Str(pinned) + "/" +
                    Str(pinned_idle));
    if (pinned > max_pinned_blocks_)
        return fail(Str(pinned) + " pinned blocks, more than the share of " +
                    Str(max_pinned_blocks_));

    int64_t used = 0, free = 0, evictable = 0, stored = 0;
    for (BlockId b = 0; b < nb; ++b) {
        const std::string what = "block " + Str(b);
        if (refs[b] != ref_counts_[b]) {
            return fail(what + " ref count " + Str(ref_counts_[b]) + ", tables say " +
                        Str(refs[b]));
        }
        const bool is_used = ref_counts_[b] > 0;
        const bool is_free = in_free_list_[b] != 0;
        const bool is_evictable = cache_.IsEvictable(b);
        const bool is_pinned = !is_used && pin_counts_[b] > 0;
        if (is_used + is_free + is_evictable + is_pinned != 1) {
            return fail(what + " is in " + Str(is_used + is_free + is_evictable + is_pinned) +
                        " states (used " + Str(is_used) + ", free " + Str(is_free) + ", cached " +
                        Str(is_evictable) + ", pinned " + Str(is_pinned) + ")");
        }
        if (is_evictable && !cache_.IsCached(b)) return fail(what + " evictable but not cached");
        if (is_free && cache_.IsCached(b)) return fail(what + " free but cached");
        if (is_used) {
            if (block_num_tokens_[b] != expected_tokens[b]) {
                return fail(what + " holds " + Str(block_num_tokens_[b]) + " tokens, expected " +
                            Str(expected_tokens[b]));
            }
            stored += block_num_tokens_[b];
        }
        if (cache_.IsCached(b) && block_num_tokens_[b] != bs) {
            return fail(what + " is cached but not full");
        }
        used += is_used;
        free += is_free;
        evictable += is_evictable;
    }
    if (free != static_cast<int64_t>(free_list_.size())) {
        return fail("free list has " + Str(free_list_.size()) + " entries for " + Str(free) +
                    " free blocks");
    }
    if (used != num_used_blocks_)
        return fail("used count " + Str(num_used_blocks_) + " vs " + Str(used));
    if (evictable != cache_.num_evictable() ||
        evictable != static_cast<int64_t>(cache_.EvictionOrder().size())) {  // walks the list
        return fail("evictable count mismatch");
    }
    if (used + free + evictable + pinned_idle != nb)
        return fail("free + used + pinned + cached != num_blocks");
    if (stored != stored_tokens_) {
        return fail("stored tokens " + Str(stored_tokens_) + ", blocks say " + Str(stored));
    }
    return Status::Ok();
}

}  // namespace kvshard::kv
