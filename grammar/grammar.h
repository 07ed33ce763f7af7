// Grammar and GrammarState: the automaton behind constrained decoding (structured outputs).
//
// A Grammar is a byte-level context-free grammar: rules, each a list of alternatives, each a
// sequence of symbols that are either a set of bytes or a reference to a rule. The compilers in
// grammar/compilers.h build one from a JSON Schema, a choice list or a regex. A GrammarState is
// a position in it — a pushdown automaton run as a set of stacks (one per live parse, as
// llama.cpp's grammar sampler does) — that is stepped byte by byte and says which bytes may come
// next and whether the text so far is complete.
//
// A reference in tail position (the last symbol of an alternative) pushes nothing, so the
// repetitions the compilers build (R ::= body R | "") run in constant stack depth; the stack
// grows only with real nesting (JSON arrays inside objects ...).
//
// Thread-safety: a Grammar is immutable once built and may be shared by threads; a GrammarState
// belongs to one thread at a time.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvshard::grammar {

// A set of bytes.
struct ByteSet {
    std::array<uint64_t, 4> words{};

    static ByteSet Of(uint8_t b) {
        ByteSet s;
        s.Add(b);
        return s;
    }
    static ByteSet Range(uint8_t lo, uint8_t hi) {
        ByteSet s;
        for (int b = lo; b <= hi; ++b) s.Add(static_cast<uint8_t>(b));
        return s;
    }
    void Add(uint8_t b) { words[b >> 6] |= uint64_t{1} << (b & 63); }
    void Remove(uint8_t b) { words[b >> 6] &= ~(uint64_t{1} << (b & 63)); }
    bool Has(uint8_t b) const { return (words[b >> 6] >> (b & 63)) & 1; }
    bool Empty() const { return (words[0] | words[1] | words[2] | words[3]) == 0; }
    ByteSet& operator|=(const ByteSet& o) {
        for (int i = 0; i < 4; ++i) words[i] |= o.words[i];
        return *this;
    }
    friend bool operator==(const ByteSet&, const ByteSet&) = default;
};

// A symbol of an alternative: a byte set (index into Grammar's sets) or a rule reference.
using Symbol = uint32_t;

class Grammar {
  public:
    Grammar();
    // Unique in the process (never reused, unlike an address): a key for caches of its masks.
    uint64_t id() const { return id_; }

    static constexpr Symbol kRefBit = 0x80000000u;
    static constexpr uint32_t kEnd = 0xFFFFFFFFu;  // ends an alternative in the flat symbol list

    // ---- building ----
    Symbol Bytes(const ByteSet& set);
    Symbol Byte(uint8_t b) { return Bytes(ByteSet::Of(b)); }
    static Symbol Ref(uint32_t rule) { return rule | kRefBit; }
    // A rule to be defined later (for recursion and forward references).
    uint32_t Declare(std::string name);
    void Define(uint32_t rule, const std::vector<std::vector<Symbol>>& alternatives);
    uint32_t Rule(std::string name, const std::vector<std::vector<Symbol>>& alternatives) {
        const uint32_t r = Declare(std::move(name));
        Define(r, alternatives);
        return r;
    }
    // Helpers the compilers share; each returns one symbol.
    std::vector<Symbol> Literal(std::string_view bytes);
    Symbol Seq(const std::vector<Symbol>& symbols);  // a rule of one alternative
    Symbol Alt(const std::vector<std::vector<Symbol>>& alternatives);
    Symbol Optional(const std::vector<Symbol>& body);
    Symbol Star(const std::vector<Symbol>& body);
    // body repeated min..max times; max < 0: unbounded.
    Symbol Repeat(const std::vector<Symbol>& body, int64_t min, int64_t max);
    // One UTF-8 encoded character (1 to 4 bytes, lead bytes C2..F4) whose ASCII part is `ascii`
    // (a set of bytes < 0x80); with non_ascii false, only the ASCII part.
    Symbol Utf8Char(const ByteSet& ascii, bool non_ascii = true);
    // The name the helpers above give the rules they make ("seq", "alt", "star" when empty): a
    // front end sets it to the rule it is compiling, so that errors Finish reports about a
    // helper (left recursion) name the user's rule.
    void set_helper_name(std::string name) { helper_name_ = std::move(name); }

    // Makes the grammar usable: every rule defined, every rule reachable from `root` checked for
    // left recursion (which would make the automaton expand forever). Errors name the rule.
    Status Finish(uint32_t root);

    // ---- reading (after Finish) ----
    uint32_t root() const { return root_; }
    Symbol symbol(uint32_t pos) const { return symbols_[pos]; }
    const ByteSet& set(Symbol s) const { return sets_[s]; }
    const std::vector<uint32_t>& alternatives(uint32_t rule) const { return rules_[rule].alts; }
    const std::string& rule_name(uint32_t rule) const { return rules_[rule].name; }
    size_t num_rules() const { return rules_.size(); }
    // Symbols of every alternative so far (a measure of size for front ends to bound).
    size_t num_symbols() const { return symbols_.size(); }

  private:
    struct RuleDef {
        std::string name;
        std::vector<uint32_t> alts;  // start of each alternative in symbols_
        bool defined = false;
    };
    std::vector<ByteSet> sets_;
    std::vector<Symbol> symbols_;
    std::vector<RuleDef> rules_;
    std::string helper_name_;
    uint32_t root_ = 0;
    bool finished_ = false;
    uint64_t id_ = 0;
};

// One node of a parse stack: continue at symbol position `pos`, then with the stack `next`.
struct StackNode {
    uint32_t pos = 0;
    uint32_t next = 0;  // index of the node below, or kNone
    static constexpr uint32_t kNone = 0xFFFFFFFFu;
    // Below the stack the token mask's precomputation starts from (Vocabulary::TopMasksFor):
    // reaching it means the text left the starting frame, whose context is unknown there.
    static constexpr uint32_t kOutside = 0xFFFFFFFEu;
};

// Expansion and stepping over an arena of StackNodes; shared by GrammarState and the token mask's
// trie walk (which keeps one scratch arena and truncates it as it backtracks).
class Stepper {
  public:
    // At most this many live parses (an ambiguous grammar fails rather than blow up).
    static constexpr size_t kMaxStacks = 1024;

    explicit Stepper(const Grammar& g) : g_(g) {}
    // Adds to `tops` every stack reached from (pos, next) whose top is a byte set; sets
    // *can_end when a parse is complete, *left when a parse reached StackNode::kOutside. False
    // when kMaxStacks is passed.
    bool Expand(std::vector<StackNode>& arena, uint32_t pos, uint32_t next,
                std::vector<uint32_t>& tops, size_t tops_begin, bool* can_end,
                bool* left = nullptr) const;
    // The tops after consuming `byte` from tops[begin, end), appended to `tops`.
    bool Advance(std::vector<StackNode>& arena, std::vector<uint32_t>& tops, size_t begin,
                 size_t end, uint8_t byte, bool* can_end, bool* left = nullptr) const;

  private:
    const Grammar& g_;
};

class GrammarState {
  public:
    // The start of `grammar`. REQUIRES: grammar->Finish(...) succeeded.
    explicit GrammarState(std::shared_ptr<const Grammar> grammar);

    // Consumes one byte; false (and the state unchanged) when the grammar does not allow it.
    bool Advance(uint8_t byte);
    // Consumes bytes; false (and the state unchanged) unless all are allowed.
    bool AdvanceBytes(std::string_view bytes);
    bool CanEnd() const { return can_end_; }
    // No byte may follow (the text is complete, or, only for a state never advanced, the
    // grammar accepts nothing).
    bool Finished() const { return tops_.empty(); }
    ByteSet AllowedBytes() const;

    const Grammar& grammar() const { return *grammar_; }
    const std::shared_ptr<const Grammar>& grammar_ptr() const { return grammar_; }
    const std::vector<StackNode>& arena() const { return arena_; }
    const std::vector<uint32_t>& tops() const { return tops_; }
    // The parse stacks as symbol positions, top first, stacks separated by kEnd: equal
    // signatures mean equal futures (the token mask's cache key).
    std::vector<uint32_t> Signature() const;

  private:
    void Compact();

    std::shared_ptr<const Grammar> grammar_;
    std::vector<StackNode> arena_;
    std::vector<uint32_t> tops_;
    bool can_end_ = false;
};

}  // namespace kvshard::grammar
