// The syntax of a Jinja chat template: lexing (with the whitespace control of HF's
// apply_chat_template environment: trim_blocks, lstrip_blocks, "{%-" / "-%}", no trailing
// newline kept) and parsing into a tree of statements and expressions.
//
// The subset is what real chat templates use: {{ }}, {# #}, if/elif/else, for (with an "if"
// filter, tuple targets and else), set (to a name, a namespace attribute, or a block), macro,
// break/continue (jinja2.ext.loopcontrols, which HF enables) and HF's generation block;
// expressions with literals (strings, numbers, lists, dicts, tuples), attribute / item / slice
// access, calls with keyword arguments, filters, tests, "x if c else y", arithmetic, "~",
// comparisons (chained), in / not in, and / or / not. Anything else (raw, include, extends,
// call blocks) is refused with its position.
//
// Thread-safety: a parsed Template is immutable and may be shared between threads.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/jinja_value.h"

namespace kvshard::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
    enum class Kind {
        kLiteral,      // value
        kName,         // name
        kAttr,         // args[0].name
        kItem,         // args[0][args[1]]
        kSlice,        // args[0][args[1]:args[2]:args[3]] (null: omitted)
        kCall,         // args[0](args[1..]) with keywords
        kFilter,       // args[0] | name(args[1..]) with keywords
        kTest,         // args[0] is [not] name(args[1..]); negated
        kNeg,          // -args[0]
        kPos,          // +args[0]
        kNot,          // not args[0]
        kBinary,       // args[0] op args[1]: + - * / // % ** ~
        kAnd,          // args[0] and args[1]
        kOr,           // args[0] or args[1]
        kCompare,      // args[0] ops[0] args[1] ops[1] args[2] ...
        kConditional,  // args[1] if args[0] else args[2] (args[2] may be null)
        kList,         // [args...]
        kTuple,        // (args...)
        kDict,         // {args[0]: args[1], ...}
    };
    Kind kind;
    size_t pos = 0;  // byte offset in the template source
    Value value;
    std::string name;              // kName, kAttr, kFilter, kTest; kBinary's operator
    std::vector<std::string> ops;  // kCompare: "==", "!=", "<", "<=", ">", ">=", "in", "notin"
    std::vector<ExprPtr> args;     // operands, as documented per kind
    std::vector<std::pair<std::string, ExprPtr>> keywords;  // kCall, kFilter
    bool negated = false;                                   // kTest
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
    enum class Kind {
        kText,    // text
        kOutput,  // {{ expr }}
        kIf,      // conditions[i] → bodies[i]; bodies.back() is else when larger
        kFor,     // for targets in expr [if filter]: bodies[0]; else bodies[1]
        kSet,     // set targets[0][.attr] = expr, or a block (bodies[0]) when expr is null
        kMacro,   // macro name(params = defaults): bodies[0]
        kBreak,
        kContinue,
        kBlock,  // bodies[0] as is (generation)
    };
    Kind kind;
    size_t pos = 0;
    std::string text;                  // kText; kMacro's name; kSet's attribute ("" = none)
    ExprPtr expr;                      // kOutput, kFor's iterable, kSet's value
    ExprPtr filter;                    // kFor's "if"
    std::vector<ExprPtr> conditions;   // kIf
    std::vector<std::string> targets;  // kFor, kSet, kMacro's parameters
    std::vector<ExprPtr> defaults;     // kMacro: one per parameter (null: none)
    std::vector<Body> bodies;
};

struct Template {
    std::string source;  // after newline normalisation; positions index it
    Body body;
};

// Limits of parsing: nesting of blocks and of expressions.
inline constexpr int kMaxParseDepth = 200;

// InvalidArgument naming "line L column C" of the first syntax error.
Result<std::shared_ptr<const Template>> Parse(std::string_view source);

// "line L column C" of a byte offset of `source`.
std::string Position(std::string_view source, size_t pos);

}  // namespace kvshard::jinja
