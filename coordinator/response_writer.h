// ResponseWriter: how the answer of one generation is written in its API's format (OpenAI chat
// and completions, openai_response.h; Anthropic Messages, anthropic_response.h), streamed as
// server-sent events or collected into one JSON body. HttpSession drives it from the engine's
// deltas and never looks inside.
//
// Thread-safety: none; one session uses it at a time.
#pragma once

#include <string>

#include "coordinator/engine_api.h"
#include "coordinator/openai_protocol.h"

namespace kvshard {

class ResponseWriter {
  public:
    virtual ~ResponseWriter() = default;

    // A streamed answer: the bytes to send before any delta, for each delta ("" when it shows
    // nothing yet), at the end, and for an error in the middle of the stream.
    virtual std::string StreamStart() = 0;
    virtual std::string StreamDelta(const GenerationDelta& delta) = 0;
    virtual std::string StreamFinish(const GenerationUsage& usage) = 0;
    virtual std::string StreamError(const ApiError& error) = 0;

    // A whole answer: the deltas, then the body.
    virtual void Add(const GenerationDelta& delta) = 0;
    virtual std::string Body(const GenerationUsage& usage) = 0;
};

}  // namespace kvshard
