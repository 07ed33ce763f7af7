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
constexpr auto kDrainTime = std::chrono::seconds(2);
// A client this far behind a stream is treated as gone (bounds a session's memory).
constexpr size_t kMaxPendingStreamBytes = 4 << 20;

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

}  // namespace

struct HttpSession::Generation {
    // One engine request per prompt (completions with a list of prompts have several); part k's
    // choice j is the answer's choice k * n + j.
    struct Part {
        std::string request_id;
        std::shared_ptr<StreamSink> sink;
        bool finished = false;
    };
    std::string request_id;  // the first part's: the answer's id, the logs' name
    std::vector<Part> parts;
    int n = 1;              // choices per part
    int parts_left = 0;     // parts the engine has not finished
    GenerationUsage usage;  // summed over the finished parts
    Status status;          // the first failure of a part
    bool stream = false;
    bool chunked = false;  // the event stream is framed as HTTP/1.1 chunks (else: close at end)
    std::unique_ptr<ResponseWriter> writer;
    bool finished = false;  // the engine said OnFinish; only writing is left
    bool timed_out = false;
    std::string pending;  // framed bytes waiting for the write in flight
    std::string writing;  // bytes of the write in flight
    bool write_in_flight = false;
};

HttpSession::HttpSession(tcp::socket socket, const ApiService& api, const HttpConfig& config,
                         std::shared_ptr<HttpServerState> state, net::thread_pool& prepare_pool)
    : stream_(std::move(socket)),
      api_(api),
      config_(config),
      state_(std::move(state)),
      prepare_(prepare_pool.get_executor()),
      timeout_timer_(stream_.get_executor()) {
    state_->num_connections.fetch_add(1);
}

HttpSession::~HttpSession() {
    if (generation_ && !generation_->finished) AbortParts(/*detach=*/true);
    EndInFlight();
    state_->num_connections.fetch_sub(1);
}

void HttpSession::Start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->DoRead(); });
}

void HttpSession::EndInFlight() {
    if (!in_flight_) return;
    in_flight_ = false;
    state_->GenerationEnded();
}

void HttpSession::DoRead() {
    parser_.emplace();
    ConfigureRequestParser(*parser_, config_);
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
    if (std::optional<HttpAnswer> refused = CheckRequestHeader(parser_->get())) {
        keep_alive_ = false;
        version_ = parser_->get().version();
        cors_origin_ = CorsAllowOrigin(parser_->get(), config_);
        return SendAnswer(std::move(*refused));
    }
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
    if (ec) {
        std::optional<HttpAnswer> answer = AnswerReadError(ec, config_);
        if (!answer) return Close();
        keep_alive_ = false;
        version_ = 11;
        cors_origin_.clear();
        return SendAnswer(std::move(*answer));
    }
    HandleRequest(parser_->release());
}

void HttpSession::HandleRequest(HttpRequest request) {
    arrival_ = api_.engine().clock().Now();  // the engine measures latencies from it
    version_ = request.version();
    // A draining server closes connections after their answer.
    keep_alive_ = request.keep_alive() && !state_->draining.load();
    error_shape_ =
        ErrorShapeFor(std::string_view(request.target().data(), request.target().size()));
    cors_origin_ = CorsAllowOrigin(request, config_);
    if (std::optional<HttpAnswer> preflight = CorsPreflight(request, config_)) {
        return SendAnswer(std::move(*preflight));
    }
    RouteResult route = RouteRequest(request, api_, state_->draining.load());
    if (auto* endpoint = std::get_if<ApiEndpoint>(&route)) {
        return StartGeneration(
            api_.Parse(*endpoint, request.body()),
            [](const ApiService& api, const OpenAiRequest& r) { return api.Prepare(r); });
    }
    if (std::holds_alternative<ResponsesEndpoint>(route)) {
        return StartGeneration(api_.ParseResponses(request.body()),
                               [](const ApiService& api, const ResponsesRequest& r) {
                                   return api.PrepareResponses(r);
                               });
    }
    if (auto* endpoint = std::get_if<TokenizerEndpoint>(&route)) {
        return StartPreparedAnswer(
            [endpoint = *endpoint, body = std::move(request.body())](const ApiService& api) {
                return api.TokenizerAnswer(endpoint, body);
            });
    }
    if (auto* endpoint = std::get_if<AnthropicEndpoint>(&route)) {
        if (*endpoint == AnthropicEndpoint::kMessages) {
            return StartGeneration(
                api_.ParseAnthropic(AnthropicEndpoint::kMessages, request.body()),
                [](const ApiService& api, const AnthropicRequest& r) {
                    return api.PrepareAnthropic(r);
                });
        }
        return StartPreparedAnswer([body = std::move(request.body())](const ApiService& api) {
            return api.CountTokensAnswer(body);
        });
    }
    SendAnswer(std::move(std::get<HttpAnswer>(route)));
}

void HttpSession::SendAnswer(HttpAnswer answer) {
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(answer.status), version_);
    res->set(http::field::server, kServerName);
    if (!answer.content_type.empty()) res->set(http::field::content_type, answer.content_type);
    for (const auto& [name, value] : answer.headers) res->set(name, value);
    if (!cors_origin_.empty() && answer.headers.empty()) SetCorsHeaders(*res);
    if (!answer.allow.empty()) res->set(http::field::allow, answer.allow);
    if (answer.retry_after_s > 0)
        res->set(http::field::retry_after, std::to_string(answer.retry_after_s));
    if (answer.www_authenticate) res->set(http::field::www_authenticate, "Bearer");
    res->keep_alive(keep_alive_ && !answer.close);
    if (answer.head) {
        // What GET would answer, without the body.
        res->content_length(answer.body.size());
    } else {
        res->body() = std::move(answer.body);
        res->prepare_payload();
    }
    const bool close_after = !res->keep_alive();
    stream_.expires_after(SecondsToDuration(config_.idle_timeout_s));
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res, close_after](beast::error_code ec, size_t) {
                          self->OnResponseWritten(close_after, ec);
                      });
}

template <typename Message>
void HttpSession::SetCorsHeaders(Message& message) const {
    if (cors_origin_.empty()) return;
    message.set(http::field::access_control_allow_origin, cors_origin_);
    // A browser script may read these of an answer besides the CORS-safelisted ones.
    message.set(http::field::access_control_expose_headers, "Retry-After, WWW-Authenticate");
    if (cors_origin_ != "*") message.set(http::field::vary, "Origin");
}

void HttpSession::SendError(const ApiError& error, bool close) {
    spdlog::debug("http: {} {}", error.http_status, error.message);
    SendAnswer(ErrorAnswer(error, close, error_shape_));
}

void HttpSession::OnResponseWritten(bool close, beast::error_code ec) {
    EndInFlight();
    if (ec) return Close();
    if (close) return DrainAndClose();
    DoRead();
}

void HttpSession::Close() {
    EndInFlight();
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
    stream_.async_read_some(net::buffer(drain_buffer_),
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                                if (ec) return self->Close();
                                self->DrainSome();
                            });
}

// Parsing stays on the strand (bounded by the body limit); the template and the tokenizer, whose
// cost grows with the prompt, run on the prepare pool so that an I/O thread is never held by
// them (GET /health answers while megabyte prompts tokenize). `prepare(api, request)` is the
// route's ApiService::Prepare*.
template <typename Request, typename PrepareFn>
void HttpSession::StartGeneration(std::variant<Request, ApiError> parsed, PrepareFn prepare) {
    in_flight_ = true;
    state_->GenerationStarted();
    if (auto* error = std::get_if<ApiError>(&parsed)) return SendError(*error);
    net::post(prepare_, [self = shared_from_this(), executor = stream_.get_executor(),
                         request = std::move(std::get<Request>(parsed)), prepare]() mutable {
        auto prepared = prepare(self->api_, request);
        self->state_->gate.Run([&] {
            net::post(executor, [self, prepared = std::move(prepared)]() mutable {
                self->OnPrepared(std::move(prepared));
            });
        });
    });
}

// The tokenizer routes run on the prepare pool as the tokenization of a generation does, and
// count as in flight until answered, so a drain waits for them.
template <typename AnswerFn>
void HttpSession::StartPreparedAnswer(AnswerFn answer_fn) {
    in_flight_ = true;
    state_->GenerationStarted();
    net::post(prepare_, [self = shared_from_this(), executor = stream_.get_executor(),
                         answer_fn = std::move(answer_fn)]() mutable {
        std::variant<std::string, ApiError> answer = answer_fn(self->api_);
        self->state_->gate.Run([&] {
            net::post(executor, [self, answer = std::move(answer)]() mutable {
                if (auto* error = std::get_if<ApiError>(&answer)) return self->SendError(*error);
                HttpAnswer a;
                a.body = std::move(std::get<std::string>(answer));
                self->SendAnswer(std::move(a));
            });
        });
    });
}

void HttpSession::OnPrepared(std::variant<PreparedGeneration, ApiError> prepared) {
    if (auto* error = std::get_if<ApiError>(&prepared)) return SendError(*error);
    PreparedGeneration& p = std::get<PreparedGeneration>(prepared);

    auto g = std::make_unique<Generation>();
    g->request_id = p.request.request_id;
    g->n = p.request.n;
    g->stream = p.stream;
    g->chunked = version_ >= 11;
    g->writer = api_.MakeResponseWriter(p);
    std::vector<GenerationRequest> requests;
    requests.push_back(std::move(p.request));
    for (GenerationRequest& more : p.more_requests) requests.push_back(std::move(more));
    std::weak_ptr<HttpSession> weak = weak_from_this();
    std::shared_ptr<HttpServerState> state = state_;
    for (const GenerationRequest& r : requests) {
        Generation::Part part;
        part.request_id = r.request_id;
        part.sink = std::make_shared<StreamSink>([weak, state] {
            state->gate.Run([&weak] {
                if (auto self = weak.lock()) {
                    net::post(self->stream_.get_executor(), [self] { self->OnSinkEvents(); });
                }
            });
        });
        g->parts.push_back(std::move(part));
    }
    g->parts_left = static_cast<int>(g->parts.size());
    generation_ = std::move(g);
    ++generation_seq_;
    const std::string request_id = generation_->request_id;
    for (size_t k = 0; k < requests.size(); ++k) {
        const std::shared_ptr<StreamSink> sink = generation_->parts[k].sink;
        requests[k].arrival = arrival_;
        Status submitted = api_.engine().Submit(std::move(requests[k]), sink);
        if (!submitted.ok()) {
            // The parts already submitted go too: the client gets the one error.
            generation_->parts.resize(k + 1);
            generation_->parts[k].finished = true;
            AbortParts(/*detach=*/true);
            generation_.reset();
            return SendError(ApiService::ErrorFromStatus(submitted, request_id));
        }
    }
    spdlog::debug("http: {} submitted", request_id);
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
    SetCorsHeaders(head);
    if (generation_->chunked) {
        head.chunked(true);
        head.keep_alive(keep_alive_);
    } else {
        head.keep_alive(false);
    }
    std::ostringstream os;
    os << head.base();
    generation_->pending = os.str();
    QueueStreamBytes(generation_->writer->StreamStart());
    if (!generation_->write_in_flight) WriteStream();
}

void HttpSession::OnSinkEvents() {
    if (!generation_) return;
    for (size_t k = 0; generation_ && k < generation_->parts.size(); ++k) {
        std::vector<SinkEvent> events = generation_->parts[k].sink->TakeEvents();
        for (SinkEvent& e : events) {
            if (!generation_) return;
            if (e.delta) {
                e.delta->index += static_cast<int>(k) * generation_->n;
                if (generation_->stream) {
                    QueueStreamBytes(generation_->writer->StreamDelta(*e.delta));
                    if (generation_->pending.size() > kMaxPendingStreamBytes) {
                        spdlog::info("http: {} client reads too slowly; aborting",
                                     generation_->request_id);
                        return OnClientGone();
                    }
                } else {
                    generation_->writer->Add(*e.delta);
                }
            }
            if (e.finished) OnPartFinished(k, e.usage, e.status);
        }
    }
}

// A part is over: its usage joins the sum; a failure ends the other parts too. The answer ends
// once every part has.
void HttpSession::OnPartFinished(size_t k, const GenerationUsage& usage, const Status& status) {
    Generation& g = *generation_;
    Generation::Part& part = g.parts[k];
    if (part.finished) return;
    part.finished = true;
    --g.parts_left;
    g.usage.prompt_tokens += usage.prompt_tokens;
    g.usage.completion_tokens += usage.completion_tokens;
    g.usage.cached_tokens += usage.cached_tokens;
    g.usage.cache_creation_tokens += usage.cache_creation_tokens;
    if (!status.ok() && g.status.ok()) {
        g.status = status;
        for (const Generation::Part& other : g.parts) {
            if (!other.finished) api_.engine().Abort(other.request_id);
        }
    }
    if (g.parts_left == 0) OnGenerationFinished(g.usage, g.status);
}

// Aborts every part the engine has not finished; `detach`: their sinks drop what still comes.
void HttpSession::AbortParts(bool detach) {
    for (Generation::Part& part : generation_->parts) {
        if (detach) part.sink->Detach();
        if (!part.finished) api_.engine().Abort(part.request_id);
    }
}

void HttpSession::OnGenerationFinished(const GenerationUsage& usage, const Status& status) {
    Generation& g = *generation_;
    g.finished = true;
    timeout_timer_.cancel();
    std::optional<ApiError> error;
    if (g.timed_out) {
        error.emplace();
        error->http_status = 504;
        char limit[32];
        std::snprintf(limit, sizeof(limit), "%g", config_.request_timeout_s);
        error->message = std::string("the request did not finish within ") + limit + " s";
        error->code = "timeout";
        error->type = "timeout";
    } else if (!status.ok()) {
        error = ApiService::ErrorFromStatus(status, g.request_id);
    }
    spdlog::debug("http: {} finished{}", g.request_id, error ? ": " + error->message : "");
    if (!g.stream) {
        std::string body = error ? "" : g.writer->Body(usage);
        generation_.reset();
        if (error) return SendError(*error);
        HttpAnswer answer;
        answer.body = std::move(body);
        return SendAnswer(std::move(answer));
    }
    QueueStreamBytes(error ? g.writer->StreamError(*error) : g.writer->StreamFinish(usage));
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
    EndInFlight();
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
    if (generation_->finished) {
        for (Generation::Part& part : generation_->parts) part.sink->Detach();
    } else {
        AbortParts(/*detach=*/true);
    }
    timeout_timer_.cancel();
    generation_.reset();
    Close();
}

void HttpSession::OnTimeout() {
    if (!generation_ || generation_->finished) return;
    spdlog::info("http: {} timed out after {} s; aborting", generation_->request_id,
                 config_.request_timeout_s);
    generation_->timed_out = true;
    AbortParts(/*detach=*/false);
}

}  // namespace kvshard
