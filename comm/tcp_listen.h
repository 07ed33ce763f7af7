// Opening a listening TCP socket, shared by the frame listener (control plane) and the TCP KV
// transport. Internal to comm/.
#pragma once

// clang-format off
#include <utility>  // Boost 1.74's asio needs it first
#include <boost/asio.hpp>
// clang-format on

#include <cstdint>
#include <string>

#include "common/status.h"

namespace kvshard::internal {

// Resolves `host` (passive), then opens (close-on-exec), binds (SO_REUSEADDR) and listens on
// `acceptor` at `port` (0: a free port; acceptor.local_endpoint() tells which). Unavailable, naming
// host and port, when any step fails.
Status ListenOn(boost::asio::ip::tcp::acceptor& acceptor, const std::string& host, uint16_t port);

}  // namespace kvshard::internal
