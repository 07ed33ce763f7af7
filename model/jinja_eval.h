// Rendering a parsed chat template (model/jinja_parser.h) with a context of variables, as
// jinja2 renders it in HF's apply_chat_template environment.
//
// A render is bounded: its output, the steps it executes (statements and expressions), the
// bytes of strings and lists it builds, and the depth of macro calls. Past a bound it stops
// with ResourceExhausted; a template's own errors (raise_exception, using an undefined value,
// a type error) are InvalidArgument with one line naming the template position.
//
// Thread-safety: Render may run on many threads at once over one shared Template.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "model/jinja_parser.h"
#include "model/jinja_value.h"

namespace kvshard::jinja {

struct RenderLimits {
    size_t max_output_bytes = 8u << 20;
    int64_t max_steps = 2'000'000;
    size_t max_work_bytes = 64u << 20;  // strings and lists built along the way
    int max_call_depth = 32;            // macro calls within macro calls
};

// Renders `tmpl` with `context` (the template's global variables; jinja2's builtins namespace,
// range, dict and HF's raise_exception, strftime_now are added unless the context names them).
Result<MarkedText> Render(const Template& tmpl, const Dict& context, const RenderLimits& limits);

}  // namespace kvshard::jinja
