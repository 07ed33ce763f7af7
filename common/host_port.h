// "HOST:PORT" addresses, as the command line (`kvshard worker --coordinator`) and the KV
// transports' endpoints spell them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvshard {

struct HostPort {
    std::string host;   // without the brackets of "[v6]:PORT"
    uint16_t port = 0;  // 1..65535
};

// Splits `text` at its last colon, so an IPv6 host keeps its colons ("::1:9000", "[::1]:9000";
// brackets around the host are dropped). InvalidArgument naming `text` unless the host is
// non-empty and the port a decimal number in 1..65535; callers add what the address was for
// (Status::WithContext).
Result<HostPort> ParseHostPort(std::string_view text);

}  // namespace kvshard
