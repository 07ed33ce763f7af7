// BlockManager: the logical paged KV cache of one instance. It hands out integer block ids, keeps a
// block table per sequence, maps new tokens to slots (slot = block_id * block_size + offset),
// shares blocks between forks (copy-on-write of the last partial block) and between sequences with
// a common prompt prefix (PrefixCache). It never touches device memory: the worker's KV pool holds
// the bytes, and the ids and copy ops this class returns travel in the StepPlan.
//
// A block is in exactly one of four states:
//   used    referenced by at least one sequence (ref count > 0);
//   pinned  unreferenced, published in the prefix cache and covered by a pin (not evictable);
//   cached  unreferenced, but its full block of tokens is in the prefix cache (evictable, LRU);
//   free    unreferenced and holding nothing worth keeping.
// free + used + pinned + cached == num_blocks at all times. A block is taken from the free list
// first, and only when that is empty is the least recently released cached block evicted.
//
// Pins (prompt caching, docs/prompt-caching.md): Pin(seq, prefix_tokens, ttl) keeps the published
// full blocks of a sequence's first prefix_tokens tokens out of LRU eviction until ttl after the
// last write (Pin) or read (an Allocate whose prefix hit covers the pin). Time is what SetTime was
// last given (the engine's clock); SetTime lets pins past their TTL lapse: their blocks go back to
// the LRU list, most recently released, still cached. The blocks covered by pins (referenced or
// not) never exceed max_pinned_fraction of the pool: a new pin past it makes the least recently
// used pins lapse first, and a pin longer than the whole share is refused. Prefixes shorter than
// min_pinned_tokens are not pinned.
//
// The calls: query, then commit (the query is const; the commit REQUIRES that the query said yes):
//   CanAllocate(request)  -> Allocate(request)       admit a prompt; returns tokens served from
//   cache CanAppend(seq, n)     -> AppendSlots(seq, ids)   slots for the next n tokens (+ a CoW
//   copy op) Fork(parent, child)                              the child shares every block of the
//   parent MarkComputed(seq, n)                             the first n tokens' KV exist: publish
//   full blocks Free(seq)                                        drop the sequence; keep its
//   published blocks cached
//
// Reservation and preemption: CanAllocate admits a prompt only if, after it, the blocks that stay
// available (free + cached) cover a watermark (a fraction of all blocks) plus one block for every
// running sequence (the new one included) whose next decode token needs a new block. So right after
// admission every running sequence can take its next decode slot. When sequences grow over later
// steps and CanAppend(seq, 1) is false for some running sequence, NeedsPreemption() is true: the
// scheduler must free (preempt by recompute) a sequence before that one can continue.
//
// KV cache groups (sliding-window KV; vLLM's hybrid KV cache manager is the model): the layers of
// a model are split into groups of equal size (kv/kv_cache_groups.h), each with an attention
// window (0: full attention). A block id names `block_size` slots of one group's layers, so every
// block of the pool fits every group, and all groups draw from the one free list and the one LRU
// list. Each sequence keeps one block table per group, all as long as the sequence. A windowed
// group's query at position p reads positions p - window + 1 .. p only: once every position a
// future query of the sequence may sit at (from the first not yet computed, MarkComputed) is past
// a block's last position + window - 1, the group's table entry becomes kNoBlock and the block
// loses the sequence's reference (it turns cached, evictable, when published, else free). The
// attention kernels never read such an entry: they start each query's walk at its window.
// Prefix caching per group: group 0 is the anchor (a full-attention group when the model has
// one); its chain must be cached whole for a hit, as without groups. Any other group's block is
// cached under its own hash chain (GroupRootHash) with the anchor's block before it as parent, so
// a hit of h blocks needs, in a full group, all h blocks, and in a windowed group only the blocks
// its window still reads from position h * block_size on; the others stay kNoBlock. Without
// groups (group_windows empty) there is one full-attention group: everything is as it always was.
//
// Thread-safety: none. Owned by one instance's engine thread (DESIGN.md "Threads").
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/kv_types.h"
#include "common/status.h"
#include "config/engine_config.h"
#include "kv/prefix_cache.h"

namespace kvshard::kv {

// The block manager's settings are the config module's (config/engine_config.h): the file's
// kv_cache: section is this type, so a new setting is added there once.
using ::kvshard::BlockManagerConfig;

// A prompt to admit. The token ids are copied by Allocate; the span need not outlive the call.
struct SequenceRequest {
    SeqId seq_id = 0;
    std::span<const int32_t> prompt_token_ids;
    // Compute the whole prompt even where the prefix cache holds it (prompt logprobs need every
    // position's logits); its full blocks are still published as they are computed.
    bool skip_prefix_cache = false;
    // Positions [0, incoming_tokens) are computed elsewhere and their KV arrives (a disaggregated
    // handoff): a windowed group takes no block that no query at position incoming_tokens or
    // later reads (its entry is kNoBlock from the start, as if released). Such entries are never
    // published, so the group's prefix chain stops there (a lost hit, never a wrong one).
    int64_t incoming_tokens = 0;
};

// The slots of appended tokens, in order, and the copy the worker must execute before it writes
// them (present when the sequence's last partial block was shared with a fork).
struct AppendResult {
    std::vector<int64_t> slots;        // group 0's (SlotMapping(seq, begin, end, g) for the others)
    std::optional<CopyOp> copy;        // group 0's
    std::vector<CopyOp> group_copies;  // the other groups' copies, in group order
};

struct BlockManagerStats {
    int64_t num_blocks = 0;
    int64_t num_used_blocks = 0;    // referenced by a sequence
    int64_t num_cached_blocks = 0;  // unreferenced, in the prefix cache (evictable)
    int64_t num_free_blocks = 0;
    int64_t num_published_blocks = 0;  // in the prefix cache, referenced or not
    int64_t num_sequences = 0;
    // Utilization of the allocated KV: tokens held in used blocks (a block shared by forks or
    // prefix hits counts once) over their slots (num_used_blocks * block_size).
    int64_t stored_tokens = 0;
    int64_t allocated_slots = 0;
    double utilization = 0.0;  // stored_tokens / allocated_slots; 1.0 when nothing is allocated
    // Prefix cache, over all Allocate calls with caching enabled.
    int64_t prompt_tokens = 0;
    int64_t prompt_tokens_from_cache = 0;
    double hit_rate = 0.0;  // prompt_tokens_from_cache / prompt_tokens
    int64_t num_evictions = 0;
    // Pins.
    int64_t num_pinned_blocks = 0;       // covered by a pin, referenced or not
    int64_t num_pinned_idle_blocks = 0;  // covered by a pin and unreferenced (state "pinned")
    int64_t num_pins = 0;
    int64_t pin_hits = 0;      // Allocate calls whose prefix hit read a pinned block
    int64_t pins_expired = 0;  // pins that lapsed at their TTL
    int64_t pins_refused = 0;  // pins not made, or lapsed before their TTL, for lack of room
    // Windows: table entries released because no future query of their group reads them.
    int64_t num_window_released = 0;
};

// What Pin did: the prompt tokens now covered by the pin (a multiple of block_size; 0 when no pin
// was made), and why not when none was.
struct PinResult {
    enum class Outcome { kPinned, kRefreshed, kTooShort, kNothingCached, kNoRoom, kDisabled };
    Outcome outcome = Outcome::kDisabled;
    int64_t pinned_tokens = 0;
};

class BlockManager {
  public:
    // REQUIRES: config.Validate().ok(). Use Create to validate.
    explicit BlockManager(const BlockManagerConfig& config);
    static Result<BlockManager> Create(const BlockManagerConfig& config);

    // ---- Admission ----

    // Whether Allocate(request) would succeed now and leave the reservation described above.
    // Prefix-cache hits are counted: a hit on a referenced block costs nothing, a hit on a cached
    // block takes it out of the available blocks. False for an empty prompt or a known seq_id.
    bool CanAllocate(const SequenceRequest& request) const;
    // Gives the sequence blocks for its whole prompt, reusing the longest run of cached full blocks
    // that match the prompt from its start, and returns the number of prompt tokens served from
    // the cache (a multiple of block_size, at most prompt length - 1 so that at least one token
    // is computed to produce logits). The caller computes the KV of the remaining tokens at
    // SlotMapping(seq, cached, prompt length). REQUIRES: CanAllocate(request).
    int64_t Allocate(const SequenceRequest& request);
    // The number of tokens of `token_ids` Allocate would serve from the cache now (the router asks
    // this of each instance). Allocates nothing.
    int64_t CachedPrefixTokens(std::span<const int32_t> token_ids) const;
    // The tokens of `token_ids` that a prefix hit would read from pinned blocks now (the router
    // prefers the instance holding a request's pins). Allocates nothing.
    int64_t PinnedPrefixTokens(std::span<const int32_t> token_ids) const;

    // ---- Decode ----

    // Whether `num_tokens` more tokens (0 or more) fit: new blocks past the end of the table, plus
    // one block if the last partial block is shared and must be copied. Ignores the watermark.
    // REQUIRES: HasSequence(seq).
    bool CanAppend(SeqId seq, int64_t num_tokens) const;
    // Appends `token_ids` (the tokens whose KV the next step computes, e.g. the token sampled by
    // the last step) and returns their slots. If the last block is partial and shared with a fork,
    // it is first replaced by a private copy, returned as the copy op. REQUIRES: CanAppend(seq,
    // size).
    AppendResult AppendSlots(SeqId seq, std::span<const int32_t> token_ids);
    AppendResult AppendSlot(SeqId seq, int32_t token_id);

    // Blocks that the next decode step needs if every sequence appends one token (an upper bound:
    // forks that share a partial block each count one copy).
    int64_t NumBlocksForNextDecode() const;
    // True when the running sequences cannot all take their next decode slot: the scheduler must
    // preempt (free) sequences until this is false. Checking CanAppend(seq, 1) per sequence, in
    // priority order, tells which ones can go on.
    bool NeedsPreemption() const;

    // ---- Forks and prefix caching ----

    // `child` gets the same block table, tokens and cached-token count as `parent`; every block's
    // reference count grows by one. Nothing is copied now: the first of the two to append into a
    // shared partial block gets a copy (AppendResult::copy). REQUIRES: HasSequence(parent),
    // !HasSequence(child).
    void Fork(SeqId parent, SeqId child);
    // Declares that the KV of the first `num_computed_tokens` tokens of `seq` is written, so its
    // full blocks may be served to other sequences: each is published in the prefix cache, unless
    // an equal block (same tokens, same prefix) is already there (prefix caching on). Then, in
    // every windowed group, the blocks that no query at position num_computed_tokens or later
    // reads are released (their entries become kNoBlock). Call it after the step that computed
    // those tokens (its queries read the blocks released here). With one full-attention group and
    // prefix caching off, a no-op.
    // REQUIRES: HasSequence(seq), num_computed_tokens <= NumTokens(seq).
    void MarkComputed(SeqId seq, int64_t num_computed_tokens);

    // Drops `seq`: each block loses a reference; a block left unreferenced becomes cached (if
    // published) or free. Blocks are released last block first, so a prompt's first blocks, the
    // ones other prompts most likely share, are evicted last. REQUIRES: HasSequence(seq).
    void Free(SeqId seq);

    // Forgets every cached block that no sequence references (they become free) and returns how
    // many. For when the KV those blocks held is gone, e.g. the workers were restarted with
    // empty pools. Referenced blocks, and the cache entries of referenced blocks, stay.
    // Pins are dropped first (their KV is gone too), without counting as expired or refused.
    int64_t DropCachedBlocks();

    // ---- Pins ----

    // Moves the manager's time to `now` (never back) and lets every pin whose TTL has passed
    // lapse. Returns how many lapsed.
    int64_t SetTime(Clock::time_point now);
    Clock::time_point now() const { return now_; }
    // Pins the published full blocks of the first `prefix_tokens` tokens of `seq` (a block whose
    // KV was computed twice pins the published twin; the pin stops where the published chain
    // does) until `ttl` after now, or refreshes the pin of that same prefix. Makes room by letting
    // the least recently used other pins lapse (counted as refused); refused when the prefix alone
    // exceeds the pinned share. REQUIRES: HasSequence(seq), ttl > 0.
    PinResult Pin(SeqId seq, int64_t prefix_tokens, Clock::duration ttl);
    // Lets the least recently used pin lapse (counted as refused): when the pinned blocks are all
    // that keep work from running (nothing else would ever free a block). False when none.
    bool LapseOldestPin();
    int64_t max_pinned_blocks() const { return max_pinned_blocks_; }
    int64_t num_pinned_blocks() const { return num_pinned_blocks_; }
    int64_t num_pins() const { return static_cast<int64_t>(pins_.size()); }
    int64_t PinCount(BlockId block) const { return pin_counts_[block]; }

    // ---- Queries ----

    bool HasSequence(SeqId seq) const { return seqs_.contains(seq); }
    // REQUIRES: HasSequence(seq) for all of these.
    int64_t NumTokens(SeqId seq) const;
    // Prompt tokens served from the cache at Allocate (usage.prompt_tokens_details.cached_tokens).
    int64_t NumCachedTokens(SeqId seq) const;
    // Group `group`'s table: entry i holds positions [i * block_size, (i + 1) * block_size), or
    // is kNoBlock when the group's window no longer reads them. REQUIRES: 0 <= group <
    // num_groups().
    std::span<const BlockId> BlockTable(SeqId seq, int64_t group = 0) const;
    std::span<const int32_t> TokenIds(SeqId seq) const;
    // The slot of token `position` in group `group`. REQUIRES: 0 <= position < NumTokens(seq),
    // and its block held (not released by the window).
    int64_t Slot(SeqId seq, int64_t position, int64_t group = 0) const;
    // Slots of positions [begin, end). REQUIRES: 0 <= begin <= end <= NumTokens(seq), all held.
    std::vector<int64_t> SlotMapping(SeqId seq, int64_t begin, int64_t end,
                                     int64_t group = 0) const;
    // Blocks the sequence references now, over all groups (entries that are not kNoBlock; a block
    // shared with a fork or a prefix hit counts for each sequence).
    int64_t NumHeldBlocks(SeqId seq) const;
    // Leading entries of group `group`'s table released by its window.
    int64_t NumReleasedBlocks(SeqId seq, int64_t group) const;

    int64_t num_groups() const { return static_cast<int64_t>(windows_.size()); }
    // Group `group`'s window in tokens, 0 for full attention.
    int64_t group_window(int64_t group) const { return windows_[static_cast<size_t>(group)]; }

    int64_t RefCount(BlockId block) const { return ref_counts_[block]; }
    const PrefixCache& prefix_cache() const { return cache_; }
    const BlockManagerConfig& config() const { return config_; }
    int64_t block_size() const { return config_.block_size; }
    int64_t num_blocks() const { return config_.num_blocks; }
    int64_t watermark_blocks() const { return watermark_blocks_; }
    // Blocks a new allocation may take: free plus cached (evictable).
    int64_t num_available_blocks() const;
    BlockManagerStats Stats() const;
    // The blocks that left the prefix cache (evicted or dropped) since the last call, ids possibly
    // repeated, and clears the log; nullopt when more than num_blocks did (the log stops there, so
    // it is bounded: compare every block instead). For the engine's prefix index (EngineSnapshot).
    std::optional<std::vector<BlockId>> TakeUncachedBlocks();

    // Recomputes every count from the block tables and compares: reference counts, the three
    // states, the free list, the LRU list, stored tokens, published chains. Internal error naming
    // the first mismatch. O(blocks + tokens): for tests and debug builds.
    Status CheckInvariants() const;

  private:
    // One group's view of a sequence.
    struct GroupTable {
        std::vector<BlockId> blocks;  // kNoBlock for the first num_released entries
        int64_t num_released = 0;
        // The leading full blocks already matched to the prefix cache (MarkComputed or a hit):
        // chain hash and content id of each. A block whose equal twin was published first carries
        // the twin's content id, so the chain continues (if the twin is later evicted, blocks
        // published after it under that id become unreachable and age out: a lost hit, never a
        // wrong one). `chain_broken` stops the chain at a hash taken by different content (a
        // 64-bit collision): later blocks are not published. In a group other than 0 the content
        // id is 0 where a prefix hit found no block (released at admission, nothing published).
        std::vector<uint64_t> chain_hashes;
        std::vector<uint64_t> chain_content_ids;
        bool chain_broken = false;
    };

    struct Sequence {
        std::vector<int32_t> token_ids;
        int64_t num_cached_tokens = 0;
        int64_t num_computed = 0;        // the most MarkComputed (or a prefix hit) declared
        std::vector<GroupTable> groups;  // num_groups()
    };

    struct GroupMatch {
        std::vector<BlockId> blocks;  // kNoBlock where the window does not need the block
        std::vector<uint64_t> hashes;
        std::vector<uint64_t> content_ids;
    };
    struct PrefixMatch {
        int64_t num_blocks = 0;          // the hit, in blocks
        std::vector<GroupMatch> groups;  // num_groups(), each num_blocks long; empty: no hit
        int64_t num_referenced = 0;      // blocks of the hit the sequence references (not kNoBlock)
        int64_t num_cached_unreferenced = 0;  // ... of them, evictable blocks no one references
    };

    // Entries of a table of `group` released when future queries start at `num_computed`.
    int64_t NumReleasable(int64_t group, int64_t num_computed) const;
    // Entries of `group` a sequence admitted with prefix hit `m` starts without (its hit and
    // request.incoming_tokens count as computed).
    int64_t NumAdmissionReleased(int64_t group, const PrefixMatch& m,
                                 const SequenceRequest& request) const;
    // Releases the entries NumReleasable gives, oldest first.
    void ReleaseOutOfWindow(GroupTable& t, int64_t group, int64_t num_computed);
    // Publishes the full blocks of `group` below `full_blocks` (MarkComputed).
    void PublishGroup(Sequence& s, int64_t group, int64_t full_blocks, SeqId seq);
    // The published block of chain position i of `group` in `s` (its own or the twin published
    // first), or kNoBlock.
    BlockId PublishedBlock(const Sequence& s, int64_t group, int64_t i) const;

    // A pin: the blocks of one prefix (in order), keyed by the content id of its last block.
    struct PinState {
        std::vector<BlockId> blocks;
        Clock::duration ttl{};
        Clock::time_point expiry{};
        Clock::time_point last_used{};
    };
    using PinOrder = std::set<std::pair<Clock::time_point, uint64_t>>;  // (time, key)

    PrefixMatch MatchPrefix(std::span<const int32_t> token_ids) const;
    // The pin `key` is read or written now: its TTL starts again.
    void TouchPin(uint64_t key, Clock::duration ttl);
    // Removes pin `key`; its blocks no other pin covers become cached (evictable) if unreferenced.
    void Unpin(uint64_t key);
    void PinBlock(BlockId block);
    void UnpinBlock(BlockId block);
    int64_t NumNewBlocksToAppend(const Sequence& s, int64_t num_tokens) const;
    // Takes a block from the free list, else evicts the least recently released cached block.
    // REQUIRES: num_available_blocks() > 0.
    BlockId TakeBlock();
    void AddRef(BlockId block);
    void DropRef(BlockId block);
    const Sequence& Get(SeqId seq) const;
    Sequence& Get(SeqId seq);

    BlockManagerConfig config_;
    std::vector<int64_t> windows_;  // by group
    int64_t watermark_blocks_ = 0;
    std::vector<int32_t> ref_counts_;        // by block id
    std::vector<int32_t> block_num_tokens_;  // tokens written in each block (0..block_size)
    std::vector<BlockId> free_list_;         // unreferenced, uncached blocks (a stack)
    std::vector<char> in_free_list_;         // by block id, for invariant checks
    PrefixCache cache_;
    std::unordered_map<SeqId, Sequence> seqs_;
    int64_t num_used_blocks_ = 0;
    int64_t stored_tokens_ = 0;
    int64_t prompt_tokens_ = 0;
    int64_t prompt_tokens_from_cache_ = 0;
    int64_t num_evictions_ = 0;
    std::vector<BlockId> uncached_log_;  // see TakeUncachedBlocks
    bool uncached_log_full_ = false;
    void LogUncached(BlockId b);
    // Pins.
    int64_t max_pinned_blocks_ = 0;
    Clock::time_point now_{};
    std::vector<int32_t> pin_counts_;  // by block id: pins covering it
    std::unordered_map<uint64_t, PinState> pins_;
    PinOrder pins_by_expiry_;
    PinOrder pins_by_use_;
    int64_t num_pinned_blocks_ = 0;       // pin count > 0
    int64_t num_pinned_idle_blocks_ = 0;  // pin count > 0 and unreferenced
    int64_t pin_hits_ = 0;
    int64_t pins_expired_ = 0;
    int64_t pins_refused_ = 0;
    int64_t num_window_released_ = 0;
};

}  // namespace kvshard::kv
