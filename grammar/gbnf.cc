// GBNF (llama.cpp's grammar format) into a Grammar; the accepted syntax and its limits are in
// grammar/compilers.h.
#include <algorithm>
#include <map>
#include <utility>

#include "grammar/compilers.h"
#include "grammar/quantifier.h"

namespace kvshard::grammar {
namespace {

constexpr size_t kMaxGbnfBytes = 64 * 1024;
constexpr int64_t kMaxGbnfRepeat = 1000;
constexpr size_t kMaxGbnfSymbols = 200'000;
constexpr int kMaxGbnfNesting = 64;
constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// Spaces, tabs and # comments from t[pos]; line breaks too where `newline_ok` (inside a group,
// after '::=' or '|', between rules). The position after them.
size_t SkipGbnfSpace(std::string_view t, size_t pos, bool newline_ok) {
    while (pos < t.size()) {
        const char c = t[pos];
        if (c == ' ' || c == '\t' || (newline_ok && (c == '\n' || c == '\r'))) {
            ++pos;
        } else if (c == '#') {
            while (pos < t.size() && t[pos] != '\n' && t[pos] != '\r') ++pos;
        } else {
            break;
        }
    }
    return pos;
}

// {m,n} may have spaces (not line breaks) around its numbers.
constexpr QuantifierSyntax kGbnfQuantifiers = {
    kMaxGbnfRepeat, "a repetition count",
    [](std::string_view t, size_t pos) { return SkipGbnfSpace(t, pos, false); }};

using Interval = std::pair<uint32_t, uint32_t>;  // code points lo..hi, inclusive

size_t Utf8Length(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

std::string EncodeUtf8(uint32_t cp) {
    const size_t n = Utf8Length(cp);
    if (n == 1) return std::string(1, static_cast<char>(cp));
    std::string out(n, '\0');
    for (size_t i = n - 1; i > 0; --i) {
        out[i] = static_cast<char>(0x80 | (cp & 0x3F));
        cp >>= 6;
    }
    static constexpr uint8_t kLead[] = {0, 0, 0xC0, 0xE0, 0xF0};
    out[0] = static_cast<char>(kLead[n] | cp);
    return out;
}

// Byte-set sequences matching exactly the UTF-8 encodings of the code points lo..hi, which share
// one encoded length and hold no surrogate. A range is split where a continuation byte's span is
// partial, until every remaining piece is a product of per-byte ranges.
void Utf8Sequences(Grammar& g, uint32_t lo, uint32_t hi, std::vector<std::vector<Symbol>>* alts) {
    const size_t n = Utf8Length(lo);
    for (size_t i = 1; i < n; ++i) {
        const uint32_t m = (uint32_t{1} << (6 * i)) - 1;
        if ((lo & ~m) == (hi & ~m)) continue;
        if ((lo & m) != 0) {
            Utf8Sequences(g, lo, lo | m, alts);
            Utf8Sequences(g, (lo | m) + 1, hi, alts);
            return;
        }
        if ((hi & m) != m) {
            Utf8Sequences(g, lo, (hi & ~m) - 1, alts);
            Utf8Sequences(g, hi & ~m, hi, alts);
            return;
        }
    }
    const std::string a = EncodeUtf8(lo), b = EncodeUtf8(hi);
    std::vector<Symbol> seq;
    for (size_t k = 0; k < n; ++k) {
        seq.push_back(
            g.Bytes(ByteSet::Range(static_cast<uint8_t>(a[k]), static_cast<uint8_t>(b[k]))));
    }
    alts->push_back(std::move(seq));
}

// Any one character among `intervals` (sorted, disjoint), as alternatives of byte sequences.
std::vector<std::vector<Symbol>> CharAlternatives(Grammar& g, const std::vector<Interval>& ivs) {
    std::vector<std::vector<Symbol>> alts;
    ByteSet ascii;
    // Encoded-length boundaries, with the surrogates (not characters) left out.
    static constexpr Interval kBands[] = {
        {0, 0x7F}, {0x80, 0x7FF}, {0x800, 0xD7FF}, {0xE000, 0xFFFF}, {0x10000, kMaxCodePoint}};
    for (const auto& [lo, hi] : ivs) {
        for (const auto& [band_lo, band_hi] : kBands) {
            const uint32_t a = std::max(lo, band_lo), b = std::min(hi, band_hi);
            if (a > b) continue;
            if (band_hi == 0x7F) {
                ascii |= ByteSet::Range(static_cast<uint8_t>(a), static_cast<uint8_t>(b));
            } else {
                Utf8Sequences(g, a, b, &alts);
            }
        }
    }
    if (!ascii.Empty()) alts.insert(alts.begin(), {g.Bytes(ascii)});
    return alts;
}

class GbnfParser {
  public:
    GbnfParser(Grammar& g, std::string_view text) : g_(g), t_(text) {}

    Result<uint32_t> Parse() {
        SkipSpace(true);
        if (AtEnd()) return Error("the grammar is empty (it needs a rule root ::= ...)");
        while (!AtEnd()) {
            KV_RETURN_IF_ERROR(ParseRule());
            SkipSpace(true);
        }
        for (const auto& [name, rule] : names_) {
            if (!defined_[rule]) {
                return InvalidArgument("gbnf: rule '" + name + "' is used but never defined");
            }
        }
        auto root = names_.find("root");
        if (root == names_.end()) {
            return InvalidArgument("gbnf: no rule 'root' (the grammar's start: root ::= ...)");
        }
        return root->second;
    }

  private:
    Status Error(const std::string& what) const {
        size_t line = 1, column = 1;
        for (size_t i = 0; i < pos_ && i < t_.size(); ++i) {
            if (t_[i] == '\n') {
                ++line;
                column = 1;
            } else {
                ++column;
            }
        }
        return InvalidArgument("gbnf: " + what + " at line " + std::to_string(line) + ", column " +
                               std::to_string(column));
    }
    bool AtEnd() const { return pos_ >= t_.size(); }
    bool Peek(char c) const { return pos_ < t_.size() && t_[pos_] == c; }
    bool AtNewline() const { return Peek('\n') || Peek('\r'); }
    static bool IsNameChar(char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '-' || c == '_';
    }

    void SkipSpace(bool newline_ok) { pos_ = SkipGbnfSpace(t_, pos_, newline_ok); }

    std::string Name() {
        const size_t start = pos_;
        while (!AtEnd() && IsNameChar(t_[pos_])) ++pos_;
        return std::string(t_.substr(start, pos_ - start));
    }

    uint32_t Lookup(const std::string& name) {
        auto it = names_.find(name);
        if (it != names_.end()) return it->second;
        const uint32_t rule = g_.Declare(name);
        names_[name] = rule;
        if (defined_.size() <= rule) defined_.resize(rule + 1, false);
        return rule;
    }

    Status ParseRule() {
        const std::string name = Name();
        if (name.empty()) return Error("expected a rule name (GBNF: name ::= ...)");
        SkipSpace(false);
        if (t_.substr(pos_, 3) != "::=") {
            return Error("expected '::=' after the rule name '" + name +
                         "' (kvshard accepts GBNF, llama.cpp's grammar format, not Lark EBNF)");
        }
        pos_ += 3;
        SkipSpace(true);
        const uint32_t rule = Lookup(name);
        if (defined_[rule]) return Error("rule '" + name + "' is defined twice");
        g_.set_helper_name(name);
        KV_ASSIGN_OR_RETURN(auto alts, Alternates(false, 0));
        g_.Define(rule, alts);
        defined_[rule] = true;
        SkipSpace(false);
        if (!AtEnd() && !AtNewline()) return Error("unexpected '" + std::string(1, t_[pos_]) + "'");
        return Status::Ok();
    }

    Result<std::vector<std::vector<Symbol>>> Alternates(bool nested, int depth) {
        std::vector<std::vector<Symbol>> alts;
        for (;;) {
            KV_ASSIGN_OR_RETURN(auto seq, Sequence(nested, depth));
            alts.push_back(std::move(seq));
            if (!nested && !Peek('|')) {
                // An alternative may continue on the next line when that line starts with '|'.
                const size_t save = pos_;
                SkipSpace(true);
                if (!Peek('|')) pos_ = save;
            }
            if (!Peek('|')) return alts;
            ++pos_;
            SkipSpace(true);
        }
    }

    Result<std::vector<Symbol>> Sequence(bool nested, int depth) {
        std::vector<Symbol> seq;
        for (;;) {
            SkipSpace(nested);
            if (AtEnd() || Peek('|') || Peek(')') || AtNewline()) return seq;
            KV_ASSIGN_OR_RETURN(Symbol atom, Atom(depth));
            for (;;) {
                SkipSpace(nested);
                Result<std::optional<Repetition>> q = ReadQuantifier(t_, &pos_, kGbnfQuantifiers);
                if (!q.ok()) return Error(q.status().message());
                if (!*q) break;
                atom = g_.Repeat({atom}, (*q)->min, (*q)->max);
                if (g_.num_symbols() > kMaxGbnfSymbols) {
                    return Error("the grammar grows past " + std::to_string(kMaxGbnfSymbols) +
                                 " symbols (repetition counts too large)");
                }
            }
            seq.push_back(atom);
        }
    }

    Result<uint32_t> Hex(size_t digits) {
        uint32_t v = 0;
        for (size_t i = 0; i < digits; ++i, ++pos_) {
            if (AtEnd()) return Error("a truncated escape");
            const char c = t_[pos_];
            const int d = c >= '0' && c <= '9'   ? c - '0'
                          : c >= 'a' && c <= 'f' ? c - 'a' + 10
                          : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                 : -1;
            if (d < 0) return Error("a bad hex digit in an escape");
            v = v * 16 + static_cast<uint32_t>(d);
        }
        if (v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF)) {
            return Error("an escape that is not a Unicode character");
        }
        return v;
    }

    // One character of a literal or class (an escape or a UTF-8 character) as a code point.
    Result<uint32_t> Char() {
        if (AtEnd()) return Error("an unterminated literal or class");
        const auto lead = static_cast<uint8_t>(t_[pos_]);
        if (lead == '\\') {
            ++pos_;
            if (AtEnd()) return Error("a trailing '\\'");
            const char c = t_[pos_++];
            switch (c) {
                case 'n':
                    return uint32_t{'\n'};
                case 'r':
                    return uint32_t{'\r'};
                case 't':
                    return uint32_t{'\t'};
                case '\\':
                case '"':
                case '[':
                case ']':
                case '-':
                    return static_cast<uint32_t>(c);
                case 'x':
                    return Hex(2);
                case 'u':
                    return Hex(4);
                case 'U':
                    return Hex(8);
            }
            --pos_;
            return Error(std::string("the escape \\") + c + " is not GBNF");
        }
        if (lead < 0x80) {
            ++pos_;
            return uint32_t{lead};
        }
        const size_t n = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 0;
        if (n == 0 || pos_ + n > t_.size()) return Error("invalid UTF-8");
        uint32_t cp = lead & (0x7F >> n);
        for (size_t i = 1; i < n; ++i) cp = (cp << 6) | (static_cast<uint8_t>(t_[pos_ + i]) & 0x3F);
        pos_ += n;
        return cp;
    }

    Result<Symbol> Literal() {
        ++pos_;  // '"'
        std::string bytes;
        while (!Peek('"')) {
            if (AtEnd() || AtNewline()) return Error("an unterminated string literal");
            KV_ASSIGN_OR_RETURN(const uint32_t cp, Char());
            bytes += EncodeUtf8(cp);
        }
        ++pos_;
        if (bytes.size() == 1) return g_.Byte(static_cast<uint8_t>(bytes[0]));
        return g_.Seq(g_.Literal(bytes));
    }

    Result<Symbol> Class() {
        ++pos_;  // '['
        bool negated = false;
        if (Peek('^')) {
            negated = true;
            ++pos_;
        }
        std::vector<Interval> ivs;
        while (!Peek(']')) {
            if (AtEnd() || AtNewline()) return Error("an unterminated '['");
            KV_ASSIGN_OR_RETURN(const uint32_t lo, Char());
            uint32_t hi = lo;
            if (Peek('-') && pos_ + 1 < t_.size() && t_[pos_ + 1] != ']' && t_[pos_ + 1] != '\n' &&
                t_[pos_ + 1] != '\r') {
                ++pos_;
                KV_ASSIGN_OR_RETURN(hi, Char());
                if (hi < lo) return Error("a range out of order");
            }
            ivs.push_back({lo, hi});
        }
        ++pos_;
        std::sort(ivs.begin(), ivs.end());
        std::vector<Interval> merged;
        for (const Interval& iv : ivs) {
            if (!merged.empty() && iv.first <= merged.back().second + 1) {
                merged.back().second = std::max(merged.back().second, iv.second);
            } else {
                merged.push_back(iv);
            }
        }
        if (negated) {
            std::vector<Interval> complement;
            uint32_t next = 0;
            for (const Interval& iv : merged) {
                if (iv.first > next) complement.push_back({next, iv.first - 1});
                next = iv.second + 1;
            }
            if (next <= kMaxCodePoint) complement.push_back({next, kMaxCodePoint});
            merged = std::move(complement);
        }
        auto alts = CharAlternatives(g_, merged);
        if (alts.empty()) return Error("a class that matches no character");
        if (alts.size() == 1 && alts[0].size() == 1) return alts[0][0];
        return g_.Alt(alts);
    }

    Result<Symbol> Atom(int depth) {
        const char c = t_[pos_];
        if (c == '"') return Literal();
        if (c == '[') return Class();
        if (c == '.') {
            ++pos_;
            return g_.Alt(CharAlternatives(g_, {{0, kMaxCodePoint}}));
        }
        if (c == '(') {
            if (depth >= kMaxGbnfNesting) return Error("groups nested too deep");
            ++pos_;
            SkipSpace(true);
            KV_ASSIGN_OR_RETURN(auto alts, Alternates(true, depth + 1));
            if (!Peek(')')) return Error("an unterminated '('");
            ++pos_;
            return g_.Alt(alts);
        }
        if (IsNameChar(c)) {
            const std::string name = Name();
            SkipSpace(false);
            if (t_.substr(pos_, 3) == "::=") {
                return Error("a new rule '" + name + "' where the previous one has not ended");
            }
            return Grammar::Ref(Lookup(name));
        }
        return Error("unexpected '" + std::string(1, c) + "'");
    }

    Grammar& g_;
    std::string_view t_;
    size_t pos_ = 0;
    std::map<std::string, uint32_t> names_;
    std::vector<bool> defined_;
};

}  // namespace

Result<std::shared_ptr<const Grammar>> CompileGbnf(std::string_view text) {
    if (text.size() > kMaxGbnfBytes) {
        return InvalidArgument("gbnf: the grammar is over " + std::to_string(kMaxGbnfBytes) +
                               " bytes");
    }
    if (text.find("::=") == std::string_view::npos) {
        return InvalidArgument(
            "gbnf: no rule 'name ::= ...' found; kvshard accepts GBNF "
            "(llama.cpp's grammar format), not Lark EBNF or another grammar format");
    }
    auto g = std::make_shared<Grammar>();
    GbnfParser parser(*g, text);
    KV_ASSIGN_OR_RETURN(const uint32_t root, parser.Parse());
    KV_RETURN_IF_ERROR(g->Finish(root).WithContext("gbnf"));
    return std::shared_ptr<const Grammar>(std::move(g));
}

}  // namespace kvshard::grammar
