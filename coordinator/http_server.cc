#include "coordinator/http_server.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "coordinator/http_session.h"

namespace kvshard {

namespace net = boost::asio;
using tcp = net::ip::tcp;

struct HttpServer::Impl {
    Impl(const HttpConfig& c, const ApiService& a) : config(c), api(a), acceptor(io) {}

    void Accept() {
        acceptor.async_accept(
            net::make_strand(io), [this](boost::system::error_code ec, tcp::socket socket) {
                if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
                if (!ec) {
                    std::make_shared<HttpSession>(std::move(socket), api, config, gate)->Start();
                } else {
                    spdlog::warn("http: accept failed: {}", ec.message());
                }
                Accept();
            });
    }

    const HttpConfig config;
    const ApiService& api;
    std::shared_ptr<PostGate> gate = std::make_shared<PostGate>();
    net::io_context io;
    tcp::acceptor acceptor;
    std::vector<std::thread> threads;
    int port = 0;
    bool stopped = false;
};

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpConfig& config,
                                                      const ApiService& api) {
    auto impl = std::make_unique<Impl>(config, api);
    const std::string where = config.host + ":" + std::to_string(config.port);
    boost::system::error_code ec;
    // An IP address, or a name such as "localhost" (its first address).
    tcp::resolver resolver(impl->io);
    const auto resolved =
        resolver.resolve(config.host, std::to_string(config.port), tcp::resolver::passive, ec);
    if (ec || resolved.empty()) {
        return InvalidArgument("server.host '" + config.host +
                               "' is not an address this machine has" +
                               (ec ? ": " + ec.message() : ""));
    }
    const tcp::endpoint endpoint = resolved.begin()->endpoint();
    impl->acceptor.open(endpoint.protocol(), ec);
    if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) impl->acceptor.bind(endpoint, ec);
    if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
    if (ec)
        return Status(StatusCode::kUnavailable, "cannot listen on " + where + ": " + ec.message());
    impl->port = impl->acceptor.local_endpoint().port();
    impl->Accept();
    for (int i = 0; i < config.num_threads; ++i) {
        impl->threads.emplace_back([io = &impl->io] { io->run(); });
    }
    spdlog::info("http: listening on http://{}:{} ({} threads)", config.host, impl->port,
                 config.num_threads);
    return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
    if (impl_->stopped) return;
    impl_->stopped = true;
    // Engine callbacks from now on post nothing; then the loop stops and, when the io_context is
    // destroyed with impl_, the pending handlers and so the sessions go (aborting their requests).
    impl_->gate->Close();
    impl_->io.stop();
    for (std::thread& t : impl_->threads) t.join();
    impl_->threads.clear();
    boost::system::error_code ec;
    impl_->acceptor.close(ec);
}

int HttpServer::port() const { return impl_->port; }

}  // namespace kvshard
