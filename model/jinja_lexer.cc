#include "model/jinja_lexer.h"

#include <algorithm>
#include <cctype>
#include <cstring>

#include "model/jinja_parser.h"

namespace kvshard::jinja {
namespace {

bool IsSpace(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}
bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
        *out += static_cast<char>(cp);
    } else if (cp < 0x800) {
        *out += static_cast<char>(0xC0 | (cp >> 6));
        *out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        *out += static_cast<char>(0xE0 | (cp >> 12));
        *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        *out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        *out += static_cast<char>(0xF0 | (cp >> 18));
        *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        *out += static_cast<char>(0x80 | (cp & 0x3F));
    }
}

class Lexer {
  public:
    explicit Lexer(const std::string& src) : src_(src) {}

    Result<std::vector<Token>> Run() {
        size_t pos = 0;
        bool line_starting = true;
        while (pos < src_.size()) {
            const size_t tag = FindTag(pos);
            std::string text =
                src_.substr(pos, (tag == std::string::npos ? src_.size() : tag) - pos);
            if (tag == std::string::npos) {
                Emit(Token::Type::kText, std::move(text), pos);
                break;
            }
            const char kind = src_[tag + 1];
            const char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
            if (sign == '-') {
                const size_t keep = text.find_last_not_of(" \t\n\r\v\f");
                text.erase(keep == std::string::npos ? 0 : keep + 1);
            } else if (sign != '+' && kind != '{') {
                // lstrip_blocks: the spaces before a block or comment tag at the start of a line.
                const size_t line = text.rfind('\n') + 1;  // npos + 1 == 0
                if ((line > 0 || line_starting) && line < text.size() &&
                    std::all_of(text.begin() + line, text.end(), IsSpace)) {
                    text.erase(line);
                }
            }
            Emit(Token::Type::kText, std::move(text), pos);
            pos = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
            if (kind == '#') {
                const size_t end = src_.find("#}", pos);
                if (end == std::string::npos) return Error(tag, "a comment that is never closed");
                pos = TagEnd(end, 2, end > tag + 2 && src_[end - 1] == '-',
                             end > tag + 2 && src_[end - 1] == '+', true);
            } else {
                const bool block = kind == '%';
                Emit(block ? Token::Type::kBlockBegin : Token::Type::kVarBegin, "", tag);
                KV_ASSIGN_OR_RETURN(pos, LexTag(pos, block, tag));
            }
            line_starting = pos > 0 && src_[pos - 1] == '\n';
        }
        Emit(Token::Type::kEof, "", src_.size());
        return std::move(tokens_);
    }

  private:
    size_t FindTag(size_t pos) const {
        while (true) {
            const size_t at = src_.find('{', pos);
            if (at == std::string::npos || at + 1 >= src_.size()) return std::string::npos;
            const char c = src_[at + 1];
            if (c == '{' || c == '%' || c == '#') return at;
            pos = at + 1;
        }
    }

    // The position after a tag's closing delimiter at `end` (`len` bytes), with its whitespace
    // control: "-" strips all whitespace after; a block or comment drops one newline
    // (trim_blocks) unless "+".
    size_t TagEnd(size_t end, size_t len, bool minus, bool plus, bool block) const {
        size_t pos = end + len;
        if (minus) {
            while (pos < src_.size() && IsSpace(src_[pos])) ++pos;
        } else if (block && !plus && pos < src_.size() && src_[pos] == '\n') {
            ++pos;
        }
        return pos;
    }

    Result<size_t> LexTag(size_t pos, bool block, size_t tag_pos) {
        const std::string_view close = block ? "%}" : "}}";
        int depth = 0;  // open brackets: "}}" inside a dict literal does not close the tag
        while (true) {
            while (pos < src_.size() && IsSpace(src_[pos])) ++pos;
            if (pos >= src_.size()) {
                return Error(tag_pos, std::string("a tag that is never closed (no \"") +
                                          std::string(close) + "\")");
            }
            const std::string_view rest = std::string_view(src_).substr(pos);
            for (char sign : {'-', '+'}) {
                if (depth == 0 && rest.size() > 2 && rest[0] == sign &&
                    rest.substr(1, 2) == close && (sign == '-' || block)) {
                    Emit(block ? Token::Type::kBlockEnd : Token::Type::kVarEnd, "", pos);
                    return TagEnd(pos + 1, 2, sign == '-', sign == '+', block);
                }
            }
            if (depth == 0 && rest.substr(0, 2) == close) {
                Emit(block ? Token::Type::kBlockEnd : Token::Type::kVarEnd, "", pos);
                return TagEnd(pos, 2, false, false, block);
            }
            const char c = src_[pos];
            if (IsNameStart(c)) {
                size_t end = pos;
                while (end < src_.size() && IsNameChar(src_[end])) ++end;
                Emit(Token::Type::kName, src_.substr(pos, end - pos), pos);
                pos = end;
            } else if (std::isdigit(static_cast<unsigned char>(c))) {
                KV_ASSIGN_OR_RETURN(pos, LexNumber(pos));
            } else if (c == '\'' || c == '"') {
                KV_ASSIGN_OR_RETURN(pos, LexString(pos));
            } else {
                static constexpr const char* kOps[] = {
                    "**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "|",
                    ".",  ",",  ":",  "(",  ")",  "[",  "]", "{", "}", "<", ">", "="};
                const char* match = nullptr;
                for (const char* op : kOps) {
                    if (rest.substr(0, std::strlen(op)) == op) {
                        match = op;
                        break;
                    }
                }
                if (match == nullptr) {
                    return Error(pos, std::string("unexpected character '") + c + "'");
                }
                if (std::strchr("([{", match[0]) != nullptr && match[1] == '\0') ++depth;
                if (std::strchr(")]}", match[0]) != nullptr && match[1] == '\0' && depth > 0)
                    --depth;
                Emit(Token::Type::kOp, match, pos);
                pos += std::strlen(match);
            }
        }
    }

    Result<size_t> LexNumber(size_t pos) {
        size_t end = pos;
        while (end < src_.size() &&
               (std::isdigit(static_cast<unsigned char>(src_[end])) || src_[end] == '_'))
            ++end;
        bool is_float = false;
        if (end + 1 < src_.size() && src_[end] == '.' &&
            std::isdigit(static_cast<unsigned char>(src_[end + 1]))) {
            is_float = true;
            ++end;
            while (end < src_.size() && std::isdigit(static_cast<unsigned char>(src_[end]))) ++end;
        }
        std::string digits;
        for (size_t i = pos; i < end; ++i) {
            if (src_[i] != '_') digits += src_[i];
        }
        Token t{is_float ? Token::Type::kFloat : Token::Type::kInt, digits, {}, pos};
        try {
            t.number = is_float ? Value::Float(std::stod(digits))
                                : Value::Int(static_cast<int64_t>(std::stoll(digits)));
        } catch (const std::exception&) {
            return Error(pos, "a number out of range");
        }
        tokens_.push_back(std::move(t));
        return end;
    }

    // Python's unicode-escape rules for the escapes a template writes.
    Result<size_t> LexString(size_t pos) {
        const char quote = src_[pos];
        std::string out;
        size_t i = pos + 1;
        while (true) {
            if (i >= src_.size()) return Error(pos, "a string that is never closed");
            const char c = src_[i];
            if (c == quote) break;
            if (c != '\\' || i + 1 >= src_.size()) {
                out += c;
                ++i;
                continue;
            }
            const char e = src_[i + 1];
            i += 2;
            switch (e) {
                case 'n':
                    out += '\n';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case '\\':
                    out += '\\';
                    break;
                case '\'':
                    out += '\'';
                    break;
                case '"':
                    out += '"';
                    break;
                case 'a':
                    out += '\a';
                    break;
                case 'b':
                    out += '\b';
                    break;
                case 'f':
                    out += '\f';
                    break;
                case 'v':
                    out += '\v';
                    break;
                case '\n':
                    break;
                case 'x':
                case 'u':
                case 'U': {
                    const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                    if (i + n > src_.size())
                        return Error(i, "a truncated \\" + std::string(1, e) + " escape");
                    uint32_t cp = 0;
                    for (size_t k = 0; k < n; ++k) {
                        const char h = src_[i + k];
                        if (!std::isxdigit(static_cast<unsigned char>(h))) {
                            return Error(i, "a malformed \\" + std::string(1, e) + " escape");
                        }
                        cp = cp * 16 +
                             static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                       ? h - '0'
                                                       : (std::tolower(h) - 'a' + 10));
                    }
                    if (cp > 0x10FFFF) return Error(i, "an escape beyond Unicode");
                    AppendUtf8(cp, &out);
                    i += n;
                    break;
                }
                default:
                    out += '\\';
                    out += e;
            }
        }
        Emit(Token::Type::kString, std::move(out), pos);
        return i + 1;
    }

    void Emit(Token::Type type, std::string text, size_t pos) {
        if (type == Token::Type::kText && text.empty()) return;
        tokens_.push_back({type, std::move(text), {}, pos});
    }

    Status Error(size_t pos, const std::string& what) const {
        return InvalidArgument("chat template syntax error at " + Position(src_, pos) + ": " +
                               what);
    }

    const std::string& src_;
    std::vector<Token> tokens_;
};

}  // namespace

Result<std::vector<Token>> Lex(const std::string& source) { return Lexer(source).Run(); }

}  // namespace kvshard::jinja
