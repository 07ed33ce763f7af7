#include "comm/tcp_listen.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kvshard::internal {

Status ListenOn(boost::asio::ip::tcp::acceptor& acceptor, const std::string& host, uint16_t port) {
    using tcp = boost::asio::ip::tcp;
    const std::string where = host + ":" + std::to_string(port);
    boost::system::error_code ec;
    tcp::resolver resolver(acceptor.get_executor());
    const auto endpoints = resolver.resolve(host, std::to_string(port), tcp::resolver::passive, ec);
    if (ec || endpoints.empty())
        return Unavailable("listen on " + where + ": cannot resolve: " + ec.message());
    const tcp::endpoint endpoint = *endpoints.begin();
    // Opened here rather than by acceptor.open(), which leaves the socket inheritable: a worker
    // process spawned by this one must not hold the coordinator's listening socket (it would keep
    // the port bound after the coordinator exits, and could accept its connections).
    const int fd = ::socket(endpoint.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC,
                            endpoint.protocol().protocol());
    if (fd < 0) return Unavailable("listen on " + where + ": socket: " + std::strerror(errno));
    acceptor.assign(endpoint.protocol(), fd, ec);
    if (ec) {
        ::close(fd);
        return Unavailable("listen on " + where + ": " + ec.message());
    }
    acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind(endpoint, ec);
    if (!ec) acceptor.listen(boost::asio::socket_base::max_listen_connections, ec);
    if (ec) return Unavailable("listen on " + where + ": " + ec.message());
    return Status::Ok();
}

}  // namespace kvshard::internal
