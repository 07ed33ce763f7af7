#include "common/host_port.h"

#include <charconv>

namespace kvshard {

Result<HostPort> ParseHostPort(std::string_view text) {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos || colon == 0 || colon + 1 == text.size()) {
        return InvalidArgument("'" + std::string(text) + "' is not HOST:PORT");
    }
    std::string_view host = text.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
        host = host.substr(1, host.size() - 2);
    }
    const std::string_view port_text = text.substr(colon + 1);
    unsigned port = 0;
    const auto [end, ec] =
        std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
    if (ec != std::errc() || end != port_text.data() + port_text.size() || port == 0 ||
        port > 65535) {
        return InvalidArgument("'" + std::string(text) + "': port '" + std::string(port_text) +
                               "' is not a number in 1..65535");
    }
    return HostPort{std::string(host), static_cast<uint16_t>(port)};
}

}  // namespace kvshard
