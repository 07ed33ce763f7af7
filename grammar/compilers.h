// Compilers into a Grammar (grammar/grammar.h): JSON Schema, any JSON object, a choice list and
// a regex. Each returns a finished grammar, or InvalidArgument naming what is not supported and
// where (a JSON Schema keyword by its path, a regex construct by its offset).
//
// JSON is generated compact, with one policy for whitespace: none anywhere except at most one
// space after each ':' and ','. The model cannot pad its output with whitespace, and a bounded
// grammar cannot loop on spaces. Numbers are bounded likewise: at most 16 integer digits, 16
// fraction digits and 3 exponent digits.
//
// JSON Schema: the subset OpenAI's strict mode allows — type (one or a list), object with
// properties / required / additionalProperties (false, or a schema for an object without
// properties: a map), string (minLength, maxLength), number, integer, boolean, null, array with
// items / minItems / maxItems, enum, const, anyOf, allOf of one schema, $ref to #/$defs/...,
// #/definitions/... or # (recursion allowed), nested to any depth. Annotations (title,
// description, default, examples, $schema, $id, $comment, deprecated, readOnly, writeOnly) are
// ignored. Properties are generated in name order (nlohmann::json keeps keys sorted); optional ones
// may be left out.
// Anything else (pattern, format, minimum, oneOf, not, if, uniqueItems, prefixItems, ...) is
// refused by name.
//
// Regex (vLLM's guided_regex: the whole output matches): literals (UTF-8 characters), '.', classes
// [a-z0-9_] and [^...] (ranges over ASCII; non-ASCII characters listed one by one), escapes \d \w
// \s \D \W \S \n \r \t \f \v \xHH \uHHHH and escaped punctuation, groups (...), (?:...),
// (?P<name>...), alternation |, quantifiers * + ? {m} {m,} {m,n} (lazy forms accepted: same
// language), ^ at the start and $ at the end. Refused: backreferences, lookaround, \b, anchors
// elsewhere, a repeated pattern that can match the empty string, and counts over 1000.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

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

// Building blocks for grammars that embed JSON (tool calls): the symbol of a value valid for
// `schema` (resolving $ref against `root`), added to *g.
Result<Symbol> AddJsonSchema(Grammar* g, const nlohmann::json& schema, const nlohmann::json& root,
                             const std::string& path);

}  // namespace kvshard::grammar
