#include "grammar/quantifier.h"

#include <string>

namespace kvshard::grammar {
namespace {

bool At(std::string_view text, size_t pos, char c) { return pos < text.size() && text[pos] == c; }

void SkipSpace(std::string_view text, size_t* pos, const QuantifierSyntax& syntax) {
    if (syntax.skip_space != nullptr) *pos = syntax.skip_space(text, *pos);
}

// Decimal digits, stopped as soon as the value passes the syntax's bound.
Result<int64_t> Count(std::string_view text, size_t* pos, const QuantifierSyntax& syntax) {
    const size_t start = *pos;
    int64_t v = 0;
    while (*pos < text.size() && text[*pos] >= '0' && text[*pos] <= '9') {
        v = v * 10 + (text[*pos] - '0');
        if (v > syntax.max_count) {
            return InvalidArgument(std::string(syntax.count_name) + " above " +
                                   std::to_string(syntax.max_count));
        }
        ++*pos;
    }
    if (*pos == start) return InvalidArgument("expected a number");
    return v;
}

}  // namespace

Result<std::optional<Repetition>> ReadQuantifier(std::string_view text, size_t* pos,
                                                 const QuantifierSyntax& syntax) {
    if (*pos >= text.size()) return std::optional<Repetition>();
    switch (text[*pos]) {
        case '*':
            ++*pos;
            return std::optional<Repetition>({0, -1});
        case '+':
            ++*pos;
            return std::optional<Repetition>({1, -1});
        case '?':
            ++*pos;
            return std::optional<Repetition>({0, 1});
        case '{':
            break;
        default:
            return std::optional<Repetition>();
    }
    ++*pos;  // '{'
    Repetition r;
    SkipSpace(text, pos, syntax);
    KV_ASSIGN_OR_RETURN(r.min, Count(text, pos, syntax));
    r.max = r.min;
    SkipSpace(text, pos, syntax);
    if (At(text, *pos, ',')) {
        ++*pos;
        SkipSpace(text, pos, syntax);
        if (At(text, *pos, '}')) {
            r.max = -1;
        } else {
            KV_ASSIGN_OR_RETURN(r.max, Count(text, pos, syntax));
            SkipSpace(text, pos, syntax);
        }
    }
    if (!At(text, *pos, '}')) return InvalidArgument("expected '}'");
    ++*pos;
    if (r.max >= 0 && r.max < r.min) return InvalidArgument("{m,n} with n < m");
    return std::optional<Repetition>(r);
}

}  // namespace kvshard::grammar
