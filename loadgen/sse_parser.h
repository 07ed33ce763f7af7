// SseParser: splits a server-sent event stream into the data of each event. Bytes may arrive cut
// anywhere; events end with a blank line ("\n\n" or "\r\n\r\n"); the "data:" lines of an event
// are joined with "\n" (the SSE rules); other fields (event:, id:, comments) are ignored.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kvshard::loadgen {

class SseParser {
  public:
    // Appends bytes and returns the data of every event they complete, in order.
    std::vector<std::string> Feed(std::string_view bytes);

  private:
    std::string pending_;
};

}  // namespace kvshard::loadgen
