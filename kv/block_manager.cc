#include "kv/block_manager.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "common/check.h"

namespace kvshard::kv {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// ---- Forks and frees ----

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

}  // namespace kvshard::kv
