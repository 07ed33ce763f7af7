#include "coordinator/http_session.h"

#include <sys/socket.h>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <cstdio>
#include <sstream>

#include "common/logging.h"

namespace kvshard {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

constexpr char kServerName[] = "kvshard";
constexpr size_t kHeaderLimitBytes = 16 * 1024;
constexpr auto kDrainTime = std::chrono::seconds(2);

std::chrono::steady_clock::duration SecondsToDuration(double s) {
    return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(s));
}

// One chunk of HTTP/1.1 chunked transfer encoding.
std::string ChunkFrame(const std::string& data) {
    char size[24];
    std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
    return size + data + "\r\n";
}

ApiError RouteError(unsigned status, std::string message, std::string code) {
    ApiError e;
    e.http_status = static_cast<int>(status);
    e.message = std::move(message);
    e.code = std::move(code);
    return e;
}

}  // namespace

struct HttpSession::Generation {
    std::string request_id;
    std::shared_ptr<StreamSink> sink;
    bool stream = false;
    bool chunked = false;  // the event stream is framed as HTTP/1.1 chunks (else: close at end)
    std::optional<StreamFormatter> formatter;
    std::optional<CompletionAccumulator> accumulator;
    bool finished = false;  // the engine said OnFinish; only writing is left
    bool timed_out = false;
    std::string pending;  // framed bytes waiting for the write in flight
    std::string writing;  // bytes of the write in flight
    bool write_in_flight = false;
};

HttpSession::HttpSession(tcp::socket socket, const ApiService& api, const HttpConfig& config,
                         std::shared_ptr<PostGate> gate)
    : stream_(std::move(socket)),
      api_(api),
      config_(config),
      gate_(std::move(gate)),
      timeout_timer_(stream_.get_executor()) {}

HttpSession::~HttpSession() {
    if (generation_ && !generation_->finished) {
        generation_->sink->Detach();
        api_.engine().Abort(generation_->request_id);
    }
}

void HttpSession::Start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->DoRead(); });
}

void HttpSession::DoRead() {
    parser_.emplace();
    parser_->body_limit(static_cast<uint64_t>(config_.max_body_bytes));
    parser_->header_limit(kHeaderLimitBytes);
    stream_.expires_after(SecondsToDuration(config_.idle_timeout_s));
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
}

// Clients such as curl send "Expect: 100-continue" with larger bodies and wait (curl: 1 s) for
// the go-ahead before sending them. The header has been checked by now (a body over the limit
// already failed), so say yes and read on.
void HttpSession::OnHeader(beast::error_code ec) {
    if (ec) return OnRead(ec);
    auto read_body = [self = shared_from_this()](beast::error_code ec, size_t) {
        if (ec) return self->OnRead(ec);
        http::async_read(self->stream_, self->buffer_, *self->parser_,
                         [self](beast::error_code ec, size_t) { self->OnRead(ec); });
    };
    if (beast::iequals(parser_->get()[http::field::expect], "100-continue") &&
        !parser_->is_done()) {
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        return net::async_write(stream_, net::buffer(kContinue.data(), kContinue.size()),
                                std::move(read_body));
    }
    read_body(beast::error_code{}, 0);
}

void HttpSession::OnRead(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
        ec == beast::error::timeout) {
        return Close();
    }
    if (ec == http::error::body_limit) {
        keep_alive_ = false;
        version_ = 11;
        return SendError(RouteError(413,
                                    "the request body is larger than " +
                                        std::to_string(config_.max_body_bytes) + " bytes",
                                    "request_too_large"),
                         /*close=*/true);
    }
    if (ec && ec.category() == http::make_error_code(http::error::bad_target).category()) {
        keep_alive_ = false;
        version_ = 11;
        return SendError(BadRequest("malformed HTTP request: " + ec.message()), /*close=*/true);
    }
    if (ec) return Close();
    Route(parser_->release());
}

void HttpSession::Route(Request request) {
    arrival_ = std::chrono::steady_clock::now();
    version_ = request.version();
    keep_alive_ = request.keep_alive();
    std::string_view target(request.target().data(), request.target().size());
    target = target.substr(0, target.find('?'));
    const http::verb method = request.method();

    struct RouteEntry {
        std::string_view path;
        http::verb method;
    };
    static constexpr RouteEntry kRoutes[] = {
        {"/v1/completions", http::verb::post}, {"/v1/chat/completions", http::verb::post},
        {"/v1/models", http::verb::get},       {"/health", http::verb::get},
        {"/metrics", http::verb::get},
    };
    const RouteEntry* route = nullptr;
    for (const RouteEntry& r : kRoutes) {
        if (r.path == target) route = &r;
    }
    if (route == nullptr) {
        return SendError(RouteError(
            404, "no route for " + std::string(request.method_string()) + " " + std::string(target),
            "not_found"));
    }
    if (method != route->method) {
        const char* allow = route->method == http::verb::post ? "POST" : "GET";
        return SendError(RouteError(405,
                                    std::string(target) + " accepts " + allow + ", not " +
                                        std::string(request.method_string()),
                                    "method_not_allowed"),
                         false, allow);
    }
    if (target.substr(0, 4) == "/v1/") {
        auto auth = request.find(http::field::authorization);
        std::string_view value;
        if (auth != request.end())
            value = std::string_view(auth->value().data(), auth->value().size());
        if (!api_.Authorized(value)) {
            ApiError e = RouteError(401, "a valid API key is required: Authorization: Bearer <key>",
                                    "invalid_api_key");
            return SendError(e);
        }
    }
    if (target == "/v1/completions")
        return StartGeneration(ApiEndpoint::kCompletions, request.body());
    if (target == "/v1/chat/completions") {
        return StartGeneration(ApiEndpoint::kChatCompletions, request.body());
    }
    if (target == "/v1/models") return SendResponse(200, "application/json", api_.ModelsBody());
    if (target == "/health") {
        auto [status, body] = api_.Health();
        return SendResponse(static_cast<unsigned>(status), "application/json", std::move(body));
    }
    SendResponse(200, "text/plain; version=0.0.4; charset=utf-8", api_.MetricsBody());
}

void HttpSession::SendResponse(unsigned status, const char* content_type, std::string body,
                               bool close, const char* allow) {
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(status), version_);
    res->set(http::field::server, kServerName);
    res->set(http::field::content_type, content_type);
    if (allow != nullptr) res->set(http::field::allow, allow);
    res->keep_alive(keep_alive_ && !close);
    res->body() = std::move(body);
    res->prepare_payload();
    const bool close_after = !res->keep_alive();
    stream_.expires_after(SecondsToDuration(config_.idle_timeout_s));
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res, close_after](beast::error_code ec, size_t) {
                          self->OnResponseWritten(close_after, ec);
                      });
}

void HttpSession::SendError(const ApiError& error, bool close, const char* allow) {
    spdlog::debug("http: {} {}", error.http_status, error.message);
    SendResponse(static_cast<unsigned>(error.http_status), "application/json", ApiErrorBody(error),
                 close, allow);
}

void HttpSession::OnResponseWritten(bool close, beast::error_code ec) {
    if (ec) return Close();
    if (close) return DrainAndClose();
    DoRead();
}

void HttpSession::Close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().close(ec);
}

// Closing a socket with unread input makes the kernel send a reset, which can destroy the answer
// we just wrote (a 413 to a client still sending its body). So shut down our side, then read and
// drop what still arrives, for a little while.
void HttpSession::DrainAndClose() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.expires_after(kDrainTime);
    DrainSome();
}

void HttpSession::DrainSome() {
    // The bytes land in prepared (uncommitted) space of buffer_ and are dropped.
    stream_.async_read_some(buffer_.prepare(4096),
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                                if (ec) return self->Close();
                                self->DrainSome();
                            });
}

void HttpSession::StartGeneration(ApiEndpoint endpoint, const std::string& body) {
    auto prepared = api_.Prepare(endpoint, body);
    if (auto* error = std::get_if<ApiError>(&prepared)) return SendError(*error);
    PreparedGeneration& p = std::get<PreparedGeneration>(prepared);

    auto g = std::make_unique<Generation>();
    g->request_id = p.request.request_id;
    g->stream = p.stream;
    g->chunked = version_ >= 11;
    if (g->stream) {
        g->formatter.emplace(p.context, api_.token_bytes());
    } else {
        g->accumulator.emplace(p.context, api_.token_bytes());
    }
    std::weak_ptr<HttpSession> weak = weak_from_this();
    std::shared_ptr<PostGate> gate = gate_;
    g->sink = std::make_shared<StreamSink>(api_.metrics(), arrival_, p.request.n, [weak, gate] {
        gate->Run([&weak] {
            if (auto self = weak.lock()) {
                net::post(self->stream_.get_executor(), [self] { self->OnSinkEvents(); });
            }
        });
    });
    const std::shared_ptr<StreamSink> sink = g->sink;
    generation_ = std::move(g);
    ++generation_seq_;
    Status submitted = api_.engine().Submit(std::move(p.request), sink);
    if (!submitted.ok()) {
        generation_->sink->Detach();
        generation_.reset();
        return SendError(ApiService::ErrorFromStatus(submitted));
    }
    spdlog::debug("http: {} submitted", generation_->request_id);
    if (config_.request_timeout_s > 0) {
        timeout_timer_.expires_after(SecondsToDuration(config_.request_timeout_s));
        timeout_timer_.async_wait(
            [self = shared_from_this(), seq = generation_seq_](beast::error_code ec) {
                if (!ec && self->generation_ && seq == self->generation_seq_) self->OnTimeout();
            });
    }
    WatchForDisconnect();
    if (!generation_->stream) return;

    http::response<http::empty_body> head{http::status::ok, version_};
    head.set(http::field::server, kServerName);
    head.set(http::field::content_type, "text/event-stream");
    head.set(http::field::cache_control, "no-cache");
    if (generation_->chunked) {
        head.chunked(true);
        head.keep_alive(keep_alive_);
    } else {
        head.keep_alive(false);
    }
    std::ostringstream os;
    os << head.base();
    generation_->pending = os.str();
    QueueStreamBytes(generation_->formatter->Start());
    if (!generation_->write_in_flight) WriteStream();
}

void HttpSession::OnSinkEvents() {
    if (!generation_) return;
    std::vector<SinkEvent> events = generation_->sink->TakeEvents();
    for (SinkEvent& e : events) {
        if (!generation_) return;
        if (e.delta) {
            if (generation_->stream) {
                QueueStreamBytes(generation_->formatter->Delta(*e.delta));
            } else {
                generation_->accumulator->Add(*e.delta);
            }
        }
        if (e.finished) OnGenerationFinished(e.usage, e.status);
    }
}

void HttpSession::OnGenerationFinished(const GenerationUsage& usage, const Status& status) {
    Generation& g = *generation_;
    g.finished = true;
    timeout_timer_.cancel();
    std::optional<ApiError> error;
    if (g.timed_out) {
        error = RouteError(
            504,
            "the request did not finish within " + std::to_string(config_.request_timeout_s) + " s",
            "timeout");
        error->type = "timeout";
    } else if (!status.ok()) {
        error = ApiService::ErrorFromStatus(status);
    }
    spdlog::debug("http: {} finished{}", g.request_id, error ? ": " + error->message : "");
    if (!g.stream) {
        std::string body = error ? "" : g.accumulator->Body(usage);
        generation_.reset();
        if (error) return SendError(*error);
        return SendResponse(200, "application/json", std::move(body));
    }
    QueueStreamBytes(error ? g.formatter->Error(*error) : g.formatter->Finish(usage));
    if (g.chunked) g.pending += "0\r\n\r\n";
    if (!g.write_in_flight) WriteStream();
}

void HttpSession::QueueStreamBytes(const std::string& data) {
    if (data.empty()) return;
    Generation& g = *generation_;
    g.pending += g.chunked ? ChunkFrame(data) : data;
    if (!g.write_in_flight) WriteStream();
}

void HttpSession::WriteStream() {
    Generation& g = *generation_;
    if (g.pending.empty()) return;
    g.writing.swap(g.pending);
    g.pending.clear();
    g.write_in_flight = true;
    // A client that stops reading stalls the write; past the idle timeout it counts as gone.
    stream_.expires_after(SecondsToDuration(config_.idle_timeout_s));
    net::async_write(
        stream_, net::buffer(g.writing),
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnStreamWritten(ec); });
}

void HttpSession::OnStreamWritten(beast::error_code ec) {
    if (!generation_) return;
    Generation& g = *generation_;
    g.write_in_flight = false;
    g.writing.clear();
    if (ec) return OnClientGone();
    if (!g.pending.empty()) return WriteStream();
    if (!g.finished) return;
    const bool keep = g.chunked && keep_alive_;
    generation_.reset();
    if (keep) return DoRead();
    Close();
}

// Waits for the socket to become readable while the request generates, then peeks: zero bytes
// means the client closed the connection (an error, that it reset it). A readiness report with
// nothing to read is stale (the reactor is edge-triggered and Beast may already have consumed the
// bytes that raised it), so the watch goes on. Bytes (a pipelined request) stay in the socket for
// the next read, and the watch ends.
void HttpSession::WatchForDisconnect() {
    stream_.socket().async_wait(
        tcp::socket::wait_read,
        [self = shared_from_this(), seq = generation_seq_](beast::error_code ec) {
            if (!self->generation_ || seq != self->generation_seq_) return;
            if (ec) return self->OnClientGone();
            char byte;
            const ssize_t n =
                ::recv(self->stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
            if (n > 0) return;
            if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                return self->WatchForDisconnect();
            }
            self->OnClientGone();
        });
}

void HttpSession::OnClientGone() {
    if (!generation_) return;
    spdlog::debug("http: {} client went away", generation_->request_id);
    generation_->sink->Detach();
    if (!generation_->finished) api_.engine().Abort(generation_->request_id);
    timeout_timer_.cancel();
    generation_.reset();
    Close();
}

void HttpSession::OnTimeout() {
    if (!generation_ || generation_->finished) return;
    spdlog::info("http: {} timed out after {} s; aborting", generation_->request_id,
                 config_.request_timeout_s);
    generation_->timed_out = true;
    api_.engine().Abort(generation_->request_id);
}

}  // namespace kvshard
