// A regex subset (grammar/compilers.h) and choice lists into a Grammar.
#include <cctype>

#include "grammar/compilers.h"
#include "grammar/quantifier.h"

namespace kvshard::grammar {
namespace {

constexpr int64_t kMaxRepeat = 1000;
constexpr QuantifierSyntax kRegexQuantifiers = {kMaxRepeat, "a count", nullptr};

// A parsed piece: its symbols in sequence, and whether it can match the empty string.
struct Piece {
    std::vector<Symbol> symbols;
    bool nullable = true;
};

// A character class: the ASCII members, the non-ASCII ones listed, or every non-ASCII character.
struct CharClass {
    ByteSet ascii;
    std::vector<std::string> non_ascii;
    bool any_non_ascii = false;
};

ByteSet AsciiComplement(const ByteSet& s) {
    ByteSet out;
    for (int b = 0; b < 128; ++b) {
        if (!s.Has(static_cast<uint8_t>(b))) out.Add(static_cast<uint8_t>(b));
    }
    return out;
}

ByteSet ClassOf(char c) {
    ByteSet s;
    switch (c) {
        case 'd':
            return ByteSet::Range('0', '9');
        case 'w':
            s = ByteSet::Range('0', '9');
            s |= ByteSet::Range('a', 'z');
            s |= ByteSet::Range('A', 'Z');
            s.Add('_');
            return s;
        case 's':
            for (char x : std::string(" \t\n\r\f\v")) s.Add(static_cast<uint8_t>(x));
            return s;
    }
    return s;
}

std::string Utf8(uint32_t cp) {
    std::string out;
    if (cp < 0x80) {
        out += static_cast<char>(cp);
    } else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return out;
}

class RegexParser {
  public:
    // `json_string`: the text is the inside of a JSON string literal, so '"' and '\\' come out
    // escaped and control characters only as escapes of literals (classes and '.' leave them out).
    RegexParser(Grammar& g, std::string_view p, bool json_string)
        : g_(g), p_(p), json_string_(json_string) {}

    Result<Symbol> Parse() {
        if (Peek('^')) ++pos_;
        KV_ASSIGN_OR_RETURN(Piece whole, Alternation());
        if (pos_ < p_.size()) return Error("unbalanced ')'");
        return g_.Seq(whole.symbols);
    }

  private:
    Status Error(const std::string& what) const {
        return InvalidArgument("regex: " + what + " at offset " + std::to_string(pos_));
    }
    bool Peek(char c) const { return pos_ < p_.size() && p_[pos_] == c; }
    bool AtEnd() const { return pos_ >= p_.size(); }

    Result<Piece> Alternation() {
        std::vector<Piece> branches;
        KV_ASSIGN_OR_RETURN(Piece first, Concatenation());
        branches.push_back(std::move(first));
        while (Peek('|')) {
            ++pos_;
            KV_ASSIGN_OR_RETURN(Piece next, Concatenation());
            branches.push_back(std::move(next));
        }
        if (branches.size() == 1) return std::move(branches[0]);
        Piece out;
        out.nullable = false;
        std::vector<std::vector<Symbol>> alts;
        for (Piece& b : branches) {
            out.nullable = out.nullable || b.nullable;
            alts.push_back(std::move(b.symbols));
        }
        out.symbols = {g_.Alt(alts)};
        return out;
    }

    Result<Piece> Concatenation() {
        Piece out;
        while (!AtEnd() && !Peek('|') && !Peek(')')) {
            if (Peek('$')) {
                ++pos_;
                if (!AtEnd() && !Peek(')') && !Peek('|'))
                    return Error("'$' is only supported at the end");
                continue;
            }
            KV_ASSIGN_OR_RETURN(Piece atom, Atom());
            KV_ASSIGN_OR_RETURN(atom, Quantified(std::move(atom)));
            out.nullable = out.nullable && atom.nullable;
            out.symbols.insert(out.symbols.end(), atom.symbols.begin(), atom.symbols.end());
        }
        return out;
    }

    Result<Piece> Quantified(Piece atom) {
        for (;;) {
            Result<std::optional<Repetition>> q = ReadQuantifier(p_, &pos_, kRegexQuantifiers);
            if (!q.ok()) return Error(q.status().message());
            if (!*q) return atom;
            const auto [min, max] = **q;
            if (Peek('?')) ++pos_;  // lazy: the same language
            if (Peek('+')) return Error("possessive quantifiers are not supported");
            if (atom.nullable && max != 0 && max != 1)
                return Error("a repeated pattern that can match the empty string");
            Piece out;
            out.nullable = atom.nullable || min == 0;
            out.symbols = {g_.Repeat(atom.symbols, min, max)};
            atom = std::move(out);
        }
    }

    // One UTF-8 character of the pattern, as its bytes.
    std::string Char() {
        const auto lead = static_cast<uint8_t>(p_[pos_]);
        size_t len = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
        len = std::min(len, p_.size() - pos_);
        std::string out(p_.substr(pos_, len));
        pos_ += len;
        return out;
    }

    Result<uint32_t> Hex(size_t digits) {
        if (pos_ + digits > p_.size()) return Error("truncated hex escape");
        uint32_t v = 0;
        for (size_t i = 0; i < digits; ++i) {
            const char c = p_[pos_++];
            if (!std::isxdigit(static_cast<unsigned char>(c))) return Error("bad hex escape");
            v = v * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(c))
                                                   ? c - '0'
                                                   : std::tolower(c) - 'a' + 10);
        }
        return v;
    }

    // After a '\': fills *cls (a class escape) or *literal.
    Status Escape(CharClass* cls, std::string* literal, bool* is_class) {
        if (AtEnd()) return Error("a trailing '\\'");
        const char c = p_[pos_++];
        *is_class = false;
        switch (c) {
            case 'd':
            case 'w':
            case 's':
                *is_class = true;
                cls->ascii |= ClassOf(c);
                return Status::Ok();
            case 'D':
            case 'W':
            case 'S':
                *is_class = true;
                cls->ascii |= AsciiComplement(ClassOf(static_cast<char>(std::tolower(c))));
                cls->any_non_ascii = true;
                return Status::Ok();
            case 'n':
                *literal = "\n";
                return Status::Ok();
            case 'r':
                *literal = "\r";
                return Status::Ok();
            case 't':
                *literal = "\t";
                return Status::Ok();
            case 'f':
                *literal = "\f";
                return Status::Ok();
            case 'v':
                *literal = "\v";
                return Status::Ok();
            case 'x': {
                KV_ASSIGN_OR_RETURN(const uint32_t v, Hex(2));
                *literal = Utf8(v);
                return Status::Ok();
            }
            case 'u': {
                KV_ASSIGN_OR_RETURN(const uint32_t v, Hex(4));
                *literal = Utf8(v);
                return Status::Ok();
            }
        }
        if (std::isalnum(static_cast<unsigned char>(c))) {
            --pos_;
            return Error(std::string("the escape \\") + c + " is not supported");
        }
        *literal = std::string(1, c);
        return Status::Ok();
    }

    // A literal's symbols; inside a JSON string, escaped as JSON needs.
    std::vector<Symbol> LiteralSymbols(const std::string& text) {
        if (!json_string_) return g_.Literal(text);
        std::string escaped;
        for (char c : text) {
            const auto b = static_cast<uint8_t>(c);
            if (c == '"' || c == '\\') {
                escaped += '\\';
                escaped += c;
            } else if (b < 0x20) {
                static const char kHex[] = "0123456789abcdef";
                escaped += c == '\n'   ? "\\n"
                           : c == '\r' ? "\\r"
                           : c == '\t' ? "\\t"
                                       : std::string("\\u00") + kHex[b >> 4] + kHex[b & 15];
            } else {
                escaped += c;
            }
        }
        return g_.Literal(escaped);
    }

    Symbol ClassSymbol(const CharClass& cls) {
        ByteSet ascii = cls.ascii;
        std::vector<std::vector<Symbol>> escapes;
        if (json_string_) {
            for (char c : {'"', '\\'}) {
                if (!ascii.Has(static_cast<uint8_t>(c))) continue;
                ascii.Remove(static_cast<uint8_t>(c));
                escapes.push_back(LiteralSymbols(std::string(1, c)));
            }
            for (int b = 0; b < 0x20; ++b) ascii.Remove(static_cast<uint8_t>(b));  // controls
        }
        std::vector<std::vector<Symbol>> alts;
        if (cls.any_non_ascii) {
            alts.push_back({g_.Utf8Char(ascii, true)});
        } else {
            if (!ascii.Empty()) alts.push_back({g_.Bytes(ascii)});
            for (const std::string& c : cls.non_ascii) alts.push_back(g_.Literal(c));
        }
        alts.insert(alts.end(), escapes.begin(), escapes.end());
        return g_.Alt(alts);
    }

    Result<Piece> Class() {
        ++pos_;  // '['
        const size_t start = pos_;
        bool negated = false;
        if (Peek('^')) {
            negated = true;
            ++pos_;
        }
        CharClass cls;
        bool first = true;
        while (!AtEnd() && (!Peek(']') || first)) {
            first = false;
            std::string lo;
            if (Peek('\\')) {
                ++pos_;
                bool is_class = false;
                KV_RETURN_IF_ERROR(Escape(&cls, &lo, &is_class));
                if (is_class) continue;
            } else {
                lo = Char();
            }
            if (Peek('-') && pos_ + 1 < p_.size() && p_[pos_ + 1] != ']') {
                ++pos_;
                std::string hi;
                if (Peek('\\')) {
                    ++pos_;
                    bool is_class = false;
                    CharClass ignored;
                    KV_RETURN_IF_ERROR(Escape(&ignored, &hi, &is_class));
                    if (is_class) return Error("a class escape as a range bound");
                } else {
                    hi = Char();
                }
                if (lo.size() != 1 || hi.size() != 1 || static_cast<uint8_t>(lo[0]) >= 0x80 ||
                    static_cast<uint8_t>(hi[0]) >= 0x80) {
                    return Error("ranges are supported over ASCII only");
                }
                if (hi[0] < lo[0]) return Error("a range out of order");
                cls.ascii |=
                    ByteSet::Range(static_cast<uint8_t>(lo[0]), static_cast<uint8_t>(hi[0]));
                continue;
            }
            if (lo.size() == 1 && static_cast<uint8_t>(lo[0]) < 0x80) {
                cls.ascii.Add(static_cast<uint8_t>(lo[0]));
            } else {
                cls.non_ascii.push_back(lo);
            }
        }
        if (!Peek(']')) {
            pos_ = start;
            return Error("an unterminated '['");
        }
        ++pos_;
        if (negated) {
            if (!cls.non_ascii.empty() || cls.any_non_ascii)
                return Error("a negated class with non-ASCII members");
            cls.ascii = AsciiComplement(cls.ascii);
            cls.any_non_ascii = true;
        }
        Piece out;
        out.nullable = false;
        out.symbols = {ClassSymbol(cls)};
        return out;
    }

    Result<Piece> Atom() {
        const char c = p_[pos_];
        Piece out;
        out.nullable = false;
        switch (c) {
            case '(': {
                ++pos_;
                if (Peek('?')) {
                    ++pos_;
                    if (Peek(':')) {
                        ++pos_;
                    } else if (Peek('P') || (Peek('<') && pos_ + 1 < p_.size() &&
                                             p_[pos_ + 1] != '=' && p_[pos_ + 1] != '!')) {
                        if (Peek('P')) ++pos_;
                        if (!Peek('<')) return Error("an unsupported (?P group");
                        while (!AtEnd() && !Peek('>')) ++pos_;
                        if (AtEnd()) return Error("an unterminated group name");
                        ++pos_;
                    } else {
                        return Error("lookaround and inline flags are not supported");
                    }
                }
                KV_ASSIGN_OR_RETURN(Piece inner, Alternation());
                if (!Peek(')')) return Error("an unterminated '('");
                ++pos_;
                inner.symbols = {g_.Seq(inner.symbols)};
                return inner;
            }
            case '[':
                return Class();
            case '.': {
                ++pos_;
                CharClass any;
                any.ascii = ByteSet::Range(0, 127);
                any.ascii.words[0] &= ~(uint64_t{1} << '\n');
                any.any_non_ascii = true;
                out.symbols = {ClassSymbol(any)};
                return out;
            }
            case '\\': {
                ++pos_;
                CharClass cls;
                std::string literal;
                bool is_class = false;
                KV_RETURN_IF_ERROR(Escape(&cls, &literal, &is_class));
                out.symbols = is_class ? std::vector<Symbol>{ClassSymbol(cls)}
                                       : std::vector<Symbol>{g_.Seq(LiteralSymbols(literal))};
                return out;
            }
            case '*':
            case '+':
            case '?':
            case '{':
                return Error(std::string("nothing to repeat before '") + c + "'");
            case '^':
                return Error("'^' is only supported at the start");
        }
        out.symbols = {g_.Seq(LiteralSymbols(Char()))};
        return out;
    }

    Grammar& g_;
    std::string_view p_;
    bool json_string_ = false;
    size_t pos_ = 0;
};

}  // namespace

Result<Symbol> AddRegex(Grammar* g, std::string_view pattern, bool json_string) {
    RegexParser parser(*g, pattern, json_string);
    return parser.Parse();
}

Result<std::shared_ptr<const Grammar>> CompileRegex(std::string_view pattern) {
    auto g = std::make_shared<Grammar>();
    KV_ASSIGN_OR_RETURN(const Symbol body, AddRegex(g.get(), pattern, /*json_string=*/false));
    const uint32_t root = g->Rule("root", {{body}});
    KV_RETURN_IF_ERROR(g->Finish(root).WithContext("regex"));
    return std::shared_ptr<const Grammar>(std::move(g));
}

Result<std::shared_ptr<const Grammar>> CompileChoice(const std::vector<std::string>& choices) {
    if (choices.empty()) return InvalidArgument("the choice list is empty");
    auto g = std::make_shared<Grammar>();
    std::vector<std::vector<Symbol>> alts;
    for (const std::string& c : choices) {
        if (c.empty()) return InvalidArgument("the choice list holds an empty string");
        alts.push_back(g->Literal(c));
    }
    const uint32_t root = g->Rule("root", alts);
    KV_RETURN_IF_ERROR(g->Finish(root));
    return std::shared_ptr<const Grammar>(std::move(g));
}

}  // namespace kvshard::grammar
