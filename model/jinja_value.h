// jinja::Value: the values a chat template computes with, as Python's jinja2 sees them.
//
// Strings remember which of their bytes came from the request (message content, tool
// definitions, call arguments) rather than from the template: those bytes are "literal" and the
// prompt encodes them as plain text, so that special-token text a user writes stays text
// (TextPiece::literal). Substrings (slices, strip, split) keep the marks byte for byte; any other
// transformation of a string holding literal bytes (replace, upper, tojson) marks all of its
// result literal.
//
// Lists, dicts and namespaces are shared by reference, as in Python (a namespace's attributes
// set inside a loop are seen after it). Dict keys are strings; dicts keep insertion order.
// Undefined is jinja2's default Undefined: it prints as "", is false, iterates as empty, and
// fails when an attribute, item or arithmetic of it is asked for.
//
// Thread-safety: a Value and everything it shares belong to one render.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "model/tokenizer.h"

namespace kvshard::jinja {

// How deep values may nest before printing, comparing or converting them gives up (a template
// can build deeper ones, or a namespace holding itself).
inline constexpr int kMaxNesting = 64;
// How deep a value a template may store in a variable (jinja_eval.cc): deeper ones could
// exhaust the stack when they are freed.
inline constexpr int kMaxStoredDepth = 256;

// [begin, end) byte ranges of a string that are literal, sorted and disjoint.
using LiteralSpans = std::vector<std::pair<size_t, size_t>>;

class Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;

// Arguments of a call: positional, then keyword.
struct CallArgs {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> keyword;

    // The keyword argument `name`, else positional `index`, else nullptr.
    const Value* Get(size_t index, std::string_view name) const;
};
using Function = std::function<Result<Value>(CallArgs& args)>;

class Value {
  public:
    enum class Kind {
        kUndefined,
        kNone,
        kBool,
        kInt,
        kFloat,
        kString,
        kList,
        kDict,
        kNamespace,
        kFunction
    };

    Value() = default;  // undefined
    // `why`: the jinja2-style message an error reports when the value is used ("'x' is
    // undefined", "'dict object' has no attribute 'y'").
    static Value Undefined(std::string why);
    static Value None();
    static Value Bool(bool b);
    static Value Int(int64_t i);
    static Value Float(double f);
    static Value String(std::string s, LiteralSpans spans = {});
    static Value LiteralString(std::string s);  // every byte literal
    static Value NewList(List items = {});
    static Value NewDict(Dict items = {});
    static Value NewNamespace(Dict items = {});
    static Value NewFunction(Function fn);
    // From request JSON; every string in it (keys excepted) is literal when `literal`.
    // REQUIRES: JsonDepth(j) <= kMaxNesting.
    static Value FromJson(const nlohmann::ordered_json& j, bool literal);

    Kind kind() const { return kind_; }
    // Levels of lists and dicts inside (0 for a scalar), as built; a namespace counts as one
    // level whatever it holds later (jinja_eval.cc keeps namespaces out of namespaces).
    int depth() const { return depth_; }
    bool is_undefined() const { return kind_ == Kind::kUndefined; }
    bool is_none() const { return kind_ == Kind::kNone; }
    bool is_string() const { return kind_ == Kind::kString; }
    bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat; }
    bool is_list() const { return kind_ == Kind::kList; }
    bool is_mapping() const { return kind_ == Kind::kDict || kind_ == Kind::kNamespace; }

    bool b() const { return b_; }
    int64_t i() const { return i_; }
    double f() const { return kind_ == Kind::kInt ? static_cast<double>(i_) : f_; }
    const std::string& str() const { return s_; }
    const LiteralSpans& spans() const { return spans_; }
    bool HasLiteral() const { return !spans_.empty(); }
    const std::string& undefined_name() const { return s_; }  // the `why`
    List& list() const { return *list_; }
    Dict& dict() const { return *dict_; }
    const Function& function() const { return *fn_; }

    // Python truthiness.
    bool Truthy() const;
    // The dict's (or namespace's) value of `key`, or nullptr.
    Value* Find(std::string_view key) const;
    // Sets `key` of a dict or namespace (appending a new key).
    void Set(const std::string& key, Value v) const;

    // Python's str() of the value as jinja2 prints it ("" for undefined and none prints "None").
    // Strings keep their spans; other values are literal when any string inside is.
    Value ToStr() const;
    // json.dumps(value, ensure_ascii=False, indent, separators, sort_keys) as HF's tojson
    // filter calls it. InvalidArgument for undefined and functions.
    Result<std::string> ToJson(int indent, std::string_view item_sep, std::string_view key_sep,
                               bool sort_keys) const;
    // True when any string reachable from the value has literal bytes (also when the value
    // nests deeper than kMaxNesting).
    bool ContainsLiteral() const;

    // Python ==, for the kinds templates compare (false past kMaxNesting levels).
    friend bool operator==(const Value& a, const Value& b);
    // Python's type name, for error messages ("str", "list", "dict", "undefined").
    std::string_view TypeName() const;

  private:
    bool ContainsLiteralAt(int depth) const;
    static bool Equal(const Value& a, const Value& b, int depth);

    Kind kind_ = Kind::kUndefined;
    uint16_t depth_ = 0;
    bool b_ = false;
    int64_t i_ = 0;
    double f_ = 0;
    std::string s_;  // a string, or the message of an undefined value
    LiteralSpans spans_;
    std::shared_ptr<List> list_;
    std::shared_ptr<Dict> dict_;
    std::shared_ptr<Function> fn_;
};

// Nesting depth of a JSON value (a scalar is 0), counted no further than limit + 1.
int JsonDepth(const nlohmann::ordered_json& j, int limit = kMaxNesting);

// Text assembled with literal marks: output of a render and the operands of string operations.
class MarkedText {
  public:
    void Append(const std::string& text, const LiteralSpans& spans);
    void Append(const Value& string_value) { Append(string_value.str(), string_value.spans()); }
    void AppendMarkup(std::string_view text);
    const std::string& text() const { return text_; }
    const LiteralSpans& spans() const { return spans_; }
    Value ToValue() && { return Value::String(std::move(text_), std::move(spans_)); }
    std::vector<TextPiece> Pieces() const;

  private:
    std::string text_;
    LiteralSpans spans_;
};

// Bytes [begin, end) of a string, spans kept.
Value Substr(const Value& s, size_t begin, size_t end);
// A string made from others (replace, upper, join): literal throughout if any source is.
Value Derived(std::string text, bool literal);

}  // namespace kvshard::jinja
