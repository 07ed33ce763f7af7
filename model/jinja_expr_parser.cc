#include "model/jinja_expr_parser.h"

#include <algorithm>
#include <cstring>

namespace kvshard::jinja {

using T = Token::Type;

const Token& ExprParser::Peek(size_t ahead) const {
    return tokens_[std::min(i_ + ahead, tokens_.size() - 1)];
}

const Token& ExprParser::Next() {
    const Token& t = Peek();
    if (i_ < tokens_.size() - 1) ++i_;
    return t;
}

bool ExprParser::IsOp(std::string_view op, size_t ahead) const {
    return Peek(ahead).type == T::kOp && Peek(ahead).text == op;
}

bool ExprParser::IsName(std::string_view name, size_t ahead) const {
    return Peek(ahead).type == T::kName && Peek(ahead).text == name;
}

bool ExprParser::SkipOp(std::string_view op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
}

Status ExprParser::Error(size_t pos, const std::string& what) const {
    return InvalidArgument("chat template syntax error at " + Position(src_, pos) + ": " + what);
}

Status ExprParser::Expect(std::string_view op) {
    if (SkipOp(op)) return Status::Ok();
    return Error(Peek().pos, "expected '" + std::string(op) + "'" + Found());
}

std::string ExprParser::Found() const {
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

Result<std::string> ExprParser::ExpectName() {
    if (Peek().type != T::kName) return Error(Peek().pos, "expected a name" + Found());
    return Next().text;
}

ExprPtr ExprParser::Node(Expr::Kind kind, size_t pos) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    return e;
}

ExprPtr ExprParser::Node(Expr::Kind kind, size_t pos, ExprPtr a, ExprPtr b) {
    ExprPtr e = Node(kind, pos);
    e->args.push_back(std::move(a));
    if (b) e->args.push_back(std::move(b));
    return e;
}

Result<ExprPtr> ExprParser::ParseExpr(bool with_condexpr) {
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

Result<ExprPtr> ExprParser::ParseKeywordChain(std::string_view keyword, Expr::Kind kind,
                                              Result<ExprPtr> (ExprParser::*next)()) {
    KV_ASSIGN_OR_RETURN(ExprPtr e, (this->*next)());
    while (IsName(keyword)) {
        const size_t pos = Next().pos;
        KV_ASSIGN_OR_RETURN(ExprPtr r, (this->*next)());
        e = Node(kind, pos, std::move(e), std::move(r));
    }
    return e;
}

Result<ExprPtr> ExprParser::ParseOr() {
    return ParseKeywordChain("or", Expr::Kind::kOr, &ExprParser::ParseAnd);
}

Result<ExprPtr> ExprParser::ParseAnd() {
    return ParseKeywordChain("and", Expr::Kind::kAnd, &ExprParser::ParseNot);
}

Result<ExprPtr> ExprParser::ParseNot() {
    if (IsName("not")) {
        DepthGuard guard(&depth_);
        if (guard.exceeded()) return Error(Peek().pos, "expressions nest too deeply");
        const size_t pos = Next().pos;
        KV_ASSIGN_OR_RETURN(ExprPtr e, ParseNot());
        return Node(Expr::Kind::kNot, pos, std::move(e));
    }
    return ParseCompare();
}

Result<ExprPtr> ExprParser::ParseCompare() {
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

Result<ExprPtr> ExprParser::ParseBinary(const std::vector<std::string_view>& ops,
                                        Result<ExprPtr> (ExprParser::*next)()) {
    KV_ASSIGN_OR_RETURN(ExprPtr e, (this->*next)());
    while (Peek().type == T::kOp && std::find(ops.begin(), ops.end(), Peek().text) != ops.end()) {
        const Token& op = Next();
        KV_ASSIGN_OR_RETURN(ExprPtr r, (this->*next)());
        ExprPtr b = Node(Expr::Kind::kBinary, op.pos, std::move(e), std::move(r));
        b->name = op.text;
        e = std::move(b);
    }
    return e;
}

Result<ExprPtr> ExprParser::ParseMath1() {
    return ParseBinary({"+", "-"}, &ExprParser::ParseConcat);
}

Result<ExprPtr> ExprParser::ParseConcat() { return ParseBinary({"~"}, &ExprParser::ParseMath2); }

Result<ExprPtr> ExprParser::ParseMath2() {
    return ParseBinary({"*", "/", "//", "%"}, &ExprParser::ParsePow);
}

Result<ExprPtr> ExprParser::ParsePow() {
    return ParseBinary({"**"}, &ExprParser::ParseUnaryFiltered);
}

Result<ExprPtr> ExprParser::ParseUnaryFiltered() { return ParseUnary(true); }

Result<ExprPtr> ExprParser::ParseUnary(bool with_filter) {
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

Result<ExprPtr> ExprParser::ParseFilter(ExprPtr operand) {
    const size_t pos = Next().pos;  // '|'
    KV_ASSIGN_OR_RETURN(std::string name, ExpectName());
    ExprPtr f = Node(Expr::Kind::kFilter, pos, std::move(operand));
    f->name = std::move(name);
    if (IsOp("(")) KV_RETURN_IF_ERROR(ParseArgs(f.get()));
    return f;
}

Result<ExprPtr> ExprParser::ParseTest(ExprPtr operand) {
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

Result<ExprPtr> ExprParser::ParseCall(ExprPtr callee) {
    ExprPtr c = Node(Expr::Kind::kCall, Peek().pos, std::move(callee));
    KV_RETURN_IF_ERROR(ParseArgs(c.get()));
    return c;
}

Status ExprParser::ParseArgs(Expr* e) {
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

Result<ExprPtr> ExprParser::ParsePostfix(ExprPtr e) {
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

Result<ExprPtr> ExprParser::ParseSubscript(ExprPtr e) {
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

Result<ExprPtr> ExprParser::ParsePrimary() {
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

Result<ExprPtr> ExprParser::ParseParens() {
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

Result<ExprPtr> ExprParser::ParseSequence(Expr::Kind kind, std::string_view close) {
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

Result<ExprPtr> ExprParser::ParseDict() {
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

}  // namespace kvshard::jinja
