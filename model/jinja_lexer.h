// Lexing of a Jinja template into tokens, with the whitespace control of HF's environment
// (trim_blocks, lstrip_blocks, "-" and "+" markers). Internal to the parser
// (model/jinja_parser.cc, model/jinja_expr_parser.cc).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "model/jinja_value.h"

namespace kvshard::jinja {

struct Token {
    enum class Type {
        kText,
        kVarBegin,
        kVarEnd,
        kBlockBegin,
        kBlockEnd,
        kName,
        kString,
        kInt,
        kFloat,
        kOp,
        kEof
    };
    Type type;
    std::string text;  // kText, kName, kString (unescaped), kOp
    Value number;      // kInt, kFloat
    size_t pos = 0;    // byte offset in the source
};

// The tokens of `source` (newlines already normalised), ending with kEof. Comments are dropped.
// InvalidArgument naming the position of an unclosed tag, string or comment.
Result<std::vector<Token>> Lex(const std::string& source);

}  // namespace kvshard::jinja
