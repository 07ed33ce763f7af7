// The quantifier suffixes the regex subset and GBNF share: ?, *, +, {m}, {m,} and {m,n}, read
// by one function so that both syntaxes bound their counts the same way. Internal to grammar/
// (gbnf.cc, regex.cc); the accepted syntax is in grammar/compilers.h.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "common/status.h"

namespace kvshard::grammar {

// How many times the quantified atom repeats: [min, max], max -1 for no bound.
struct Repetition {
    int64_t min = 0;
    int64_t max = 0;
};

// What differs between the syntaxes.
struct QuantifierSyntax {
    int64_t max_count = 0;        // a count above it is refused
    std::string_view count_name;  // the refusal's words for a count ("a repetition count")
    // The position after what the syntax allows around the numbers inside braces (GBNF: spaces,
    // tabs, # comments); null: nothing is skipped.
    size_t (*skip_space)(std::string_view text, size_t pos) = nullptr;
};

// Reads one quantifier at text[*pos]. nullopt, *pos unchanged, when none starts there; else the
// repetition, *pos just past the suffix. InvalidArgument with the trouble alone ("expected a
// number", "expected '}'", "{m,n} with n < m", "<count_name> above <max_count>") and *pos where it
// was found, for the caller to place in its own error.
Result<std::optional<Repetition>> ReadQuantifier(std::string_view text, size_t* pos,
                                                 const QuantifierSyntax& syntax);

}  // namespace kvshard::grammar
