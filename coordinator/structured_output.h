// Structured outputs on the OpenAI routes: the request fields that hold a choice's text to a
// grammar (grammar/compilers.h), read into one compiled grammar.
//
//   chat:  response_format {"type": "json_object"} | {"type": "json_schema", "json_schema":
//          {"name", "schema", "strict"}} | {"type": "text"}
//   both:  vLLM's guided_json (a schema, or its JSON text), guided_regex, guided_choice,
//          guided_grammar (GBNF), and structured_outputs {"json" | "regex" | "choice" |
//          "grammar" | "json_object": true}
//
// At most one of them per request. Grammars are GBNF only (Lark EBNF, which vLLM also takes, is
// refused saying so); structured_outputs.structural_tag is refused by name. Errors name the field
// and, for a schema, the keyword path ("response_format.json_schema.schema.properties.age.not").
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/status.h"
#include "grammar/grammar.h"

namespace kvshard {

struct StructuredOutput {
    std::shared_ptr<const grammar::Grammar> grammar;  // null: none asked for
};

// `chat`: response_format is read too. On error, *param is the field to name.
Result<StructuredOutput> ReadStructuredOutput(const nlohmann::json& body, bool chat,
                                              std::string* param);

// The Responses API's text.format: {"type": "text"} | {"type": "json_object"} |
// {"type": "json_schema", "name", "schema", "strict", "description"} (the schema beside the type,
// not nested as on chat). On error, *param is the field to name ("text.format.schema....").
Result<StructuredOutput> ReadTextFormat(const nlohmann::json& format, std::string* param);

}  // namespace kvshard
