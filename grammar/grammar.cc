#include "grammar/grammar.h"

#include <algorithm>
#include <atomic>

#include "common/check.h"

namespace kvshard::grammar {

Grammar::Grammar() {
    static std::atomic<uint64_t> next_id{1};
    id_ = next_id.fetch_add(1);
}

Symbol Grammar::Bytes(const ByteSet& set) {
    for (size_t i = 0; i < sets_.size(); ++i) {
        if (sets_[i] == set) return static_cast<Symbol>(i);
    }
    sets_.push_back(set);
    return static_cast<Symbol>(sets_.size() - 1);
}

uint32_t Grammar::Declare(std::string name) {
    KV_CHECK(!finished_);
    rules_.push_back({std::move(name), {}, false});
    return static_cast<uint32_t>(rules_.size() - 1);
}

void Grammar::Define(uint32_t rule, const std::vector<std::vector<Symbol>>& alternatives) {
    KV_CHECK_LT(rule, rules_.size());
    KV_CHECK(!rules_[rule].defined) << rules_[rule].name;
    rules_[rule].defined = true;
    for (const auto& alt : alternatives) {
        rules_[rule].alts.push_back(static_cast<uint32_t>(symbols_.size()));
        symbols_.insert(symbols_.end(), alt.begin(), alt.end());
        symbols_.push_back(kEnd);
    }
}

std::vector<Symbol> Grammar::Literal(std::string_view bytes) {
    std::vector<Symbol> out;
    out.reserve(bytes.size());
    for (char c : bytes) out.push_back(Byte(static_cast<uint8_t>(c)));
    return out;
}

Symbol Grammar::Seq(const std::vector<Symbol>& symbols) {
    return Ref(Rule(helper_name_.empty() ? "seq" : helper_name_, {symbols}));
}

Symbol Grammar::Alt(const std::vector<std::vector<Symbol>>& alternatives) {
    return Ref(Rule(helper_name_.empty() ? "alt" : helper_name_, alternatives));
}

Symbol Grammar::Optional(const std::vector<Symbol>& body) { return Alt({body, {}}); }

Symbol Grammar::Star(const std::vector<Symbol>& body) {
    const uint32_t r = Declare(helper_name_.empty() ? "star" : helper_name_);
    std::vector<Symbol> loop = body;
    loop.push_back(Ref(r));  // tail position: constant stack depth
    Define(r, {loop, {}});
    return Ref(r);
}

Symbol Grammar::Repeat(const std::vector<Symbol>& body, int64_t min, int64_t max) {
    std::vector<Symbol> seq;
    for (int64_t i = 0; i < min; ++i) seq.insert(seq.end(), body.begin(), body.end());
    if (max < 0) {
        seq.push_back(Star(body));
    } else if (max > min) {
        // O_k ::= body O_{k-1} | "" — at most k more, each reference in tail position.
        std::vector<Symbol> more = body;
        Symbol opt = Optional(body);
        for (int64_t k = 2; k <= max - min; ++k) {
            more = body;
            more.push_back(opt);
            opt = Optional(more);
        }
        seq.push_back(opt);
    }
    return Seq(seq);
}

Symbol Grammar::Utf8Char(const ByteSet& ascii, bool non_ascii) {
    std::vector<std::vector<Symbol>> alts;
    if (!ascii.Empty()) alts.push_back({Bytes(ascii)});
    if (non_ascii) {
        const Symbol cont = Bytes(ByteSet::Range(0x80, 0xBF));
        alts.push_back({Bytes(ByteSet::Range(0xC2, 0xDF)), cont});
        alts.push_back({Bytes(ByteSet::Range(0xE0, 0xEF)), cont, cont});
        alts.push_back({Bytes(ByteSet::Range(0xF0, 0xF4)), cont, cont, cont});
    }
    return Alt(alts);
}

Status Grammar::Finish(uint32_t root) {
    KV_CHECK_LT(root, rules_.size());
    for (const RuleDef& r : rules_) {
        if (!r.defined) return InvalidArgument("grammar rule '" + r.name + "' is never defined");
        // A live parse must always lead somewhere (the token mask relies on it).
        if (r.alts.empty()) return InvalidArgument("grammar rule '" + r.name + "' matches nothing");
    }
    // Nullable rules (fixpoint), then the "may start with" graph, which must have no cycle.
    std::vector<bool> nullable(rules_.size(), false);
    auto alt_nullable_prefix = [&](uint32_t pos, std::vector<uint32_t>* starts) {
        for (;; ++pos) {
            const Symbol s = symbols_[pos];
            if (s == kEnd) return true;
            if ((s & kRefBit) == 0) return false;
            const uint32_t r = s & ~kRefBit;
            if (starts != nullptr) starts->push_back(r);
            if (!nullable[r]) return false;
        }
    };
    for (bool changed = true; changed;) {
        changed = false;
        for (size_t r = 0; r < rules_.size(); ++r) {
            if (nullable[r]) continue;
            for (uint32_t a : rules_[r].alts) {
                if (alt_nullable_prefix(a, nullptr)) {
                    nullable[r] = true;
                    changed = true;
                    break;
                }
            }
        }
    }
    std::vector<std::vector<uint32_t>> starts(rules_.size());
    for (size_t r = 0; r < rules_.size(); ++r) {
        for (uint32_t a : rules_[r].alts) alt_nullable_prefix(a, &starts[r]);
    }
    // 0 unvisited, 1 on the DFS path, 2 done.
    std::vector<uint8_t> mark(rules_.size(), 0);
    std::vector<std::pair<uint32_t, size_t>> path;
    for (size_t start = 0; start < rules_.size(); ++start) {
        if (mark[start] != 0) continue;
        path.push_back({static_cast<uint32_t>(start), 0});
        mark[start] = 1;
        while (!path.empty()) {
            auto& [r, i] = path.back();
            if (i == starts[r].size()) {
                mark[r] = 2;
                path.pop_back();
                continue;
            }
            const uint32_t s = starts[r][i++];
            if (mark[s] == 1) {
                return InvalidArgument("grammar rule '" + rules_[s].name +
                                       "' is left-recursive (it can start with itself)");
            }
            if (mark[s] == 0) {
                mark[s] = 1;
                path.push_back({s, 0});
            }
        }
    }
    root_ = root;
    finished_ = true;
    return Status::Ok();
}

// ---- Stepper ----

bool Stepper::Expand(std::vector<StackNode>& arena, uint32_t pos, uint32_t next,
                     std::vector<uint32_t>& tops, size_t tops_begin, bool* can_end,
                     bool* left) const {
    for (;;) {
        const Symbol s = g_.symbol(pos);
        if (s == Grammar::kEnd) {
            if (next == StackNode::kNone) {
                *can_end = true;
                return true;
            }
            if (next == StackNode::kOutside) {
                if (left != nullptr) *left = true;
                return true;
            }
            const StackNode n = arena[next];
            pos = n.pos;
            next = n.next;
            continue;
        }
        if (s & Grammar::kRefBit) {
            uint32_t cont = next;
            if (g_.symbol(pos + 1) != Grammar::kEnd) {
                arena.push_back({pos + 1, next});
                cont = static_cast<uint32_t>(arena.size() - 1);
            }
            for (uint32_t alt : g_.alternatives(s & ~Grammar::kRefBit)) {
                if (!Expand(arena, alt, cont, tops, tops_begin, can_end, left)) return false;
            }
            return true;
        }
        for (size_t i = tops_begin; i < tops.size(); ++i) {
            const StackNode& t = arena[tops[i]];
            if (t.pos == pos && t.next == next) return true;
        }
        if (tops.size() - tops_begin >= kMaxStacks) return false;
        arena.push_back({pos, next});
        tops.push_back(static_cast<uint32_t>(arena.size() - 1));
        return true;
    }
}

bool Stepper::Advance(std::vector<StackNode>& arena, std::vector<uint32_t>& tops, size_t begin,
                      size_t end, uint8_t byte, bool* can_end, bool* left) const {
    const size_t out_begin = tops.size();
    for (size_t i = begin; i < end; ++i) {
        const StackNode n = arena[tops[i]];
        if (!g_.set(g_.symbol(n.pos)).Has(byte)) continue;
        if (!Expand(arena, n.pos + 1, n.next, tops, out_begin, can_end, left)) return false;
    }
    return true;
}

// ---- GrammarState ----

GrammarState::GrammarState(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
    const Stepper stepper(*grammar_);
    for (uint32_t alt : grammar_->alternatives(grammar_->root())) {
        if (!stepper.Expand(arena_, alt, StackNode::kNone, tops_, 0, &can_end_)) break;
    }
}

bool GrammarState::Advance(uint8_t byte) {
    const size_t arena_size = arena_.size();
    const size_t end = tops_.size();
    bool can_end = false;
    const bool ok = Stepper(*grammar_).Advance(arena_, tops_, 0, end, byte, &can_end);
    if (!ok || (tops_.size() == end && !can_end)) {
        arena_.resize(arena_size);
        tops_.resize(end);
        return false;
    }
    tops_.erase(tops_.begin(), tops_.begin() + static_cast<ptrdiff_t>(end));
    can_end_ = can_end;
    if (arena_.size() > 256 && arena_.size() > 4 * tops_.size()) Compact();
    return true;
}

bool GrammarState::AdvanceBytes(std::string_view bytes) {
    GrammarState copy = *this;
    for (char c : bytes) {
        if (!copy.Advance(static_cast<uint8_t>(c))) return false;
    }
    *this = std::move(copy);
    Compact();
    return true;
}

ByteSet GrammarState::AllowedBytes() const {
    ByteSet out;
    for (uint32_t t : tops_) out |= grammar_->set(grammar_->symbol(arena_[t].pos));
    return out;
}

std::vector<uint32_t> GrammarState::Signature() const {
    std::vector<uint32_t> sig;
    for (uint32_t t : tops_) {
        for (uint32_t n = t; n != StackNode::kNone; n = arena_[n].next)
            sig.push_back(arena_[n].pos);
        sig.push_back(Grammar::kEnd);
    }
    if (can_end_) sig.push_back(Grammar::kEnd - 1);
    return sig;
}

void GrammarState::Compact() {
    std::vector<uint32_t> remap(arena_.size(), StackNode::kNone);
    std::vector<StackNode> fresh;
    std::vector<uint32_t> chain;
    for (uint32_t& t : tops_) {
        chain.clear();
        for (uint32_t n = t; n != StackNode::kNone && remap[n] == StackNode::kNone;
             n = arena_[n].next) {
            chain.push_back(n);
        }
        for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
            const StackNode& old = arena_[*it];
            fresh.push_back(
                {old.pos, old.next == StackNode::kNone ? StackNode::kNone : remap[old.next]});
            remap[*it] = static_cast<uint32_t>(fresh.size() - 1);
        }
        t = remap[t];
    }
    arena_ = std::move(fresh);
}

}  // namespace kvshard::grammar
