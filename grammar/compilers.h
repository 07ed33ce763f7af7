// Compilers into a Grammar (grammar/grammar.h): JSON Schema, any JSON object, a choice list, a
// regex and a GBNF grammar. Each returns a finished grammar, or InvalidArgument naming what is not
// supported and where (a JSON Schema keyword by its path, a regex construct by its offset, a GBNF
// error by line and column or by rule name).
//
// JSON is generated compact, with one policy for whitespace: none anywhere except at most one
// space after each ':' and ','. The model cannot pad its output with whitespace, and a bounded
// grammar cannot loop on spaces. Numbers are bounded likewise: at most 16 integer digits, 16
// fraction digits and 3 exponent digits.
//
// JSON Schema: the subset OpenAI's strict mode allows — type (one or a list), object with
// properties / required / additionalProperties (false, or a schema for an object without
// properties: a map), string, number, integer, boolean, null, array with items / minItems /
// maxItems, enum, const, anyOf, allOf of one schema, $ref to #/$defs/..., #/definitions/... or #
// (recursion allowed), nested to any depth — and on strings either minLength / maxLength, or
// pattern, or format; on integers minimum / maximum / exclusiveMinimum / exclusiveMaximum.
//  - pattern: the regex subset below, and the whole string matches it (as if anchored ^...$: a
//    subset of the strings JSON Schema's unanchored search allows). '"' and '\' come out as JSON
//    escapes; control characters only where the pattern names them as literals.
//  - format: date (YYYY-MM-DD with each month's days; February to the 28th), time (HH:MM:SS with
//    up to 6 fraction digits, then Z or +HH:MM / -HH:MM; no leap second), date-time (date "T"
//    time), uuid (lowercase hex 8-4-4-4-12), email (lowercase ASCII letters and digits: a local
//    part of 1 to 4 words joined by . _ + -, '@', 1 to 4 dot-separated labels of hyphen-joined
//    words, a 2 to 24 letter top level; every word at most 16 characters), ipv4 (dotted quad, no
//    leading zeros). Conservative: everything generated is valid, not everything valid is
//    generated; and bounded, so a model cannot run on inside one.
//  - integer bounds: exact (every integer in range, nothing outside), within the 16-digit limit;
//    fractional bounds round inward. Bounds on "number" are refused.
// Annotations (title, description, default, examples, $schema, $id, $comment, deprecated,
// readOnly, writeOnly) are ignored. Properties are generated in name order (nlohmann::json keeps
// keys sorted); optional ones may be left out. Anything else (oneOf, not, if, uniqueItems,
// prefixItems, multipleOf, other formats, ...) is refused by name.
//
// Regex (vLLM's guided_regex: the whole output matches): literals (UTF-8 characters), '.', classes
// [a-z0-9_] and [^...] (ranges over ASCII; non-ASCII characters listed one by one), escapes \d \w
// \s \D \W \S \n \r \t \f \v \xHH \uHHHH and escaped punctuation, groups (...), (?:...),
// (?P<name>...), alternation |, quantifiers * + ? {m} {m,} {m,n} (lazy forms accepted: same
// language), ^ at the start and $ at the end. Refused: backreferences, lookaround, \b, anchors
// elsewhere, a repeated pattern that can match the empty string, and counts over 1000.
//
// GBNF (llama.cpp's grammar format; vLLM's guided_grammar): rules `name ::= alternatives` (names
// of letters, digits, '-' and '_'), `root` the start; string literals "..." and classes [...] /
// [^...] over Unicode code points (ranges included) with the escapes \n \r \t \\ \" \[ \] \-
// \xHH \uHHHH \UHHHHHHHH; '.' (any character); groups ( ); alternation |; quantifiers * + ?
// {m} {m,} {m,n}; # comments. A newline ends a rule except inside a group, after '::=' or '|', or
// before a line that starts with '|'. Refused by name: an undefined rule, a rule defined twice, a
// missing root, left recursion (a rule that can reach itself before any character, which includes
// an open repetition of something that can be empty). Bounded: 64 KiB of text, counts up to 1000,
// 200,000 grammar symbols in all, groups 64 deep.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "grammar/grammar.h"

namespace kvshard::grammar {

// `path` names the schema in error messages ("response_format.json_schema.schema").
Result<std::shared_ptr<const Grammar>> CompileJsonSchema(const nlohmann::json& schema,
                                                         const std::string& path);
// Any JSON object (response_format json_object).
std::shared_ptr<const Grammar> CompileJsonObject();
// Exactly one of `choices`. REQUIRES nothing; an empty list is InvalidArgument.
Result<std::shared_ptr<const Grammar>> CompileChoice(const std::vector<std::string>& choices);
Result<std::shared_ptr<const Grammar>> CompileRegex(std::string_view pattern);
Result<std::shared_ptr<const Grammar>> CompileGbnf(std::string_view text);

// The symbol of text matching `pattern`, added to *g; with `json_string`, the text as it is
// written inside a JSON string literal (escapes for '"', '\\' and control characters).
Result<Symbol> AddRegex(Grammar* g, std::string_view pattern, bool json_string);

// Building blocks for grammars that embed JSON (tool calls): the symbol of a value valid for
// `schema` (resolving $ref against `root`), added to *g.
Result<Symbol> AddJsonSchema(Grammar* g, const nlohmann::json& schema, const nlohmann::json& root,
                             const std::string& path);

}  // namespace kvshard::grammar
