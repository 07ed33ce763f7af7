#include "coordinator/http_server.h"

#include <fcntl.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/beast/http.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "coordinator/http_session.h"

namespace kvshard {

namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

// The whole answer to a connection beyond the limit.
std::string RefusalText(int max_connections) {
    ApiError e;
    e.http_status = 503;
    e.type = "server_unavailable";
    e.code = "too_many_connections";
    e.message = "the server has " + std::to_string(max_connections) +
                " connections open, its limit; retry later";
    namespace http = boost::beast::http;
    http::response<http::string_body> res{http::status::service_unavailable, 11};
    res.set(http::field::server, "kvshard");
    res.set(http::field::content_type, "application/json");
    res.set(http::field::retry_after, "1");
    res.keep_alive(false);
    res.body() = ApiErrorBody(e);
    res.prepare_payload();
    std::ostringstream os;
    os << res;
    return os.str();
}

}  // namespace

struct HttpServer::Impl {
    Impl(const HttpConfig& c, const ApiService& a)
        : config(c),
          api(a),
          acceptor(io),
          accept_timer(io),
          prepare_pool(static_cast<size_t>(std::max(1, c.num_threads))) {
        state->refusal = RefusalText(c.max_connections);
    }

    // One accept outstanding at a time; its handler and the backoff timer's run one after the
    // other, so the fields below them need no lock.
    void Accept() {
        acceptor.async_accept(net::make_strand(io),
                              [this](boost::system::error_code ec, tcp::socket socket) {
                                  OnAccept(ec, std::move(socket));
                              });
    }

    void OnAccept(boost::system::error_code ec, tcp::socket socket) {
        if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
        if (ec) return Backoff(ec);
        // Worker processes the coordinator spawns must not hold client connections (asio
        // accepts without SOCK_CLOEXEC).
        ::fcntl(socket.native_handle(), F_SETFD, FD_CLOEXEC);
        if (accept_failing) {
            accept_failing = false;
            spdlog::info("http: accepting connections again");
        }
        if (state->num_connections.load() >= config.max_connections) {
            RefuseConnection(std::move(socket), state);
        } else {
            std::make_shared<HttpSession>(std::move(socket), api, config, state, prepare_pool)
                ->Start();
        }
        Accept();
    }

    // Accepting again at once would fail again at once (EMFILE leaves the connection in the
    // backlog), so wait; the connection waiting is accepted once a descriptor is free.
    void Backoff(boost::system::error_code ec) {
        accept_failures.fetch_add(1);
        if (!accept_failing) {
            accept_failing = true;
            spdlog::warn("http: accept failed: {}; retrying every {} ms until it succeeds",
                         ec.message(), kAcceptBackoff.count());
        }
        accept_timer.expires_after(kAcceptBackoff);
        accept_timer.async_wait([this](boost::system::error_code ec) {
            if (!ec && acceptor.is_open()) Accept();
        });
    }

    const HttpConfig config;
    const ApiService& api;
    std::shared_ptr<HttpServerState> state = std::make_shared<HttpServerState>();
    net::io_context io;
    tcp::acceptor acceptor;
    net::steady_timer accept_timer;
    bool accept_failing = false;
    std::atomic<int64_t> accept_failures{0};
    // Declared after io: destroyed first, with the sessions its abandoned tasks still hold.
    net::thread_pool prepare_pool;
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
    // Nor the listening socket: a worker outliving the server would keep its port bound (and
    // `ss -p` would show the workers as listening on it).
    if (!ec) ::fcntl(impl->acceptor.native_handle(), F_SETFD, FD_CLOEXEC);
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
    spdlog::info("http: listening on http://{}:{} ({} threads, at most {} connections)",
                 config.host, impl->port, config.num_threads, config.max_connections);
    return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Stop() {
    if (impl_->stopped) return;
    impl_->stopped = true;
    // Engine callbacks from now on post nothing; then the loop stops and, when the io_context is
    // destroyed with impl_, the pending handlers and so the sessions go (aborting their requests).
    impl_->state->gate.Close();
    impl_->io.stop();
    for (std::thread& t : impl_->threads) t.join();
    impl_->threads.clear();
    impl_->prepare_pool.stop();
    impl_->prepare_pool.join();
    boost::system::error_code ec;
    impl_->acceptor.close(ec);
}

void HttpServer::BeginDrain() {
    if (!impl_->state->draining.exchange(true)) {
        spdlog::info("http: draining: new generation requests get 503; {} in flight",
                     impl_->state->num_in_flight());
    }
}

int64_t HttpServer::num_in_flight() const { return impl_->state->num_in_flight(); }

bool HttpServer::WaitIdle(std::chrono::milliseconds timeout) const {
    return impl_->state->WaitIdle(timeout);
}

int64_t HttpServer::num_connections() const { return impl_->state->num_connections.load(); }

int64_t HttpServer::num_accept_failures() const { return impl_->accept_failures.load(); }

int HttpServer::port() const { return impl_->port; }

}  // namespace kvshard
