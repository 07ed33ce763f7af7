#include "grammar/token_mask.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "common/check.h"

namespace kvshard::grammar {

Vocabulary::Vocabulary(std::vector<std::string> token_bytes, std::vector<int32_t> end_ids)
    : bytes_(std::move(token_bytes)), end_ids_(std::move(end_ids)) {
    std::sort(end_ids_.begin(), end_ids_.end());
    end_ids_.erase(std::unique(end_ids_.begin(), end_ids_.end()), end_ids_.end());
    for (int32_t id : end_ids_) KV_CHECK(id >= 0 && id < size()) << "end id " << id;
    for (size_t id = 0; id < bytes_.size(); ++id) {
        if (!bytes_[id].empty() && !IsEnd(static_cast<int32_t>(id)))
            sorted_ids_.push_back(static_cast<int32_t>(id));
    }
    std::sort(sorted_ids_.begin(), sorted_ids_.end(), [&](int32_t a, int32_t b) {
        return bytes_[a] < bytes_[b] || (bytes_[a] == bytes_[b] && a < b);
    });
    // Preorder trie: the path of open nodes is extended by each token in sorted order.
    std::vector<uint32_t> path;  // node index at each depth - 1
    const std::string* prev = nullptr;
    for (size_t k = 0; k < sorted_ids_.size(); ++k) {
        const std::string& b = bytes_[sorted_ids_[k]];
        KV_CHECK_LT(b.size(), size_t{UINT16_MAX});
        size_t common = 0;
        if (prev != nullptr) {
            while (common < prev->size() && common < b.size() && (*prev)[common] == b[common])
                ++common;
        }
        while (path.size() > common) {
            nodes_[path.back()].subtree_end = static_cast<uint32_t>(nodes_.size());
            path.pop_back();
        }
        for (size_t d = common; d < b.size(); ++d) {
            Node n;
            n.byte = static_cast<uint8_t>(b[d]);
            n.depth = static_cast<uint16_t>(d + 1);
            n.tok_begin = n.tok_end = static_cast<uint32_t>(k);
            path.push_back(static_cast<uint32_t>(nodes_.size()));
            nodes_.push_back(n);
        }
        Node& last = nodes_[path.back()];
        if (last.tok_begin == last.tok_end) last.tok_begin = static_cast<uint32_t>(k);
        last.tok_end = static_cast<uint32_t>(k + 1);
        max_depth_ = std::max(max_depth_, b.size());
        prev = &b;
    }
    while (!path.empty()) {
        nodes_[path.back()].subtree_end = static_cast<uint32_t>(nodes_.size());
        path.pop_back();
    }
}

bool Vocabulary::IsEnd(int32_t id) const {
    return std::binary_search(end_ids_.begin(), end_ids_.end(), id);
}

namespace {

void Allow(TokenMask* mask, int32_t id) {
    (*mask)[static_cast<size_t>(id) >> 6] |= uint64_t{1} << (id & 63);
}

}  // namespace

template <typename Fn>
void Vocabulary::Walk(const Grammar& g, std::vector<StackNode>& arena,
                      std::vector<uint32_t>& tops, const ByteSet& first, Fn&& fn) const {
    const Stepper stepper(g);
    // The stacks after each depth of the current path: tops[begin, end), arena[0, arena).
    std::vector<size_t> level_begin(max_depth_ + 1, 0), level_end(max_depth_ + 1, 0),
        level_arena(max_depth_ + 1, 0);
    level_end[0] = tops.size();
    level_arena[0] = arena.size();
    for (size_t i = 0; i < nodes_.size();) {
        const Node& n = nodes_[i];
        const size_t parent = n.depth - 1u;
        if (parent == 0 && !first.Has(n.byte)) {
            i = n.subtree_end;
            continue;
        }
        arena.resize(level_arena[parent]);
        tops.resize(level_end[parent]);
        bool can_end = false, left = false;
        const bool ok = stepper.Advance(arena, tops, level_begin[parent], level_end[parent],
                                        n.byte, &can_end, &left);
        const bool alive = ok && (tops.size() > level_end[parent] || can_end);
        if (!fn(n, alive, left)) {
            i = n.subtree_end;
            continue;
        }
        level_begin[n.depth] = level_end[parent];
        level_end[n.depth] = tops.size();
        level_arena[n.depth] = arena.size();
        ++i;
    }
}

void Vocabulary::ComputeMaskByWalk(const GrammarState& state, TokenMask* out) const {
    out->assign(static_cast<size_t>((size() + 63) / 64), 0);
    if (state.CanEnd()) {
        for (int32_t id : end_ids_) Allow(out, id);
    }
    if (state.Finished()) return;
    std::vector<StackNode> arena = state.arena();
    std::vector<uint32_t> tops = state.tops();
    Walk(state.grammar(), arena, tops, state.AllowedBytes(), [&](const Node& n, bool alive, bool) {
        if (!alive) return false;
        for (uint32_t k = n.tok_begin; k < n.tok_end; ++k) Allow(out, sorted_ids_[k]);
        return true;
    });
}

std::shared_ptr<const Vocabulary::TopMasks> Vocabulary::TopMasksFor(
    const Grammar& g, const std::vector<uint32_t>& positions, bool complete) const {
    std::string key(sizeof(uint64_t) + 1 + positions.size() * sizeof(uint32_t), '\0');
    const uint64_t id = g.id();
    std::memcpy(key.data(), &id, sizeof(id));
    key[sizeof(id)] = complete ? 1 : 0;
    std::memcpy(key.data() + sizeof(id) + 1, positions.data(), positions.size() * sizeof(uint32_t));
    {
        std::lock_guard<std::mutex> lock(cache_mu_);
        if (auto it = top_masks_.find(key); it != top_masks_.end()) return it->second;
    }
    auto m = std::make_shared<TopMasks>();
    m->accepted.assign(static_cast<size_t>((size() + 63) / 64), 0);
    // The stack, bottom first, on top of kOutside (or kNone when it is the whole stack).
    std::vector<StackNode> arena;
    for (size_t k = positions.size(); k-- > 0;) {
        const uint32_t below = arena.empty() ? (complete ? StackNode::kNone : StackNode::kOutside)
                                             : static_cast<uint32_t>(arena.size() - 1);
        arena.push_back({positions[k], below});
    }
    std::vector<uint32_t> tops = {static_cast<uint32_t>(arena.size() - 1)};
    // left_at[d]: a parse left the frame at depth <= d on the path to the current node.
    std::vector<uint8_t> left_at(max_depth_ + 1, 0);
    Walk(g, arena, tops, g.set(g.symbol(positions[0])), [&](const Node& n, bool alive, bool left) {
        if (alive || left) {
            // Alive inside the frames, or they just completed (and what lies below goes on).
            for (uint32_t k = n.tok_begin; k < n.tok_end; ++k) Allow(&m->accepted, sorted_ids_[k]);
        }
        const bool left_before = n.depth > 1 && left_at[n.depth - 1u] != 0;
        if (!alive) {
            // Dead inside the frames: the subtree is up to what lies below if a parse left them.
            if (left || left_before) {
                const uint32_t end = nodes_[n.subtree_end - 1].tok_end;
                const uint32_t from = left ? n.tok_end : n.tok_begin;
                for (uint32_t k = from; k < end; ++k) m->uncertain.push_back(sorted_ids_[k]);
            }
            return false;
        }
        left_at[n.depth] = (left || left_before) ? 1 : 0;
        return true;
    });
    // A token both accepted (a shorter path) and uncertain is simply accepted.
    std::erase_if(m->uncertain, [&](int32_t id) { return MaskHas(m->accepted, id); });
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto [it, inserted] = top_masks_.emplace(key, std::move(m));
    if (inserted) {
        top_masks_order_.push_back(key);
        if (top_masks_order_.size() > kMaxTopMasks) {
            top_masks_.erase(top_masks_order_.front());
            top_masks_order_.pop_front();
        }
    }
    return it->second;
}

void Vocabulary::ComputeMask(const GrammarState& state, TokenMask* out) const {
    out->assign(static_cast<size_t>((size() + 63) / 64), 0);
    if (state.CanEnd()) {
        for (int32_t id : end_ids_) Allow(out, id);
    }
    if (state.Finished()) return;
    const Grammar& g = state.grammar();
    std::vector<std::shared_ptr<const TopMasks>> parts;
    std::vector<std::vector<uint32_t>> seen;
    for (uint32_t t : state.tops()) {
        std::vector<uint32_t> positions;
        uint32_t n = t;
        for (; n != StackNode::kNone && positions.size() <= kStackContext; n = state.arena()[n].next)
            positions.push_back(state.arena()[n].pos);
        const bool complete = n == StackNode::kNone;
        positions.push_back(complete ? 1 : 0);  // part of what makes two stacks alike
        if (std::find(seen.begin(), seen.end(), positions) != seen.end()) continue;
        seen.push_back(positions);
        positions.pop_back();
        parts.push_back(TopMasksFor(g, positions, complete));
        const TokenMask& a = parts.back()->accepted;
        for (size_t w = 0; w < out->size(); ++w) (*out)[w] |= a[w];
    }
    // The uncertain tokens, each checked against the whole state.
    const Stepper stepper(g);
    thread_local std::vector<StackNode> arena;
    thread_local std::vector<uint32_t> tops;
    arena = state.arena();
    tops = state.tops();
    const size_t base_arena = arena.size(), base_tops = tops.size();
    for (const auto& part : parts) {
        for (int32_t id : part->uncertain) {
            if (MaskHas(*out, id)) continue;
            const std::string& b = bytes_[static_cast<size_t>(id)];
            size_t begin = 0, end = base_tops;
            bool alive = true, can_end = false;
            for (char c : b) {
                can_end = false;
                const size_t next_begin = tops.size();
                if (!stepper.Advance(arena, tops, begin, end, static_cast<uint8_t>(c), &can_end) ||
                    (tops.size() == next_begin && !can_end)) {
                    alive = false;
                    break;
                }
                begin = next_begin;
                end = tops.size();
            }
            if (alive) Allow(out, id);
            arena.resize(base_arena);
            tops.resize(base_tops);
        }
    }
}

void Vocabulary::CachedMask(const GrammarState& state, const std::vector<uint32_t>& signature,
                            TokenMask* out) const {
    std::string key(sizeof(uint64_t) + signature.size() * sizeof(uint32_t), '\0');
    const uint64_t id = state.grammar().id();
    std::memcpy(key.data(), &id, sizeof(id));
    if (!signature.empty()) {
        std::memcpy(key.data() + sizeof(id), signature.data(), signature.size() * sizeof(uint32_t));
    }
    {
        std::lock_guard<std::mutex> lock(cache_mu_);
        if (auto it = cache_.find(key); it != cache_.end()) {
            *out = it->second;
            return;
        }
    }
    ComputeMask(state, out);
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.emplace(key, *out).second) {
        cache_order_.push_back(std::move(key));
        if (cache_order_.size() > kMaxSharedMasks) {
            cache_.erase(cache_order_.front());
            cache_order_.pop_front();
        }
    }
}

Constraint::Constraint(std::shared_ptr<const Grammar> grammar,
                       std::shared_ptr<const Vocabulary> vocab)
    : state_(std::move(grammar)), vocab_(std::move(vocab)) {}

const TokenMask& Constraint::Mask() {
    if (current_ >= 0) return cache_[static_cast<size_t>(current_)].mask;
    std::vector<uint32_t> signature = state_.Signature();
    for (size_t i = 0; i < cache_.size(); ++i) {
        if (cache_[i].signature == signature) {
            current_ = static_cast<int>(i);
            return cache_[i].mask;
        }
    }
    if (cache_.size() >= kMaxCachedMasks) cache_.erase(cache_.begin());
    Entry& e = cache_.emplace_back();
    e.signature = std::move(signature);
    vocab_->CachedMask(state_, e.signature, &e.mask);
    current_ = static_cast<int>(cache_.size() - 1);
    return e.mask;
}

bool Constraint::AnyAllowed() {
    const TokenMask& m = Mask();
    return std::any_of(m.begin(), m.end(), [](uint64_t w) { return w != 0; });
}

bool Constraint::Accept(int32_t token_id) {
    if (token_id < 0 || token_id >= vocab_->size()) return false;
    if (vocab_->IsEnd(token_id)) return state_.CanEnd();
    const std::string& b = vocab_->bytes(token_id);
    if (b.empty() || !state_.AdvanceBytes(b)) return false;
    current_ = -1;
    return true;
}

}  // namespace kvshard::grammar
