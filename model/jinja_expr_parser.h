// The expression half of the Jinja parser (jinja_parser.h says the subset): a cursor over the
// lexer's tokens and a recursive-descent parser of expressions, with jinja2's precedence. The
// statement parser in jinja_parser.cc derives from it. Internal to model/.
//
// Nesting is bounded by kMaxParseDepth, so that a hostile template cannot overflow the stack.
// Errors are InvalidArgument "chat template syntax error at line L column C: ...".
// Thread-safety: one parser per template, used by one thread.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "model/jinja_lexer.h"
#include "model/jinja_parser.h"

namespace kvshard::jinja {

class ExprParser {
  public:
    // Ownership: `source` is borrowed and must outlive the parser.
    // REQUIRES: `tokens` ends with a kEof token (as Lex returns them).
    ExprParser(const std::string& source, std::vector<Token> tokens)
        : src_(source), tokens_(std::move(tokens)) {}

  protected:
    const Token& Peek(size_t ahead = 0) const;
    const Token& Next();
    bool IsOp(std::string_view op, size_t ahead = 0) const;
    bool IsName(std::string_view name, size_t ahead = 0) const;
    bool SkipOp(std::string_view op);
    Status Error(size_t pos, const std::string& what) const;
    Status Expect(std::string_view op);
    std::string Found() const;
    Result<std::string> ExpectName();

    // One expression at the cursor; with_condexpr false stops before a trailing "if" (a for
    // loop's filter).
    Result<ExprPtr> ParseExpr(bool with_condexpr = true);

    const std::string& src_;
    std::vector<Token> tokens_;
    size_t i_ = 0;
    int depth_ = 0;  // statements and expressions nested at the cursor

  private:
    static ExprPtr Node(Expr::Kind kind, size_t pos);
    static ExprPtr Node(Expr::Kind kind, size_t pos, ExprPtr a, ExprPtr b = nullptr);
    // Counts the nesting of expressions, bounded so that a hostile template cannot overflow
    // the stack.
    class DepthGuard {
      public:
        explicit DepthGuard(int* depth) : depth_(depth) { ++*depth_; }
        ~DepthGuard() { --*depth_; }
        bool exceeded() const { return *depth_ > kMaxParseDepth; }

      private:
        int* depth_;
    };
    // `next` (`keyword` `next`)*, left-associative: the "or" and "and" levels.
    Result<ExprPtr> ParseKeywordChain(std::string_view keyword, Expr::Kind kind,
                                      Result<ExprPtr> (ExprParser::*next)());
    Result<ExprPtr> ParseOr();
    Result<ExprPtr> ParseAnd();
    Result<ExprPtr> ParseNot();
    Result<ExprPtr> ParseCompare();
    Result<ExprPtr> ParseBinary(const std::vector<std::string_view>& ops,
                                Result<ExprPtr> (ExprParser::*next)());
    Result<ExprPtr> ParseMath1();
    Result<ExprPtr> ParseConcat();
    Result<ExprPtr> ParseMath2();
    Result<ExprPtr> ParsePow();
    Result<ExprPtr> ParseUnaryFiltered();
    Result<ExprPtr> ParseUnary(bool with_filter);
    Result<ExprPtr> ParseFilter(ExprPtr operand);
    Result<ExprPtr> ParseTest(ExprPtr operand);
    Result<ExprPtr> ParseCall(ExprPtr callee);
    // "(a, b, key=c)" into e->args (after those already there) and e->keywords.
    Status ParseArgs(Expr* e);
    Result<ExprPtr> ParsePostfix(ExprPtr e);
    Result<ExprPtr> ParseSubscript(ExprPtr e);
    Result<ExprPtr> ParsePrimary();
    Result<ExprPtr> ParseParens();
    Result<ExprPtr> ParseSequence(Expr::Kind kind, std::string_view close);
    Result<ExprPtr> ParseDict();
};

}  // namespace kvshard::jinja
