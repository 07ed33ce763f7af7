#include "loadgen/sse_parser.h"

namespace kvshard::loadgen {

namespace {

// The data of one event (its lines without the blank line that ended it).
std::string EventData(std::string_view event) {
    std::string data;
    bool any = false;
    size_t pos = 0;
    while (pos <= event.size()) {
        size_t end = event.find('\n', pos);
        if (end == std::string_view::npos) end = event.size();
        std::string_view line = event.substr(pos, end - pos);
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        if (line.substr(0, 5) == "data:") {
            line.remove_prefix(5);
            if (!line.empty() && line.front() == ' ') line.remove_prefix(1);
            if (any) data += '\n';
            data.append(line);
            any = true;
        }
        pos = end + 1;
    }
    return data;
}

}  // namespace

std::vector<std::string> SseParser::Feed(std::string_view bytes) {
    pending_.append(bytes);
    std::vector<std::string> events;
    size_t start = 0;
    while (true) {
        const size_t lf = pending_.find("\n\n", start);
        const size_t crlf = pending_.find("\r\n\r\n", start);
        size_t end = std::min(lf, crlf);
        if (end == std::string::npos) break;
        const size_t sep = end == crlf ? 4 : 2;
        std::string_view event(pending_.data() + start, end - start);
        if (event.find("data:") != std::string_view::npos) events.push_back(EventData(event));
        start = end + sep;
    }
    pending_.erase(0, start);
    return events;
}

}  // namespace kvshard::loadgen
