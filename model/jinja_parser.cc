#include "model/jinja_parser.h"

#include <algorithm>
#include <cstring>

#include "model/jinja_lexer.h"

namespace kvshard::jinja {

std::string Position(std::string_view source, size_t pos) {
    pos = std::min(pos, source.size());
    size_t line = 1;
    size_t line_start = 0;
    for (size_t i = 0; i < pos; ++i) {
        if (source[i] == '\n') {
            ++line;
            line_start = i + 1;
        }
    }
    return "line " + std::to_string(line) + " column " + std::to_string(pos - line_start + 1);
}

namespace {

using T = Token::Type;

std::unique_ptr<Stmt> NewStmt(Stmt::Kind kind, size_t pos) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->pos = pos;
    return s;
}

class Parser {
  public:
    Parser(const std::string& source, std::vector<Token> tokens)
        : src_(source), tokens_(std::move(tokens)) {}

    Result<Body> Run() {
        std::string end;
        KV_ASSIGN_OR_RETURN(Body body, ParseBody({}, &end));
        return body;
    }

  private:
    const Token& Peek(size_t ahead = 0) const {
        return tokens_[std::min(i_ + ahead, tokens_.size() - 1)];
    }
    const Token& Next() {
        const Token& t = Peek();
        if (i_ < tokens_.size() - 1) ++i_;
        return t;
    }
    bool IsOp(std::string_view op, size_t ahead = 0) const {
        return Peek(ahead).type == T::kOp && Peek(ahead).text == op;
    }
    bool IsName(std::string_view name, size_t ahead = 0) const {
        return Peek(ahead).type == T::kName && Peek(ahead).text == name;
    }
    bool SkipOp(std::string_view op) {
        if (!IsOp(op)) return false;
        Next();
        return true;
    }
    Status Error(size_t pos, const std::string& what) const {
        return InvalidArgument("chat template syntax error at " + Position(src_, pos) + ": " +
                               what);
    }
    Status Expect(std::string_view op) {
        if (SkipOp(op)) return Status::Ok();
        return Error(Peek().pos, "expected '" + std::string(op) + "'" + Found());
    }
    Status ExpectBlockEnd() {
        if (Peek().type == T::kBlockEnd) {
            Next();
            return Status::Ok();
        }
        return Error(Peek().pos, "expected the end of the tag ('%}')" + Found());
    }
    std::string Found() const {
        const Token& t = Peek();
        switch (t.type) {
            case T::kName:
            case T::kOp:
                return ", found '" + t.text + "'";
            case T::kString:
                return ", found a string";
            case T::kInt:
            case T::kFloat:
                return ", found a number";
            case T::kEof:
                return ", found the end of the template";
            case T::kBlockEnd:
            case T::kVarEnd:
                return ", found the end of the tag";
            case T::kText:
            case T::kVarBegin:
            case T::kBlockBegin:
                return "";
        }
        return "";
    }
    Result<std::string> ExpectName() {
        if (Peek().type != T::kName) return Error(Peek().pos, "expected a name" + Found());
        return Next().text;
    }

    // Statements up to a block tag whose keyword is one of `ends` (consumed up to the keyword;
    // the keyword is stored in *end). With no `ends`, up to the end of the template.
    Result<Body> ParseBody(const std::vector<std::string_view>& ends, std::string* end) {
        if (++depth_ > kMaxParseDepth) return Error(Peek().pos, "blocks nest too deeply");
        Body body;
        while (true) {
            const Token& t = Peek();
            if (t.type == T::kEof) {
                if (ends.empty()) break;
                return Error(t.pos, "the template ends inside a block (expected '" +
                                        std::string(ends.back()) + "')");
            }
            if (t.type == T::kText) {
                auto s = NewStmt(Stmt::Kind::kText, t.pos);
                s->text = t.text;
                body.push_back(std::move(s));
                Next();
                continue;
            }
            if (t.type == T::kVarBegin) {
                Next();
                auto s = NewStmt(Stmt::Kind::kOutput, t.pos);
                KV_ASSIGN_OR_RETURN(s->expr, ParseExpr());
                if (Peek().type != T::kVarEnd) {
                    return Error(Peek().pos, "expected the end of the print tag ('}}')" + Found());
                }
                Next();
                body.push_back(std::move(s));
                continue;
            }
            if (t.type != T::kBlockBegin) return Error(t.pos, "unexpected token" + Found());
            const Token& keyword = Peek(1);
            if (keyword.type == T::kName &&
                std::find(ends.begin(), ends.end(), keyword.text) != ends.end()) {
                Next();
                *end = Next().text;
                break;
            }
            Next();
            KV_ASSIGN_OR_RETURN(std::unique_ptr<Stmt> s, ParseStatement());
            body.push_back(std::move(s));
        }
        --depth_;
        return body;
    }

    Result<std::unique_ptr<Stmt>> ParseStatement() {
        const size_t pos = Peek().pos;
        KV_ASSIGN_OR_RETURN(std::string keyword, ExpectName());
        if (keyword == "if") return ParseIf(pos);
        if (keyword == "for") return ParseFor(pos);
        if (keyword == "set") return ParseSet(pos);
        if (keyword == "macro") return ParseMacro(pos);
        if (keyword == "break" || keyword == "continue") {
            KV_RETURN_IF_ERROR(ExpectBlockEnd());
            return NewStmt(keyword == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, pos);
        }
        if (keyword == "generation") {
            // HF's AssistantTracker block: renders its body unchanged.
            KV_RETURN_IF_ERROR(ExpectBlockEnd());
            auto s = NewStmt(Stmt::Kind::kBlock, pos);
            std::string end;
            KV_ASSIGN_OR_RETURN(Body body, ParseBody({"endgeneration"}, &end));
            KV_RETURN_IF_ERROR(ExpectBlockEnd());
            s->bodies.push_back(std::move(body));
            return s;
        }
        return Error(pos, "the tag '" + keyword +
                              "' is not supported by kvshard's chat template interpreter");
    }

    Result<std::unique_ptr<Stmt>> ParseIf(size_t pos) {
        auto s = NewStmt(Stmt::Kind::kIf, pos);
        while (true) {
            KV_ASSIGN_OR_RETURN(ExprPtr cond, ParseExpr());
            KV_RETURN_IF_ERROR(ExpectBlockEnd());
            std::string end;
            KV_ASSIGN_OR_RETURN(Body body, ParseBody({"elif", "else", "endif"}, &end));
            s->conditions.push_back(std::move(cond));
            s->bodies.push_back(std::move(body));
            if (end == "elif") continue;
            if (end == "else") {
                KV_RETURN_IF_ERROR(ExpectBlockEnd());
                KV_ASSIGN_OR_RETURN(Body else_body, ParseBody({"endif"}, &end));
                s->bodies.push_back(std::move(else_body));
            }
            KV_RETURN_IF_ERROR(ExpectBlockEnd());
            return s;
        }
    }

    Result<std::unique_ptr<Stmt>> ParseFor(size_t pos) {
        auto s = NewStmt(Stmt::Kind::kFor, pos);
        const bool paren = SkipOp("(");
        do {
            KV_ASSIGN_OR_RETURN(std::string target, ExpectName());
            s->targets.push_back(std::move(target));
        } while (SkipOp(","));
        if (paren) KV_RETURN_IF_ERROR(Expect(")"));
        if (!IsName("in")) return Error(Peek().pos, "expected 'in'" + Found());
        Next();
        KV_ASSIGN_OR_RETURN(s->expr, ParseExpr(/*with_condexpr=*/false));
        if (IsName("if")) {
            Next();
            KV_ASSIGN_OR_RETURN(s->filter, ParseExpr());
        }
        if (IsName("recursive")) return Error(Peek().pos, "recursive loops are not supported");
        KV_RETURN_IF_ERROR(ExpectBlockEnd());
        std::string end;
        KV_ASSIGN_OR_RETURN(Body body, ParseBody({"else", "endfor"}, &end));
        s->bodies.push_back(std::move(body));
        if (end == "else") {
            KV_RETURN_IF_ERROR(ExpectBlockEnd());
            KV_ASSIGN_OR_RETURN(Body else_body, ParseBody({"endfor"}, &end));
            s->bodies.push_back(std::move(else_body));
        }
        KV_RETURN_IF_ERROR(ExpectBlockEnd());
        return s;
    }

    Result<std::unique_ptr<Stmt>> ParseSet(size_t pos) {
        auto s = NewStmt(Stmt::Kind::kSet, pos);
        KV_ASSIGN_OR_RETURN(std::string target, ExpectName());
        s->targets.push_back(std::move(target));
        if (SkipOp(".")) {
            KV_ASSIGN_OR_RETURN(s->text, ExpectName());
        }
        if (SkipOp("=")) {
            KV_ASSIGN_OR_RETURN(s->expr, ParseExpr());
            KV_RETURN_IF_ERROR(ExpectBlockEnd());
            return s;
        }
        if (!s->text.empty()) return Error(Peek().pos, "expected '='" + Found());
        KV_RETURN_IF_ERROR(ExpectBlockEnd());
        std::string end;
        KV_ASSIGN_OR_RETURN(Body body, ParseBody({"endset"}, &end));
        KV_RETURN_IF_ERROR(ExpectBlockEnd());
        s->bodies.push_back(std::move(body));
        return s;
    }

    Result<std::unique_ptr<Stmt>> ParseMacro(size_t pos) {
        auto s = NewStmt(Stmt::Kind::kMacro, pos);
        KV_ASSIGN_OR_RETURN(s->text, ExpectName());
        KV_RETURN_IF_ERROR(Expect("("));
        while (!SkipOp(")")) {
            if (!s->targets.empty()) KV_RETURN_IF_ERROR(Expect(","));
            if (SkipOp(")")) break;
            KV_ASSIGN_OR_RETURN(std::string param, ExpectName());
            s->targets.push_back(std::move(param));
            ExprPtr def;
            if (SkipOp("=")) {
                KV_ASSIGN_OR_RETURN(def, ParseExpr());
            }
            s->defaults.push_back(std::move(def));
        }
        KV_RETURN_IF_ERROR(ExpectBlockEnd());
        std::string end;
        KV_ASSIGN_OR_RETURN(Body body, ParseBody({"endmacro"}, &end));
        if (Peek().type == T::kName) Next();  // {% endmacro name %}
        KV_RETURN_IF_ERROR(ExpectBlockEnd());
        s->bodies.push_back(std::move(body));
        return s;
    }

    static ExprPtr Node(Expr::Kind kind, size_t pos) {
        auto e = std::make_unique<Expr>();
        e->kind = kind;
        e->pos = pos;
        return e;
    }
    static ExprPtr Node(Expr::Kind kind, size_t pos, ExprPtr a, ExprPtr b = nullptr) {
        ExprPtr e = Node(kind, pos);
        e->args.push_back(std::move(a));
        if (b) e->args.push_back(std::move(b));
        return e;
    }

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

    Result<ExprPtr> ParseExpr(bool with_condexpr = true) {
        DepthGuard guard(&depth_);
        if (guard.exceeded()) return Error(Peek().pos, "expressions nest too deeply");
        const size_t pos = Peek().pos;
        KV_ASSIGN_OR_RETURN(ExprPtr e, ParseOr());
        while (with_condexpr && IsName("if")) {
            Next();
            KV_ASSIGN_OR_RETURN(ExprPtr cond, ParseOr());
            ExprPtr other;
            if (IsName("else")) {
                Next();
                KV_ASSIGN_OR_RETURN(other, ParseExpr());
            }
            ExprPtr c = Node(Expr::Kind::kConditional, pos, std::move(cond), std::move(e));
            c->args.push_back(std::move(other));
            e = std::move(c);
        }
        return e;
    }
    Result<ExprPtr> ParseOr() {
        KV_ASSIGN_OR_RETURN(ExprPtr e, ParseAnd());
        while (IsName("or")) {
            const size_t pos = Next().pos;
            KV_ASSIGN_OR_RETURN(ExprPtr r, ParseAnd());
            e = Node(Expr::Kind::kOr, pos, std::move(e), std::move(r));
        }
        return e;
    }
    Result<ExprPtr> ParseAnd() {
        KV_ASSIGN_OR_RETURN(ExprPtr e, ParseNot());
        while (IsName("and")) {
            const size_t pos = Next().pos;
            KV_ASSIGN_OR_RETURN(ExprPtr r, ParseNot());
            e = Node(Expr::Kind::kAnd, pos, std::move(e), std::move(r));
        }
        return e;
    }
    Result<ExprPtr> ParseNot() {
        if (IsName("not")) {
            DepthGuard guard(&depth_);
            if (guard.exceeded()) return Error(Peek().pos, "expressions nest too deeply");
            const size_t pos = Next().pos;
            KV_ASSIGN_OR_RETURN(ExprPtr e, ParseNot());
            return Node(Expr::Kind::kNot, pos, std::move(e));
        }
        return ParseCompare();
    }
    Result<ExprPtr> ParseCompare() {
        const size_t pos = Peek().pos;
        KV_ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
        ExprPtr cmp;
        while (true) {
            std::string op;
            if (Peek().type == T::kOp &&
                (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp("<=") || IsOp(">") || IsOp(">="))) {
                op = Next().text;
            } else if (IsName("in")) {
                Next();
                op = "in";
            } else if (IsName("not") && IsName("in", 1)) {
                Next();
                Next();
                op = "notin";
            } else {
                break;
            }
            if (!cmp) cmp = Node(Expr::Kind::kCompare, pos, std::move(first));
            KV_ASSIGN_OR_RETURN(ExprPtr r, ParseMath1());
            cmp->ops.push_back(op);
            cmp->args.push_back(std::move(r));
        }
        return cmp ? std::move(cmp) : std::move(first);
    }
    Result<ExprPtr> ParseBinary(const std::vector<std::string_view>& ops,
                                Result<ExprPtr> (Parser::*next)()) {
        KV_ASSIGN_OR_RETURN(ExprPtr e, (this->*next)());
        while (Peek().type == T::kOp &&
               std::find(ops.begin(), ops.end(), Peek().text) != ops.end()) {
            const Token& op = Next();
            KV_ASSIGN_OR_RETURN(ExprPtr r, (this->*next)());
            ExprPtr b = Node(Expr::Kind::kBinary, op.pos, std::move(e), std::move(r));
            b->name = op.text;
            e = std::move(b);
        }
        return e;
    }
    Result<ExprPtr> ParseMath1() { return ParseBinary({"+", "-"}, &Parser::ParseConcat); }
    Result<ExprPtr> ParseConcat() { return ParseBinary({"~"}, &Parser::ParseMath2); }
    Result<ExprPtr> ParseMath2() { return ParseBinary({"*", "/", "//", "%"}, &Parser::ParsePow); }
    Result<ExprPtr> ParsePow() { return ParseBinary({"**"}, &Parser::ParseUnaryFiltered); }
    Result<ExprPtr> ParseUnaryFiltered() { return ParseUnary(true); }

    Result<ExprPtr> ParseUnary(bool with_filter) {
        DepthGuard guard(&depth_);
        if (guard.exceeded()) return Error(Peek().pos, "expressions nest too deeply");
        const size_t pos = Peek().pos;
        ExprPtr e;
        if (IsOp("-") || IsOp("+")) {
            const bool neg = Next().text == "-";
            KV_ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
            e = Node(neg ? Expr::Kind::kNeg : Expr::Kind::kPos, pos, std::move(operand));
        } else {
            KV_ASSIGN_OR_RETURN(e, ParsePrimary());
        }
        KV_ASSIGN_OR_RETURN(e, ParsePostfix(std::move(e)));
        if (!with_filter) return e;
        while (true) {
            if (IsOp("|")) {
                KV_ASSIGN_OR_RETURN(e, ParseFilter(std::move(e)));
            } else if (IsName("is")) {
                KV_ASSIGN_OR_RETURN(e, ParseTest(std::move(e)));
            } else if (IsOp("(")) {
                KV_ASSIGN_OR_RETURN(e, ParseCall(std::move(e)));
            } else {
                return e;
            }
        }
    }

    Result<ExprPtr> ParseFilter(ExprPtr operand) {
        const size_t pos = Next().pos;  // '|'
        KV_ASSIGN_OR_RETURN(std::string name, ExpectName());
        ExprPtr f = Node(Expr::Kind::kFilter, pos, std::move(operand));
        f->name = std::move(name);
        if (IsOp("(")) KV_RETURN_IF_ERROR(ParseArgs(f.get()));
        return f;
    }

    Result<ExprPtr> ParseTest(ExprPtr operand) {
        const size_t pos = Next().pos;  // 'is'
        ExprPtr t = Node(Expr::Kind::kTest, pos, std::move(operand));
        if (IsName("not")) {
            Next();
            t->negated = true;
        }
        KV_ASSIGN_OR_RETURN(t->name, ExpectName());
        const Token& next = Peek();
        if (IsOp("(")) {
            KV_RETURN_IF_ERROR(ParseArgs(t.get()));
        } else if ((next.type == T::kName || next.type == T::kString || next.type == T::kInt ||
                    next.type == T::kFloat || IsOp("[") || IsOp("{")) &&
                   !IsName("else") && !IsName("or") && !IsName("and")) {
            if (IsName("is")) return Error(next.pos, "tests cannot be chained with 'is'");
            KV_ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
            KV_ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
            t->args.push_back(std::move(arg));
        }
        return t;
    }

    Result<ExprPtr> ParseCall(ExprPtr callee) {
        ExprPtr c = Node(Expr::Kind::kCall, Peek().pos, std::move(callee));
        KV_RETURN_IF_ERROR(ParseArgs(c.get()));
        return c;
    }

    // "(a, b, key=c)" into e->args (after those already there) and e->keywords.
    Status ParseArgs(Expr* e) {
        KV_RETURN_IF_ERROR(Expect("("));
        bool first = true;
        while (!SkipOp(")")) {
            if (!first) {
                KV_RETURN_IF_ERROR(Expect(","));
                if (SkipOp(")")) break;
            }
            first = false;
            if (Peek().type == T::kName && IsOp("=", 1)) {
                std::string key = Next().text;
                Next();
                KV_ASSIGN_OR_RETURN(ExprPtr v, ParseExpr());
                e->keywords.emplace_back(std::move(key), std::move(v));
            } else {
                if (!e->keywords.empty()) {
                    return Error(Peek().pos, "a positional argument after a keyword argument");
                }
                KV_ASSIGN_OR_RETURN(ExprPtr v, ParseExpr());
                e->args.push_back(std::move(v));
            }
        }
        return Status::Ok();
    }

    Result<ExprPtr> ParsePostfix(ExprPtr e) {
        while (true) {
            if (IsOp(".")) {
                const size_t pos = Next().pos;
                if (Peek().type == T::kInt) {
                    ExprPtr key = Node(Expr::Kind::kLiteral, Peek().pos);
                    key->value = Next().number;
                    e = Node(Expr::Kind::kItem, pos, std::move(e), std::move(key));
                    continue;
                }
                KV_ASSIGN_OR_RETURN(std::string name, ExpectName());
                e = Node(Expr::Kind::kAttr, pos, std::move(e));
                e->name = std::move(name);
            } else if (IsOp("[")) {
                KV_ASSIGN_OR_RETURN(e, ParseSubscript(std::move(e)));
            } else if (IsOp("(")) {
                KV_ASSIGN_OR_RETURN(e, ParseCall(std::move(e)));
            } else {
                return e;
            }
        }
    }

    Result<ExprPtr> ParseSubscript(ExprPtr e) {
        const size_t pos = Next().pos;  // '['
        ExprPtr parts[3];
        int colons = 0;
        while (!IsOp("]")) {
            if (SkipOp(":")) {
                if (++colons > 2) return Error(Peek().pos, "a slice has at most two ':'");
                continue;
            }
            if (parts[colons]) return Error(Peek().pos, "expected ']'" + Found());
            KV_ASSIGN_OR_RETURN(parts[colons], ParseExpr());
        }
        Next();
        if (colons == 0) {
            if (!parts[0]) return Error(pos, "an empty subscript");
            return Node(Expr::Kind::kItem, pos, std::move(e), std::move(parts[0]));
        }
        ExprPtr s = Node(Expr::Kind::kSlice, pos, std::move(e));
        for (ExprPtr& p : parts) s->args.push_back(std::move(p));
        return s;
    }

    Result<ExprPtr> ParsePrimary() {
        const Token& t = Peek();
        const size_t pos = t.pos;
        switch (t.type) {
            case T::kName: {
                Next();
                ExprPtr e = Node(Expr::Kind::kLiteral, pos);
                if (t.text == "true" || t.text == "True") {
                    e->value = Value::Bool(true);
                } else if (t.text == "false" || t.text == "False") {
                    e->value = Value::Bool(false);
                } else if (t.text == "none" || t.text == "None") {
                    e->value = Value::None();
                } else {
                    e->kind = Expr::Kind::kName;
                    e->name = t.text;
                }
                return e;
            }
            case T::kString: {
                std::string s;
                while (Peek().type == T::kString) s += Next().text;  // adjacent literals join
                ExprPtr e = Node(Expr::Kind::kLiteral, pos);
                e->value = Value::String(std::move(s));
                return e;
            }
            case T::kInt:
            case T::kFloat: {
                ExprPtr e = Node(Expr::Kind::kLiteral, pos);
                e->value = Next().number;
                return e;
            }
            case T::kOp:
                if (t.text == "(") return ParseParens();
                if (t.text == "[") return ParseSequence(Expr::Kind::kList, "]");
                if (t.text == "{") return ParseDict();
                break;
            case T::kText:
            case T::kVarBegin:
            case T::kVarEnd:
            case T::kBlockBegin:
            case T::kBlockEnd:
            case T::kEof:
                break;
        }
        return Error(pos, "expected an expression" + Found());
    }

    Result<ExprPtr> ParseParens() {
        const size_t pos = Next().pos;
        if (SkipOp(")")) return Node(Expr::Kind::kTuple, pos);
        KV_ASSIGN_OR_RETURN(ExprPtr e, ParseExpr());
        if (SkipOp(")")) return e;
        ExprPtr tuple = Node(Expr::Kind::kTuple, pos, std::move(e));
        while (SkipOp(",")) {
            if (IsOp(")")) break;
            KV_ASSIGN_OR_RETURN(ExprPtr item, ParseExpr());
            tuple->args.push_back(std::move(item));
        }
        KV_RETURN_IF_ERROR(Expect(")"));
        return tuple;
    }

    Result<ExprPtr> ParseSequence(Expr::Kind kind, std::string_view close) {
        ExprPtr e = Node(kind, Next().pos);
        while (!SkipOp(close)) {
            if (!e->args.empty()) {
                KV_RETURN_IF_ERROR(Expect(","));
                if (SkipOp(close)) break;
            }
            KV_ASSIGN_OR_RETURN(ExprPtr item, ParseExpr());
            e->args.push_back(std::move(item));
        }
        return e;
    }

    Result<ExprPtr> ParseDict() {
        ExprPtr e = Node(Expr::Kind::kDict, Next().pos);
        while (!SkipOp("}")) {
            if (!e->args.empty()) {
                KV_RETURN_IF_ERROR(Expect(","));
                if (SkipOp("}")) break;
            }
            KV_ASSIGN_OR_RETURN(ExprPtr key, ParseExpr());
            KV_RETURN_IF_ERROR(Expect(":"));
            KV_ASSIGN_OR_RETURN(ExprPtr value, ParseExpr());
            e->args.push_back(std::move(key));
            e->args.push_back(std::move(value));
        }
        return e;
    }

    const std::string& src_;
    std::vector<Token> tokens_;
    size_t i_ = 0;
    int depth_ = 0;
};

}  // namespace

Result<std::shared_ptr<const Template>> Parse(std::string_view source) {
    auto t = std::make_shared<Template>();
    // jinja2 normalises newlines and drops one trailing newline (keep_trailing_newline=False).
    t->source.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
        if (source[i] == '\r') {
            t->source += '\n';
            if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
        } else {
            t->source += source[i];
        }
    }
    if (!t->source.empty() && t->source.back() == '\n') t->source.pop_back();
    KV_ASSIGN_OR_RETURN(std::vector<Token> tokens, Lex(t->source));
    KV_ASSIGN_OR_RETURN(t->body, Parser(t->source, std::move(tokens)).Run());
    return std::shared_ptr<const Template>(std::move(t));
}

}  // namespace kvshard::jinja
