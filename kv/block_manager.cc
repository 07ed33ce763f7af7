#include "kv/block_manager.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/check.h"

namespace kvshard::kv {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string Str(int64_t v) { return std::to_string(v); }

const BlockManagerConfig& Checked(const BlockManagerConfig& config) {
    const Status s = config.Validate();
    KV_CHECK(s.ok()) << s.ToString();
    return config;
}

}  // namespace

BlockManager::BlockManager(const BlockManagerConfig& config)
    : config_(Checked(config)), cache_(config.num_blocks, config.block_size) {
    windows_ = config.group_windows.empty() ? std::vector<int64_t>{0} : config.group_windows;
    watermark_blocks_ =
        static_cast<int64_t>(std::floor(config.watermark * static_cast<double>(config.num_blocks)));
    max_pinned_blocks_ = static_cast<int64_t>(
        std::floor(config.max_pinned_fraction * static_cast<double>(config.num_blocks)));
    const auto n = static_cast<size_t>(config.num_blocks);
    ref_counts_.assign(n, 0);
    pin_counts_.assign(n, 0);
    block_num_tokens_.assign(n, 0);
    in_free_list_.assign(n, 1);
    free_list_.reserve(n);
    // A stack: block 0 is handed out first.
    for (int64_t b = config.num_blocks - 1; b >= 0; --b)
        free_list_.push_back(static_cast<BlockId>(b));
}

Result<BlockManager> BlockManager::Create(const BlockManagerConfig& config) {
    KV_RETURN_IF_ERROR(config.Validate());
    return BlockManager(config);
}

// ---- Admission ----

int64_t BlockManager::NumReleasable(int64_t group, int64_t num_computed) const {
    const int64_t window = windows_[static_cast<size_t>(group)];
    if (window == 0) return 0;
    // Future queries sit at num_computed or later and read from position query - window + 1.
    const int64_t first_read = num_computed - window + 1;
    return first_read <= 0 ? 0 : first_read / config_.block_size;
}

int64_t BlockManager::NumAdmissionReleased(int64_t group, const PrefixMatch& m,
                                           const SequenceRequest& request) const {
    const int64_t computed = std::max(m.num_blocks * config_.block_size, request.incoming_tokens);
    return NumReleasable(group, computed);
}

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

bool BlockManager::CanAllocate(const SequenceRequest& request) const {
    const auto len = static_cast<int64_t>(request.prompt_token_ids.size());
    if (len == 0 || seqs_.contains(request.seq_id)) return false;
    const PrefixMatch m =
        request.skip_prefix_cache ? PrefixMatch{} : MatchPrefix(request.prompt_token_ids);
    int64_t new_blocks = 0;
    for (int64_t g = 0; g < num_groups(); ++g) {
        const int64_t skipped = std::max(m.num_blocks, NumAdmissionReleased(g, m, request));
        new_blocks += CeilDiv(len, config_.block_size) - skipped;
    }
    const int64_t available_after = num_available_blocks() - m.num_cached_unreferenced - new_blocks;
    const int64_t own_next_decode = len % config_.block_size == 0 ? num_groups() : 0;
    const int64_t reserve = watermark_blocks_ + NumBlocksForNextDecode() + own_next_decode;
    return available_after >= reserve;
}

int64_t BlockManager::Allocate(const SequenceRequest& request) {
    KV_CHECK(CanAllocate(request))
        << "seq " << request.seq_id << ", " << request.prompt_token_ids.size() << " tokens, "
        << num_available_blocks() << " blocks available";
    const PrefixMatch m =
        request.skip_prefix_cache ? PrefixMatch{} : MatchPrefix(request.prompt_token_ids);
    const int64_t bs = config_.block_size;
    const auto len = static_cast<int64_t>(request.prompt_token_ids.size());
    const int64_t num_blocks = CeilDiv(len, bs);
    const int64_t hit = m.num_blocks;

    Sequence s;
    s.token_ids.assign(request.prompt_token_ids.begin(), request.prompt_token_ids.end());
    s.num_cached_tokens = hit * bs;
    s.num_computed = s.num_cached_tokens;
    s.groups.resize(static_cast<size_t>(num_groups()));
    // Take the hits of every group first: once referenced they cannot be evicted by TakeBlock.
    for (int64_t g = 0; g < num_groups() && hit > 0; ++g) {
        GroupTable& t = s.groups[static_cast<size_t>(g)];
        const GroupMatch& gm = m.groups[static_cast<size_t>(g)];
        t.blocks.reserve(static_cast<size_t>(num_blocks));
        t.num_released = NumAdmissionReleased(g, m, request);
        for (int64_t i = 0; i < hit; ++i) {
            const BlockId b = i < t.num_released ? kNoBlock : gm.blocks[static_cast<size_t>(i)];
            if (b != kNoBlock) AddRef(b);
            t.blocks.push_back(b);
        }
        t.chain_hashes = gm.hashes;
        t.chain_content_ids = gm.content_ids;
    }
    for (int64_t g = 0; g < num_groups(); ++g) {
        GroupTable& t = s.groups[static_cast<size_t>(g)];
        t.num_released = NumAdmissionReleased(g, m, request);
        for (int64_t i = hit; i < num_blocks; ++i) {
            if (i < t.num_released) {
                t.blocks.push_back(kNoBlock);  // arriving KV no query of the window reads
                continue;
            }
            const BlockId b = TakeBlock();
            const int64_t tokens_in_block = std::min(bs, len - i * bs);
            block_num_tokens_[b] = static_cast<int32_t>(tokens_in_block);
            stored_tokens_ += tokens_in_block;
            t.blocks.push_back(b);
        }
    }
    if (config_.enable_prefix_caching) {
        prompt_tokens_ += len;
        prompt_tokens_from_cache_ += s.num_cached_tokens;
        // A read of a pinned prefix: the pins it covers whole start their TTL again.
        bool read_pinned = false;
        for (int64_t i = 0; i < hit; ++i) {
            read_pinned =
                read_pinned || pin_counts_[m.groups[0].blocks[static_cast<size_t>(i)]] > 0;
            auto pin = pins_.find(m.groups[0].content_ids[static_cast<size_t>(i)]);
            if (pin != pins_.end()) TouchPin(pin->first, pin->second.ttl);
        }
        if (read_pinned) ++pin_hits_;
    }
    const int64_t cached = s.num_cached_tokens;
    seqs_.emplace(request.seq_id, std::move(s));
    return cached;
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

// ---- Decode ----

int64_t BlockManager::NumNewBlocksToAppend(const Sequence& s, int64_t num_tokens) const {
    if (num_tokens == 0) return 0;
    const int64_t bs = config_.block_size;
    const auto cur = static_cast<int64_t>(s.token_ids.size());
    const int64_t per_group =
        CeilDiv(cur + num_tokens, bs) - static_cast<int64_t>(s.groups[0].blocks.size());
    int64_t n = per_group * num_groups();
    if (cur % bs != 0) {
        // Copy-on-write. A partial last block is never out of a window (it holds position
        // cur - 1, which the next query at cur reads).
        for (const GroupTable& t : s.groups) n += ref_counts_[t.blocks.back()] > 1 ? 1 : 0;
    }
    return n;
}

bool BlockManager::CanAppend(SeqId seq, int64_t num_tokens) const {
    KV_CHECK_GE(num_tokens, 0);
    return NumNewBlocksToAppend(Get(seq), num_tokens) <= num_available_blocks();
}

AppendResult BlockManager::AppendSlots(SeqId seq, std::span<const int32_t> token_ids) {
    Sequence& s = Get(seq);
    const auto n = static_cast<int64_t>(token_ids.size());
    KV_CHECK(NumNewBlocksToAppend(s, n) <= num_available_blocks())
        << "seq " << seq << " appends " << n << " tokens, " << num_available_blocks()
        << " blocks available";
    const int64_t bs = config_.block_size;
    AppendResult r;
    if (n == 0) return r;
    if (static_cast<int64_t>(s.token_ids.size()) % bs != 0) {
        for (size_t g = 0; g < s.groups.size(); ++g) {
            GroupTable& t = s.groups[g];
            if (ref_counts_[t.blocks.back()] <= 1) continue;
            const BlockId shared = t.blocks.back();
            const BlockId copy = TakeBlock();
            block_num_tokens_[copy] = block_num_tokens_[shared];
            stored_tokens_ += block_num_tokens_[copy];
            DropRef(shared);  // still referenced by the other side of the fork
            t.blocks.back() = copy;
            if (g == 0) {
                r.copy = CopyOp{shared, copy};
            } else {
                r.group_copies.push_back(CopyOp{shared, copy});
            }
        }
    }
    r.slots.reserve(static_cast<size_t>(n));
    for (int32_t token : token_ids) {
        const auto pos = static_cast<int64_t>(s.token_ids.size());
        for (size_t g = 0; g < s.groups.size(); ++g) {
            GroupTable& t = s.groups[g];
            if (pos % bs == 0) t.blocks.push_back(TakeBlock());
            const BlockId b = t.blocks[static_cast<size_t>(pos / bs)];
            ++block_num_tokens_[b];
            ++stored_tokens_;
            if (g == 0) r.slots.push_back(static_cast<int64_t>(b) * bs + pos % bs);
        }
        s.token_ids.push_back(token);
    }
    return r;
}

AppendResult BlockManager::AppendSlot(SeqId seq, int32_t token_id) {
    return AppendSlots(seq, std::span<const int32_t>(&token_id, 1));
}

int64_t BlockManager::NumBlocksForNextDecode() const {
    int64_t n = 0;
    for (const auto& [id, s] : seqs_) n += NumNewBlocksToAppend(s, 1);
    return n;
}

bool BlockManager::NeedsPreemption() const {
    return NumBlocksForNextDecode() > num_available_blocks();
}

// ---- Forks and prefix caching ----

void BlockManager::Fork(SeqId parent, SeqId child) {
    KV_CHECK(!seqs_.contains(child)) << "seq " << child << " exists";
    Sequence copy = Get(parent);
    for (const GroupTable& t : copy.groups) {
        for (BlockId b : t.blocks) {
            if (b != kNoBlock) AddRef(b);
        }
    }
    seqs_.emplace(child, std::move(copy));
}

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

void BlockManager::Free(SeqId seq) {
    Sequence& s = Get(seq);
    // The anchor last, each table last block first: the anchor's first blocks are evicted last.
    for (auto t = s.groups.rbegin(); t != s.groups.rend(); ++t) {
        for (auto it = t->blocks.rbegin(); it != t->blocks.rend(); ++it) {
            if (*it != kNoBlock) DropRef(*it);
        }
    }
    seqs_.erase(seq);
}

// ---- Blocks ----

BlockId BlockManager::TakeBlock() {
    BlockId b;
    if (!free_list_.empty()) {
        b = free_list_.back();
        free_list_.pop_back();
        in_free_list_[b] = 0;
    } else {
        KV_CHECK_GT(cache_.num_evictable(), 0) << "out of blocks";
        b = cache_.EvictLru();
        ++num_evictions_;
        LogUncached(b);
    }
    block_num_tokens_[b] = 0;
    AddRef(b);
    return b;
}

void BlockManager::AddRef(BlockId b) {
    if (ref_counts_[b] == 0) {
        if (cache_.IsEvictable(b)) cache_.Acquire(b);
        if (pin_counts_[b] > 0) --num_pinned_idle_blocks_;
        KV_CHECK(!in_free_list_[b]) << "block " << b;
        ++num_used_blocks_;
        stored_tokens_ += block_num_tokens_[b];
    }
    ++ref_counts_[b];
}

void BlockManager::DropRef(BlockId b) {
    KV_CHECK_GT(ref_counts_[b], 0) << "block " << b;
    if (--ref_counts_[b] > 0) return;
    --num_used_blocks_;
    stored_tokens_ -= block_num_tokens_[b];
    if (pin_counts_[b] > 0) {
        ++num_pinned_idle_blocks_;  // stays out of the LRU list while pinned
    } else if (cache_.IsCached(b)) {
        cache_.Release(b);
    } else {
        block_num_tokens_[b] = 0;
        free_list_.push_back(b);
        in_free_list_[b] = 1;
    }
}

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

// ---- Queries ----

const BlockManager::Sequence& BlockManager::Get(SeqId seq) const {
    auto it = seqs_.find(seq);
    KV_CHECK(it != seqs_.end()) << "unknown seq " << seq;
    return it->second;
}

BlockManager::Sequence& BlockManager::Get(SeqId seq) {
    auto it = seqs_.find(seq);
    KV_CHECK(it != seqs_.end()) << "unknown seq " << seq;
    return it->second;
}

int64_t BlockManager::NumTokens(SeqId seq) const {
    return static_cast<int64_t>(Get(seq).token_ids.size());
}

int64_t BlockManager::NumCachedTokens(SeqId seq) const { return Get(seq).num_cached_tokens; }

std::span<const BlockId> BlockManager::BlockTable(SeqId seq, int64_t group) const {
    KV_CHECK(group >= 0 && group < num_groups()) << "group " << group;
    return Get(seq).groups[static_cast<size_t>(group)].blocks;
}

std::span<const int32_t> BlockManager::TokenIds(SeqId seq) const { return Get(seq).token_ids; }

int64_t BlockManager::Slot(SeqId seq, int64_t position, int64_t group) const {
    const Sequence& s = Get(seq);
    KV_CHECK(position >= 0 && position < static_cast<int64_t>(s.token_ids.size()))
        << "seq " << seq << " position " << position;
    const int64_t bs = config_.block_size;
    const BlockId b = BlockTable(seq, group)[static_cast<size_t>(position / bs)];
    KV_CHECK_NE(b, kNoBlock) << "seq " << seq << " position " << position << " of group " << group
                             << " is out of its window";
    return static_cast<int64_t>(b) * bs + position % bs;
}

std::vector<int64_t> BlockManager::SlotMapping(SeqId seq, int64_t begin, int64_t end,
                                               int64_t group) const {
    KV_CHECK(0 <= begin && begin <= end && end <= NumTokens(seq))
        << "seq " << seq << " [" << begin << ", " << end << ")";
    std::vector<int64_t> slots;
    slots.reserve(static_cast<size_t>(end - begin));
    for (int64_t p = begin; p < end; ++p) slots.push_back(Slot(seq, p, group));
    return slots;
}

int64_t BlockManager::NumHeldBlocks(SeqId seq) const {
    int64_t n = 0;
    for (const GroupTable& t : Get(seq).groups)
        n += static_cast<int64_t>(t.blocks.size()) - t.num_released;
    return n;
}

int64_t BlockManager::NumReleasedBlocks(SeqId seq, int64_t group) const {
    KV_CHECK(group >= 0 && group < num_groups()) << "group " << group;
    return Get(seq).groups[static_cast<size_t>(group)].num_released;
}

int64_t BlockManager::num_available_blocks() const {
    return static_cast<int64_t>(free_list_.size()) + cache_.num_evictable();
}

BlockManagerStats BlockManager::Stats() const {
    BlockManagerStats st;
    st.num_blocks = config_.num_blocks;
    st.num_used_blocks = num_used_blocks_;
    st.num_cached_blocks = cache_.num_evictable();
    st.num_free_blocks = static_cast<int64_t>(free_list_.size());
    st.num_published_blocks = cache_.num_cached();
    st.num_sequences = static_cast<int64_t>(seqs_.size());
    st.stored_tokens = stored_tokens_;
    st.allocated_slots = num_used_blocks_ * config_.block_size;
    st.utilization = st.allocated_slots == 0 ? 1.0
                                             : static_cast<double>(st.stored_tokens) /
                                                   static_cast<double>(st.allocated_slots);
    st.prompt_tokens = prompt_tokens_;
    st.prompt_tokens_from_cache = prompt_tokens_from_cache_;
    st.hit_rate = prompt_tokens_ == 0 ? 0.0
                                      : static_cast<double>(prompt_tokens_from_cache_) /
                                            static_cast<double>(prompt_tokens_);
    st.num_evictions = num_evictions_;
    st.num_pinned_blocks = num_pinned_blocks_;
    st.num_pinned_idle_blocks = num_pinned_idle_blocks_;
    st.num_pins = static_cast<int64_t>(pins_.size());
    st.pin_hits = pin_hits_;
    st.pins_expired = pins_expired_;
    st.pins_refused = pins_refused_;
    st.num_window_released = num_window_released_;
    return st;
}

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
