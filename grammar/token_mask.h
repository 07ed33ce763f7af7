// The token mask of constrained decoding: which token ids keep a GrammarState alive.
//
// A Vocabulary holds every token's bytes (what it adds to the decoded text: byte-level BPE
// symbols and SentencePiece "▁" / "<0x41>" pieces already mapped back, model/tokenizer.h
// TokenBytes) in a byte trie laid out in preorder, so that the mask walk steps each shared
// prefix once and skips a whole subtree as soon as its prefix is refused. Tokens with no bytes
// (control tokens) are never allowed by the grammar; the vocabulary's end tokens (EOS and the
// like) are allowed exactly when the grammar may end.
//
// Thread-safety: a Vocabulary is immutable and shared; a Constraint belongs to one thread.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <string>
#include <vector>

#include "grammar/grammar.h"

namespace kvshard::grammar {

// Bit i of word i / 64 set: token i allowed. (vocab + 63) / 64 words.
using TokenMask = std::vector<uint64_t>;

inline bool MaskHas(const TokenMask& mask, int32_t id) {
    return (mask[static_cast<size_t>(id) >> 6] >> (id & 63)) & 1;
}

class Vocabulary {
  public:
    // token_bytes[id] for every id; end_ids: the tokens that end generation.
    Vocabulary(std::vector<std::string> token_bytes, std::vector<int32_t> end_ids);

    int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
    const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
    const std::vector<int32_t>& end_ids() const { return end_ids_; }
    bool IsEnd(int32_t id) const;
    size_t num_trie_nodes() const { return nodes_.size(); }

    // Writes the mask of `state` into *out (resized to the vocabulary): the union, over the
    // state's parse stacks, of the tokens each stack's top accepts whatever lies below it
    // (TopMasksFor, cached), and of those that reach below and are checked against the state.
    void ComputeMask(const GrammarState& state, TokenMask* out) const;
    // The same by walking the whole trie with the state (the reference for tests).
    void ComputeMaskByWalk(const GrammarState& state, TokenMask* out) const;

    // For the top of a parse stack and the kStackContext nodes below it (their symbol
    // positions, top first; `complete`: that is the whole stack): the tokens accepted whatever
    // lies further below, and the tokens that may be accepted depending on it (their text
    // completes those frames and goes on).
    static constexpr size_t kStackContext = 4;
    struct TopMasks {
        TokenMask accepted;
        std::vector<int32_t> uncertain;
    };
    std::shared_ptr<const TopMasks> TopMasksFor(const Grammar& grammar,
                                                const std::vector<uint32_t>& positions,
                                                bool complete) const;
    // The same, through a cache shared by every sequence over this vocabulary, keyed by the
    // grammar's id and the state's signature: requests with one schema (compiled once, see
    // coordinator/structured_output.h) reuse each other's masks. Any thread.
    void CachedMask(const GrammarState& state, const std::vector<uint32_t>& signature,
                    TokenMask* out) const;

  private:
    struct Node {
        uint8_t byte = 0;
        uint16_t depth = 0;         // 1 for a first byte
        uint32_t subtree_end = 0;   // index after this node's subtree
        uint32_t tok_begin = 0;     // tokens whose bytes end here: sorted_ids_[tok_begin, tok_end)
        uint32_t tok_end = 0;
    };
    std::vector<std::string> bytes_;
    std::vector<int32_t> end_ids_;  // sorted
    std::vector<Node> nodes_;
    std::vector<int32_t> sorted_ids_;
    size_t max_depth_ = 0;

    // Visits in preorder the trie nodes reached from the stacks `tops` of `arena` (both used as
    // scratch), first bytes limited to `first`: fn(node, alive, left) is told, after the node's
    // byte, whether a parse is still alive and whether one left the starting frame
    // (StackNode::kOutside), and returns whether to descend into the node.
    template <typename Fn>
    void Walk(const Grammar& g, std::vector<StackNode>& arena, std::vector<uint32_t>& tops,
              const ByteSet& first, Fn&& fn) const;

    static constexpr size_t kMaxSharedMasks = 512;
    static constexpr size_t kMaxTopMasks = 1024;
    mutable std::unordered_map<std::string, std::shared_ptr<const TopMasks>> top_masks_;
    mutable std::deque<std::string> top_masks_order_;
    mutable std::mutex cache_mu_;
    mutable std::unordered_map<std::string, TokenMask> cache_;  // guarded by cache_mu_
    mutable std::deque<std::string> cache_order_;                // oldest first
};

// One constrained sequence: its grammar state and a cache of the masks of states already seen
// (inside a JSON string every character leaves the state the same, so most steps hit).
class Constraint {
  public:
    Constraint(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const Vocabulary> vocab);

    // The allowed tokens now.
    const TokenMask& Mask();
    // True when at least one token is allowed now.
    bool AnyAllowed();
    // Consumes a sampled token (an end token is consumed without bytes). False, and the state
    // unchanged, when the grammar refuses it.
    bool Accept(int32_t token_id);
    const GrammarState& state() const { return state_; }

  private:
    struct Entry {
        std::vector<uint32_t> signature;
        TokenMask mask;
    };
    static constexpr size_t kMaxCachedMasks = 32;

    GrammarState state_;
    std::shared_ptr<const Vocabulary> vocab_;
    std::vector<Entry> cache_;
    int current_ = -1;  // cache_ index of the mask of state_, -1 when not computed
};

}  // namespace kvshard::grammar
