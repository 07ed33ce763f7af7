// kvshard's Jinja interpreter (model/jinja_*.h) on its own: whitespace control as HF's
// environment sets it, jinja2's expression semantics, errors that name the template position,
// and the bounds that keep a hostile template from hanging or exhausting the server. Expected
// texts are jinja2 3.1's output for the same template and context.
#include <gtest/gtest.h>

#include <string>

#include "model/jinja_eval.h"
#include "model/jinja_parser.h"

namespace kvshard::jinja {
namespace {

Result<std::string> RenderText(const std::string& source, const RenderLimits& limits = {}) {
    KV_ASSIGN_OR_RETURN(auto tmpl, Parse(source));
    Dict context = {
        {"messages", Value::NewList({Value::NewDict({{"role", Value::String("user")},
                                                     {"content", Value::LiteralString(" Hi ")}}),
                                     Value::NewDict({{"role", Value::String("assistant")},
                                                     {"content", Value::String("Yo")}})})},
        {"flag", Value::Bool(true)},
        {"n", Value::Int(3)},
    };
    KV_ASSIGN_OR_RETURN(MarkedText text, Render(*tmpl, context, limits));
    return text.text();
}

TEST(Jinja, RendersAsJinja2) {
    struct Case {
        const char* source;
        const char* expected;
    };
    const Case cases[] = {
        // trim_blocks drops the newline after a block tag; lstrip_blocks the indent before it.
        {"{% if flag %}\n    yes\n    {% endif %}\nend", "    yes\nend"},
        {"a  {%- if flag -%}  b  {%- endif %}", "ab"},
        {"a {{- ' b ' -}} c", "a b c"},
        {"{%+ if flag %}x{% endif %}", "x"},
        {"  {# comment #}\nx", "x"},
        {"line\n", "line"},  // keep_trailing_newline=False
        {"{% for m in messages %}{{ loop.index0 }}{{ m.role[0] }}{% if not loop.last %},"
         "{% endif %}{% endfor %}",
         "0u,1a"},
        {"{% for m in messages if m.role == 'assistant' %}{{ loop.length }}{{ m.content }}"
         "{% else %}none{% endfor %}",
         "1Yo"},
        {"{% for x in [] %}x{% else %}empty{% endfor %}", "empty"},
        {"{% for k, v in {'a': 1, 'b': [2]}.items() %}{{ k }}={{ v }};{% endfor %}", "a=1;b=[2];"},
        {"{% set ns = namespace(c=0) %}{% for m in messages %}{% set ns.c = ns.c + 1 %}"
         "{% endfor %}{{ ns.c }}",
         "2"},
        {"{% set x = 1 %}{% for m in messages %}{% set x = 5 %}{% endfor %}{{ x }}", "1"},
        {"{{ messages[0].content | trim }}|{{ messages[0]['content'].strip() }}|", "Hi|Hi|"},
        {"{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }}", "['a', 'b', '', 'c'] ['a', 'b']"},
        {"{{ 'abc'[::-1] }}{{ [1, 2, 3][1:] }}{{ 'hello'[-3:] }}", "cba[2, 3]llo"},
        {"{{ {'b': 1, 'a': [1, 'x', none, true]} | tojson }}",
         "{\"b\": 1, \"a\": [1, \"x\", null, true]}"},
        {"{{ {'a': {'b': 1}} | tojson(indent=2) }}", "{\n  \"a\": {\n    \"b\": 1\n  }\n}"},
        {"{{ 'é\"\n' | tojson }}", "\"é\\\"\\n\""},
        {"{{ undefined_thing }}|{{ undefined_thing is defined }}|{{ none }}|{{ n is number }}",
         "|False|None|True"},
        {"{{ messages | selectattr('role', 'equalto', 'user') | list | length }}", "1"},
        {"{{ messages | map(attribute='role') | join(', ') }}", "user, assistant"},
        {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 ~ 'x' }}",
         "3 -4 1 3.5 1024 1x"},
        {"{{ 1 < n <= 3 }} {{ 'b' in 'abc' }} {{ 'q' not in ['a'] }} {{ 3 if n > 5 else 4 }}",
         "True True True 4"},
        {"{{ n is divisibleby 3 }} {{ 'AB' is upper }} {{ [] is iterable }}", "True True True"},
        {"{% macro greet(name, p='!') %}hi {{ name }}{{ p }}{% endmacro %}{{ greet('x') }}"
         "{{ greet('y', p='?') }}",
         "hi x!hi y?"},
        {"{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}"
         "{% break %}{% endif %}{{ i }}{% endfor %}",
         "02"},
        {"{% set block %}in{{ n }}{% endset %}{{ block | upper }}", "IN3"},
        {"{{ 'x' if flag }}{{ 'y' if not flag }}", "x"},
        {"{{ messages[5] is defined }}{{ messages[0].nope is defined }}", "FalseFalse"},
        {"{{ 'a' 'b' }}{{ '\\u00e9' }}", "abé"},
        {"{{ [1, 2] + [3] }}{{ 'ab' * 2 }}{{ messages[-1]['content'] | default('d') }}",
         "[1, 2, 3]ababYo"},
        {"{{ {'x': 1}.get('y', 'z') }}{{ 'Hello'.startswith('He') }}{{ 'Ab'.lower() }}", "zTrueab"},
    };
    for (const Case& c : cases) {
        Result<std::string> out = RenderText(c.source);
        ASSERT_TRUE(out.ok()) << c.source << ": " << out.status().ToString();
        EXPECT_EQ(*out, c.expected) << c.source;
    }
}

// Using an undefined value where jinja2 fails, raise_exception, unknown filters and syntax
// errors each give one line naming the position.
TEST(Jinja, ErrorsNameThePosition) {
    struct Case {
        const char* source;
        const char* message_part;
    };
    const Case cases[] = {
        {"ok\n{{ nothing.attr }}", "line 2 column 11: 'nothing' is undefined"},
        {"{{ raise_exception('roles must alternate') }}", "roles must alternate"},
        {"{{ 1 + 'a' }}", "unsupported operand types for +"},
        {"{{ x | frobnicate }}", "the filter 'frobnicate' is not supported"},
        {"{% if %}", "line 1 column 7: expected an expression"},
        {"{% for x in y %}", "the template ends inside a block (expected 'endfor')"},
        {"{{ 'open }}", "a string that is never closed"},
        {"{% include 'x' %}", "the tag 'include' is not supported"},
        {"{{ 1 // 0 }}", "division by zero"},
        {"{{ messages.append(1) }}", "'list object' has no attribute 'append'"},
    };
    for (const Case& c : cases) {
        Result<std::string> out = RenderText(c.source);
        ASSERT_FALSE(out.ok()) << c.source;
        EXPECT_NE(out.status().message().find(c.message_part), std::string::npos)
            << c.source << ": " << out.status().message();
        EXPECT_EQ(out.status().message().find('\n'), std::string::npos) << c.source;
    }
}

// Hostile templates stop at a bound instead of hanging or growing without end.
TEST(Jinja, BoundsHostileTemplates) {
    RenderLimits limits;
    limits.max_steps = 100'000;
    limits.max_output_bytes = 1 << 20;
    limits.max_work_bytes = 8 << 20;
    const char* hostile[] = {
        // Quadratic loops.
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        // Doubling a string.
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        // Output flood.
        "{% for i in range(90000) %}{{ 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa' }}{% endfor %}",
        // Huge repetition and ranges.
        "{{ 'x' * 1000000000000 }}",
        "{{ range(10000000000) | length }}",
        // Unbounded macro recursion.
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    };
    for (const char* source : hostile) {
        Result<std::string> out = RenderText(source, limits);
        ASSERT_FALSE(out.ok()) << source;
        EXPECT_EQ(out.status().code(), StatusCode::kResourceExhausted)
            << source << ": " << out.status().ToString();
    }
    // Values nested deeper than kMaxNesting (a namespace holding itself, lists in lists) print,
    // compare and test for request text without recursing without end; tojson refuses them.
    Result<std::string> nested = RenderText(
        "{% set ns = namespace(x=[]) %}{% for i in range(200) %}{% set ns.x = [ns.x] %}"
        "{% endfor %}{{ ns.x | string | length > 0 }}{{ ns.x == ns.x }}{{ ns.x ~ '' != '' }}",
        limits);
    ASSERT_TRUE(nested.ok()) << nested.status().ToString();
    EXPECT_EQ(*nested, "TrueTrueTrue");
    // Deeper values cannot be stored (freeing them could exhaust the stack), and a namespace
    // cannot hold one (it could hold itself, a cycle never freed).
    Result<std::string> deeper = RenderText(
        "{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}"
        "{% endfor %}",
        limits);
    EXPECT_EQ(deeper.status().code(), StatusCode::kResourceExhausted) << deeper.status().ToString();
    Result<std::string> cycle =
        RenderText("{% set ns = namespace(a=1) %}{% set ns.me = [ns] %}", limits);
    ASSERT_FALSE(cycle.ok());
    EXPECT_NE(cycle.status().message().find("namespace in a namespace"), std::string::npos);
    // Deep nesting is refused at parse time, before the stack could overflow.
    std::string deep(100000, '(');
    EXPECT_FALSE(Parse("{{ " + deep + " }}").ok());
    std::string blocks;
    for (int i = 0; i < 5000; ++i) blocks += "{% if flag %}";
    EXPECT_FALSE(Parse(blocks).ok());
}

// Request text keeps its literal marks through slicing, strip and concatenation.
TEST(Jinja, LiteralMarksFollowTheText) {
    auto tmpl = Parse("<{{ messages[0].content.strip() + '|' + messages[0].content[1:2] }}>");
    ASSERT_TRUE(tmpl.ok());
    Dict context = {
        {"messages",
         Value::NewList({Value::NewDict({{"content", Value::LiteralString(" ab ")}})})}};
    Result<MarkedText> out = Render(**tmpl, context, {});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    const std::vector<TextPiece> pieces = out->Pieces();
    ASSERT_EQ(pieces.size(), 5u);
    EXPECT_EQ(pieces[0].text, "<");
    EXPECT_FALSE(pieces[0].literal);
    EXPECT_EQ(pieces[1].text, "ab");
    EXPECT_TRUE(pieces[1].literal);
    EXPECT_EQ(pieces[2].text, "|");
    EXPECT_FALSE(pieces[2].literal);
    EXPECT_EQ(pieces[3].text, "a");
    EXPECT_TRUE(pieces[3].literal);
    EXPECT_EQ(pieces[4].text, ">");
}

}  // namespace
}  // namespace kvshard::jinja
