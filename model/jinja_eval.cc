#include "model/jinja_eval.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "model/jinja_builtins.h"
#include "model/jinja_operators.h"

namespace kvshard::jinja {
namespace {

enum class Flow { kNormal, kBreak, kContinue };

// REQUIRES: v.depth() <= kMaxStoredDepth (the recursion is bounded by it).
bool HoldsNamespace(const Value& v) {
    switch (v.kind()) {
        case Value::Kind::kNamespace:
            return true;
        case Value::Kind::kList:
            return std::any_of(v.list().begin(), v.list().end(), HoldsNamespace);
        case Value::Kind::kDict:
            return std::any_of(v.dict().begin(), v.dict().end(),
                               [](const auto& kv) { return HoldsNamespace(kv.second); });
        case Value::Kind::kUndefined:
        case Value::Kind::kNone:
        case Value::Kind::kBool:
        case Value::Kind::kInt:
        case Value::Kind::kFloat:
        case Value::Kind::kString:
        case Value::Kind::kFunction:
            return false;
    }
    return false;
}

class Renderer {
  public:
    Renderer(const Template& tmpl, const Dict& context, const RenderLimits& limits)
        : tmpl_(tmpl), limits_(limits), budget_(limits.max_work_bytes) {
        scopes_.emplace_back();
        for (const auto& [k, v] : context) scopes_.back()[k] = v;
        scopes_.emplace_back();  // the template's own assignments
        out_.emplace_back();
    }

    Result<MarkedText> Run() {
        KV_ASSIGN_OR_RETURN(Flow flow, ExecBody(tmpl_.body));
        (void)flow;
        return std::move(out_.back());
    }

  private:
    // An error of the template at `pos`, one line.
    Status Error(size_t pos, const std::string& what) const {
        return InvalidArgument("chat template error at " + Position(tmpl_.source, pos) + ": " +
                               what);
    }
    // Adds the position to an error from a builtin, once.
    Status At(size_t pos, const Status& s) const {
        if (s.ok() || s.message().rfind("chat template", 0) == 0) return s;
        return Status(s.code(),
                      "chat template error at " + Position(tmpl_.source, pos) + ": " + s.message());
    }
    // An operator's error (jinja_operators.h) at the expression's position; a spent budget as
    // it is.
    Result<Value> Positioned(size_t pos, Result<Value> r) const {
        if (r.ok() || r.status().code() != StatusCode::kInvalidArgument) return r;
        return Error(pos, r.status().message());
    }
    Status Step(size_t pos) {
        if (++steps_ > limits_.max_steps) {
            return Status(StatusCode::kResourceExhausted,
                          "chat template stopped at " + Position(tmpl_.source, pos) +
                              ": it ran more than " + std::to_string(limits_.max_steps) + " steps");
        }
        return Status::Ok();
    }

    Value Lookup(const std::string& name) const {
        for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
            auto found = it->find(name);
            if (found != it->end()) return found->second;
        }
        Value builtin = GlobalFunction(name, const_cast<Budget*>(&budget_));
        if (!builtin.is_undefined()) return builtin;
        return Value::Undefined("'" + name + "' is undefined");
    }

    Status Emit(size_t pos, const Value& v) {
        const Value s = v.ToStr();
        out_.back().Append(s);
        if (out_.back().text().size() > limits_.max_output_bytes) {
            return Status(StatusCode::kResourceExhausted,
                          "chat template stopped at " + Position(tmpl_.source, pos) +
                              ": its output passed " + std::to_string(limits_.max_output_bytes) +
                              " bytes");
        }
        return Status::Ok();
    }

    Result<Flow> ExecBody(const Body& body) {
        for (const auto& s : body) {
            KV_ASSIGN_OR_RETURN(Flow flow, Exec(*s));
            if (flow != Flow::kNormal) return flow;
        }
        return Flow::kNormal;
    }

    Result<Flow> Exec(const Stmt& s) {
        KV_RETURN_IF_ERROR(Step(s.pos));
        switch (s.kind) {
            case Stmt::Kind::kText:
                KV_RETURN_IF_ERROR(Emit(s.pos, Value::String(s.text)));
                return Flow::kNormal;
            case Stmt::Kind::kOutput: {
                KV_ASSIGN_OR_RETURN(Value v, Eval(*s.expr));
                KV_RETURN_IF_ERROR(Emit(s.pos, v));
                return Flow::kNormal;
            }
            case Stmt::Kind::kIf:
                for (size_t i = 0; i < s.conditions.size(); ++i) {
                    KV_ASSIGN_OR_RETURN(Value c, Eval(*s.conditions[i]));
                    if (c.Truthy()) return ExecBody(s.bodies[i]);
                }
                if (s.bodies.size() > s.conditions.size()) return ExecBody(s.bodies.back());
                return Flow::kNormal;
            case Stmt::Kind::kFor:
                KV_RETURN_IF_ERROR(ExecFor(s));
                return Flow::kNormal;
            case Stmt::Kind::kSet:
                KV_RETURN_IF_ERROR(ExecSet(s));
                return Flow::kNormal;
            case Stmt::Kind::kMacro:
                scopes_.back()[s.text] = MakeMacro(s);
                return Flow::kNormal;
            case Stmt::Kind::kBreak:
                if (loops_ == 0) return Error(s.pos, "'break' outside a loop");
                return Flow::kBreak;
            case Stmt::Kind::kContinue:
                if (loops_ == 0) return Error(s.pos, "'continue' outside a loop");
                return Flow::kContinue;
            case Stmt::Kind::kBlock:
                return ExecBody(s.bodies[0]);
        }
        return Flow::kNormal;
    }

    Status Bind(const Stmt& s, const Value& item) {
        auto& scope = scopes_.back();
        if (s.targets.size() == 1) {
            scope[s.targets[0]] = item;
            return Status::Ok();
        }
        if (!item.is_list() || item.list().size() != s.targets.size()) {
            return Error(s.pos, "cannot unpack a " + std::string(item.TypeName()) + " into " +
                                    std::to_string(s.targets.size()) + " loop variables");
        }
        for (size_t i = 0; i < s.targets.size(); ++i) scope[s.targets[i]] = item.list()[i];
        return Status::Ok();
    }

    Status ExecFor(const Stmt& s) {
        KV_ASSIGN_OR_RETURN(Value iterable, Eval(*s.expr));
        Result<List> all = Iterate(iterable);
        if (!all.ok()) return At(s.expr->pos, all.status());
        List items;
        if (s.filter) {
            for (Value& item : *all) {
                scopes_.emplace_back();
                Status bound = Bind(s, item);
                Result<Value> keep = bound.ok() ? Eval(*s.filter) : Result<Value>(bound);
                scopes_.pop_back();
                if (!keep.ok()) return keep.status();
                if (keep->Truthy()) items.push_back(std::move(item));
            }
        } else {
            items = std::move(*all);
        }
        if (items.empty()) {
            if (s.bodies.size() > 1) {
                KV_ASSIGN_OR_RETURN(Flow flow, ExecBody(s.bodies[1]));
                (void)flow;
            }
            return Status::Ok();
        }
        const int64_t n = static_cast<int64_t>(items.size());
        ++loops_;
        for (int64_t i = 0; i < n; ++i) {
            KV_RETURN_IF_ERROR(Step(s.pos));
            scopes_.emplace_back();
            Status bound = Bind(s, items[i]);
            if (!bound.ok()) {
                scopes_.pop_back();
                --loops_;
                return bound;
            }
            scopes_.back()["loop"] = Value::NewDict({
                {"index", Value::Int(i + 1)},
                {"index0", Value::Int(i)},
                {"revindex", Value::Int(n - i)},
                {"revindex0", Value::Int(n - i - 1)},
                {"first", Value::Bool(i == 0)},
                {"last", Value::Bool(i == n - 1)},
                {"length", Value::Int(n)},
                {"previtem", i > 0 ? items[i - 1] : Value::Undefined("there is no previous item")},
                {"nextitem", i + 1 < n ? items[i + 1] : Value::Undefined("there is no next item")},
            });
            Result<Flow> flow = ExecBody(s.bodies[0]);
            scopes_.pop_back();
            if (!flow.ok()) {
                --loops_;
                return flow.status();
            }
            if (*flow == Flow::kBreak) break;
        }
        --loops_;
        return Status::Ok();
    }

    Status ExecSet(const Stmt& s) {
        Value v;
        if (s.expr) {
            KV_ASSIGN_OR_RETURN(v, Eval(*s.expr));
        } else {
            KV_ASSIGN_OR_RETURN(v, Capture(s.bodies[0]));
        }
        if (v.depth() > kMaxStoredDepth) {
            return Status(StatusCode::kResourceExhausted,
                          "chat template stopped at " + Position(tmpl_.source, s.pos) +
                              ": it stores a value nested deeper than " +
                              std::to_string(kMaxStoredDepth) + " levels");
        }
        if (s.text.empty()) {
            scopes_.back()[s.targets[0]] = std::move(v);
            return Status::Ok();
        }
        const Value ns = Lookup(s.targets[0]);
        if (ns.kind() != Value::Kind::kNamespace) {
            return Error(s.pos, "cannot set an attribute of '" + s.targets[0] +
                                    "', which is not a namespace()");
        }
        // A namespace in a namespace could hold itself: a cycle never freed.
        if (HoldsNamespace(v)) {
            return Error(s.pos, "kvshard's chat templates cannot store a namespace in a namespace");
        }
        KV_RETURN_IF_ERROR(budget_.Charge(1));
        ns.Set(s.text, std::move(v));
        return Status::Ok();
    }

    // The output of `body` as a string.
    Result<Value> Capture(const Body& body) {
        out_.emplace_back();
        Result<Flow> flow = ExecBody(body);
        MarkedText text = std::move(out_.back());
        out_.pop_back();
        if (!flow.ok()) return flow.status();
        return std::move(text).ToValue();
    }

    Value MakeMacro(const Stmt& s) {
        return Value::NewFunction([this, &s](CallArgs& args) -> Result<Value> {
            if (call_depth_ >= limits_.max_call_depth) {
                return Status(StatusCode::kResourceExhausted,
                              "macro '" + s.text + "' calls nest deeper than " +
                                  std::to_string(limits_.max_call_depth));
            }
            if (args.positional.size() > s.targets.size()) {
                return InvalidArgument("macro '" + s.text + "' takes " +
                                       std::to_string(s.targets.size()) + " arguments");
            }
            std::unordered_map<std::string, Value> frame;
            for (size_t i = 0; i < s.targets.size(); ++i) {
                if (i < args.positional.size()) {
                    frame[s.targets[i]] = args.positional[i];
                } else if (s.defaults[i]) {
                    KV_ASSIGN_OR_RETURN(frame[s.targets[i]], Eval(*s.defaults[i]));
                } else {
                    frame[s.targets[i]] = Value::Undefined("'" + s.targets[i] + "' is undefined");
                }
            }
            for (auto& [k, v] : args.keyword) {
                if (std::find(s.targets.begin(), s.targets.end(), k) == s.targets.end()) {
                    return InvalidArgument("macro '" + s.text + "' has no parameter '" + k + "'");
                }
                frame[k] = v;
            }
            ++call_depth_;
            scopes_.push_back(std::move(frame));
            const int loops = loops_;
            loops_ = 0;
            Result<Value> out = Capture(s.bodies[0]);
            loops_ = loops;
            scopes_.pop_back();
            --call_depth_;
            return out;
        });
    }

    Result<CallArgs> EvalArgs(const Expr& e, size_t first) {
        CallArgs args;
        for (size_t i = first; i < e.args.size(); ++i) {
            KV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i]));
            args.positional.push_back(std::move(v));
        }
        for (const auto& [k, expr] : e.keywords) {
            KV_ASSIGN_OR_RETURN(Value v, Eval(*expr));
            args.keyword.emplace_back(k, std::move(v));
        }
        return args;
    }

    Result<Value> Eval(const Expr& e) {
        KV_RETURN_IF_ERROR(Step(e.pos));
        Result<Value> v = EvalInner(e);
        if (!v.ok()) return At(e.pos, v.status());
        return v;
    }

    Result<Value> EvalInner(const Expr& e);
    Result<Value> GetAttr(const Value& obj, const std::string& name, size_t pos);
    Result<Value> GetItem(const Value& obj, const Value& key, size_t pos);
    Result<Value> EvalSlice(const Expr& e);
    Result<Value> EvalBinary(const Expr& e);
    Result<Value> EvalCompare(const Expr& e);

    const Template& tmpl_;
    const RenderLimits& limits_;
    Budget budget_;
    std::vector<std::unordered_map<std::string, Value>> scopes_;
    std::vector<MarkedText> out_;  // the innermost capture last
    int64_t steps_ = 0;
    int loops_ = 0;
    int call_depth_ = 0;
};

Result<Value> Renderer::EvalInner(const Expr& e) {
    switch (e.kind) {
        case Expr::Kind::kLiteral:
            return e.value;
        case Expr::Kind::kName:
            return Lookup(e.name);
        case Expr::Kind::kAttr: {
            KV_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
            return GetAttr(obj, e.name, e.pos);
        }
        case Expr::Kind::kItem: {
            KV_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
            KV_ASSIGN_OR_RETURN(Value key, Eval(*e.args[1]));
            return GetItem(obj, key, e.pos);
        }
        case Expr::Kind::kSlice:
            return EvalSlice(e);
        case Expr::Kind::kCall: {
            KV_ASSIGN_OR_RETURN(Value callee, Eval(*e.args[0]));
            if (callee.is_undefined()) return Error(e.pos, callee.undefined_name());
            if (callee.kind() != Value::Kind::kFunction) {
                return Error(e.pos, "a " + std::string(callee.TypeName()) + " is not callable");
            }
            KV_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1));
            return callee.function()(args);
        }
        case Expr::Kind::kFilter: {
            KV_ASSIGN_OR_RETURN(Value operand, Eval(*e.args[0]));
            KV_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1));
            return ApplyFilter(e.name, operand, args, &budget_);
        }
        case Expr::Kind::kTest: {
            KV_ASSIGN_OR_RETURN(Value operand, Eval(*e.args[0]));
            KV_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1));
            KV_ASSIGN_OR_RETURN(bool result, ApplyTest(e.name, operand, args));
            return Value::Bool(result != e.negated);
        }
        case Expr::Kind::kNeg:
        case Expr::Kind::kPos: {
            KV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
            if (v.is_undefined()) return Error(e.pos, v.undefined_name());
            const bool neg = e.kind == Expr::Kind::kNeg;
            if (v.kind() == Value::Kind::kInt) return Value::Int(neg ? -v.i() : v.i());
            if (v.kind() == Value::Kind::kFloat) return Value::Float(neg ? -v.f() : v.f());
            if (v.kind() == Value::Kind::kBool) return Value::Int(neg ? -int(v.b()) : v.b());
            return Error(e.pos, "bad operand type for unary " + std::string(neg ? "-" : "+") +
                                    ": " + std::string(v.TypeName()));
        }
        case Expr::Kind::kNot: {
            KV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0]));
            return Value::Bool(!v.Truthy());
        }
        case Expr::Kind::kAnd: {
            KV_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0]));
            if (!a.Truthy()) return a;
            return Eval(*e.args[1]);
        }
        case Expr::Kind::kOr: {
            KV_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0]));
            if (a.Truthy()) return a;
            return Eval(*e.args[1]);
        }
        case Expr::Kind::kBinary:
            return EvalBinary(e);
        case Expr::Kind::kCompare:
            return EvalCompare(e);
        case Expr::Kind::kConditional: {
            KV_ASSIGN_OR_RETURN(Value c, Eval(*e.args[0]));
            if (c.Truthy()) return Eval(*e.args[1]);
            if (e.args[2]) return Eval(*e.args[2]);
            return Value::Undefined("the conditional expression has no else branch");
        }
        case Expr::Kind::kList:
        case Expr::Kind::kTuple: {
            List items;
            for (const ExprPtr& a : e.args) {
                KV_ASSIGN_OR_RETURN(Value v, Eval(*a));
                items.push_back(std::move(v));
            }
            KV_RETURN_IF_ERROR(budget_.Charge(items.size()));
            return Value::NewList(std::move(items));
        }
        case Expr::Kind::kDict: {
            Value d = Value::NewDict();
            for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
                KV_ASSIGN_OR_RETURN(Value k, Eval(*e.args[i]));
                KV_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i + 1]));
                if (!k.is_string()) {
                    return Error(e.args[i]->pos,
                                 "kvshard's chat templates take string dict keys "
                                 "only, not a " +
                                     std::string(k.TypeName()));
                }
                d.Set(k.str(), std::move(v));
            }
            KV_RETURN_IF_ERROR(budget_.Charge(d.dict().size()));
            return d;
        }
    }
    return Error(e.pos, "unknown expression");
}

Result<Value> Renderer::GetAttr(const Value& obj, const std::string& name, size_t pos) {
    if (obj.is_undefined()) return Error(pos, obj.undefined_name());
    if (obj.is_mapping()) {
        if (const Value* v = obj.Find(name)) return *v;
    }
    if (HasMethod(obj, name)) {
        Budget* budget = &budget_;
        return Value::NewFunction(
            [obj, name, budget](CallArgs& args) { return CallMethod(obj, name, args, budget); });
    }
    const std::string type = obj.is_none() ? "None" : std::string(obj.TypeName()) + " object";
    return Value::Undefined("'" + type + "' has no attribute '" + name + "'");
}

Result<Value> Renderer::GetItem(const Value& obj, const Value& key, size_t pos) {
    if (obj.is_undefined()) return Error(pos, obj.undefined_name());
    if (std::optional<Value> item = ItemAt(obj, key)) return *std::move(item);
    if (key.is_string()) return GetAttr(obj, key.str(), pos);
    const std::string type = obj.is_none() ? "None" : std::string(obj.TypeName()) + " object";
    return Value::Undefined("'" + type + "' has no item " + std::string(key.ToStr().str()));
}

Result<Value> Renderer::EvalSlice(const Expr& e) {
    KV_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0]));
    Value bounds[3] = {Value::None(), Value::None(), Value::None()};
    for (int i = 0; i < 3; ++i) {
        if (!e.args[i + 1]) continue;
        KV_ASSIGN_OR_RETURN(bounds[i], Eval(*e.args[i + 1]));
        if (bounds[i].is_none()) continue;
        const std::optional<int64_t> index = AsIndex(bounds[i]);
        if (!index) return Error(e.pos, "slice indices must be integers or none");
        bounds[i] = Value::Int(*index);
    }
    return Positioned(e.pos, Slice(obj, bounds, &budget_));
}

Result<Value> Renderer::EvalBinary(const Expr& e) {
    KV_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0]));
    KV_ASSIGN_OR_RETURN(Value b, Eval(*e.args[1]));
    return Positioned(e.pos, BinaryOp(e.name, a, b, &budget_));
}

Result<Value> Renderer::EvalCompare(const Expr& e) {
    KV_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0]));
    for (size_t i = 0; i < e.ops.size(); ++i) {
        KV_ASSIGN_OR_RETURN(Value right, Eval(*e.args[i + 1]));
        const std::string& op = e.ops[i];
        bool r = false;
        if (op == "==") {
            r = left == right;
        } else if (op == "!=") {
            r = !(left == right);
        } else if (op == "in" || op == "notin") {
            CallArgs args;
            args.positional.push_back(right);
            KV_ASSIGN_OR_RETURN(r, ApplyTest("in", left, args));
            if (op == "notin") r = !r;
        } else {
            Result<bool> less = op[0] == '<' ? Less(left, right) : Less(right, left);
            if (!less.ok()) return Error(e.pos, less.status().message());
            r = *less || (op.size() == 2 && left == right);
        }
        if (!r) return Value::Bool(false);
        left = std::move(right);
    }
    return Value::Bool(true);
}

}  // namespace

Result<MarkedText> Render(const Template& tmpl, const Dict& context, const RenderLimits& limits) {
    return Renderer(tmpl, context, limits).Run();
}

}  // namespace kvshard::jinja
