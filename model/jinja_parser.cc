#include "model/jinja_parser.h"

#include <algorithm>
#include <cstring>

#include "model/jinja_expr_parser.h"

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

// The statement half: a template's body of text, output and block tags.
class Parser : public ExprParser {
  public:
    using ExprParser::ExprParser;

    Result<Body> Run() {
        std::string end;
        KV_ASSIGN_OR_RETURN(Body body, ParseBody({}, &end));
        return body;
    }

  private:
    Status ExpectBlockEnd() {
        if (Peek().type == T::kBlockEnd) {
            Next();
            return Status::Ok();
        }
        return Error(Peek().pos, "expected the end of the tag ('%}')" + Found());
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
