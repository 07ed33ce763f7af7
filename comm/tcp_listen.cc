#include "comm/tcp_listen.h"

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
    acceptor.open(endpoint.protocol(), ec);
    if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind(endpoint, ec);
    if (!ec) acceptor.listen(boost::asio::socket_base::max_listen_connections, ec);
    if (ec) return Unavailable("listen on " + where + ": " + ec.message());
    return Status::Ok();
}

}  // namespace kvshard::internal
