#include "loadgen/http_client.h"

#include <algorithm>
#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "loadgen/sse_parser.h"
#include "loadgen/tls.h"

namespace kvshard::loadgen {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using TlsStream = beast::ssl_stream<beast::tcp_stream>;

Result<BaseUrl> ParseBaseUrl(std::string_view url) {
    BaseUrl out;
    std::string_view rest;
    if (url.substr(0, 7) == "http://") {
        rest = url.substr(7);
    } else if (url.substr(0, 8) == "https://") {
        out.https = true;
        out.port = "443";
        rest = url.substr(8);
    } else {
        return InvalidArgument("--base-url must start with http:// or https://, got '" +
                               std::string(url) + "'");
    }
    const size_t slash = rest.find('/');
    std::string_view authority = rest.substr(0, slash);
    std::string prefix = slash == std::string_view::npos ? "" : std::string(rest.substr(slash));
    while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
    if (prefix.size() >= 3 && prefix.compare(prefix.size() - 3, 3, "/v1") == 0) {
        prefix.resize(prefix.size() - 3);
    }
    out.prefix = prefix;
    const size_t colon = authority.rfind(':');
    if (colon != std::string_view::npos && authority.find(']') == std::string_view::npos) {
        out.host = std::string(authority.substr(0, colon));
        out.port = std::string(authority.substr(colon + 1));
    } else {
        out.host = std::string(authority);
    }
    if (out.host.empty() || out.port.empty() ||
        out.port.find_first_not_of("0123456789") != std::string::npos) {
        return InvalidArgument("--base-url '" + std::string(url) + "' has no valid host:port");
    }
    return out;
}

std::string UrlText(const BaseUrl& url) {
    return (url.https ? "https://" : "http://") + url.host + ":" + url.port + url.prefix;
}

namespace {

double Since(Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
}

std::chrono::steady_clock::duration Seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

template <class Stream>
constexpr bool kIsTls = std::is_same_v<Stream, TlsStream>;

template <class Stream>
Stream MakeStream(net::io_context& io, const BaseUrl& url) {
    if constexpr (kIsTls<Stream>) {
        return Stream(io, *url.tls);
    } else {
        return Stream(io);
    }
}

// Resolves, connects and, on TLS, shakes hands; `ready` gets "" or why it failed (one line).
// REQUIRES: `resolver`, `stream` and `url` outlive the callbacks.
template <class Stream>
void AsyncOpen(tcp::resolver& resolver, Stream& stream, const BaseUrl& url, double timeout_s,
               std::function<void(std::string)> ready) {
    resolver.async_resolve(
        url.host, url.port,
        [&stream, &url, timeout_s, ready](beast::error_code ec,
                                          tcp::resolver::results_type results) {
            if (ec) return ready("resolve " + url.host + ": " + ec.message());
            auto& tcp_layer = beast::get_lowest_layer(stream);
            tcp_layer.expires_after(Seconds(timeout_s));
            tcp_layer.async_connect(results, [&stream, &url, ready](beast::error_code ec,
                                                                    const tcp::endpoint&) {
                if (ec) return ready("connect " + url.host + ":" + url.port + ": " + ec.message());
                if constexpr (kIsTls<Stream>) {
                    if (!PrepareTlsClient(stream.native_handle(), url.host)) {
                        return ready("TLS: OpenSSL refused the host name '" + url.host + "'");
                    }
                    stream.async_handshake(net::ssl::stream_base::client,
                                           [&stream, &url, ready](beast::error_code ec) {
                                               if (!ec) return ready("");
                                               ready(UrlText(url) + ": " +
                                                     TlsHandshakeError(ec, stream.native_handle()));
                                           });
                } else {
                    ready("");
                }
            });
        });
}

template <class Stream>
class StreamingRequest : public std::enable_shared_from_this<StreamingRequest<Stream>> {
  public:
    StreamingRequest(net::io_context& io, HttpTarget target, Clock::time_point run_start,
                     std::function<void(RequestOutcome)> done)
        : resolver_(io),
          stream_(MakeStream<Stream>(io, target.url)),
          target_(std::move(target)),
          run_start_(run_start),
          done_(std::move(done)) {
        request_ = {http::verb::post, target_.url.prefix + target_.path, 11};
        request_.set(http::field::host, target_.url.host);
        request_.set(http::field::content_type, "application/json");
        request_.set(http::field::accept, "text/event-stream");
        if (!target_.api_key.empty()) {
            request_.set(http::field::authorization, "Bearer " + target_.api_key);
        }
        for (const auto& [name, value] : target_.headers) request_.set(name, value);
        request_.keep_alive(false);
        request_.body() = target_.body;
        request_.prepare_payload();
        // Not boost::none: Boost 1.74 compares a Content-Length against an empty limit as "over".
        parser_.body_limit(std::numeric_limits<std::uint64_t>::max());
    }

    void Run() {
        sent_ = Clock::now();
        outcome_.start_s = Since(run_start_, sent_);
        AsyncOpen(resolver_, stream_, target_.url, target_.read_timeout_s,
                  [self = this->shared_from_this()](const std::string& error) {
                      if (!error.empty()) return self->Fail(error);
                      self->Write();
                  });
    }

  private:
    void Write() {
        beast::get_lowest_layer(stream_).expires_after(Seconds(target_.read_timeout_s));
        http::async_write(stream_, request_,
                          [self = this->shared_from_this()](beast::error_code ec, size_t) {
                              if (ec) return self->Fail("write: " + ec.message());
                              self->ReadSome();
                          });
    }

    void ReadSome() {
        parser_.get().body().data = chunk_.data();
        parser_.get().body().size = chunk_.size();
        beast::get_lowest_layer(stream_).expires_after(Seconds(target_.read_timeout_s));
        http::async_read_some(
            stream_, buffer_, parser_,
            [self = this->shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
    }

    void OnRead(beast::error_code ec) {
        const Clock::time_point now = Clock::now();
        if (ec == http::error::need_buffer) ec = {};
        if (ec) return Fail("read: " + ec.message());
        const size_t n = chunk_.size() - parser_.get().body().size;
        std::string_view bytes(chunk_.data(), n);
        if (parser_.is_header_done() && parser_.get().result() != http::status::ok) {
            error_body_.append(bytes);
        } else {
            for (const std::string& data : sse_.Feed(bytes)) OnEvent(data, now);
        }
        if (parser_.is_done() || done_seen_ || !error_.empty()) return Finish(now);
        ReadSome();
    }

    void OnEvent(const std::string& data, Clock::time_point now) {
        if (data == "[DONE]") {
            done_seen_ = true;
            return;
        }
        const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
        if (!j.is_object()) {
            error_ = "a stream event is not JSON: " + data.substr(0, 200);
            return;
        }
        if (j.contains("error")) {
            error_ = "error event: " + j["error"].dump();
            return;
        }
        std::string text;
        if (j.contains("type") && j["type"].is_string()) {
            if (!AnthropicEvent(j, &text)) return;
        } else {
            if (auto usage = j.find("usage"); usage != j.end() && usage->is_object()) {
                usage_tokens_ = usage->value("completion_tokens", int64_t{-1});
                outcome_.prompt_tokens = usage->value("prompt_tokens", int64_t{-1});
                auto details = usage->find("prompt_tokens_details");
                if (details != usage->end() && details->is_object()) {
                    outcome_.cached_tokens = details->value("cached_tokens", int64_t{-1});
                }
            }
            auto choices = j.find("choices");
            if (choices == j.end() || !choices->is_array() || choices->empty()) return;
            const nlohmann::json& c = (*choices)[0];
            if (c.contains("text") && c["text"].is_string()) text = c["text"];
            if (c.contains("delta") && c["delta"].is_object() && c["delta"].contains("content") &&
                c["delta"]["content"].is_string()) {
                text = c["delta"]["content"];
            }
        }
        if (text.empty()) return;
        if (text_chunks_ == 0) {
            outcome_.ttft_s = Since(sent_, now);
        } else {
            outcome_.itl_s.push_back(Since(last_text_, now));
        }
        last_text_ = now;
        ++text_chunks_;
    }

    // Anthropic's Messages stream: the usage in message_start (input and cache tokens) and
    // message_delta (output tokens), text in content_block_delta, the end in message_stop.
    // False when the event carries no text.
    bool AnthropicEvent(const nlohmann::json& j, std::string* text) {
        const std::string type = j["type"];
        auto read_usage = [&](const nlohmann::json& u) {
            if (!u.is_object()) return;
            auto get = [&](const char* key) { return u.value(key, int64_t{-1}); };
            if (get("output_tokens") >= 0) usage_tokens_ = get("output_tokens");
            if (get("input_tokens") < 0) return;
            const int64_t read = std::max<int64_t>(0, get("cache_read_input_tokens"));
            const int64_t created = std::max<int64_t>(0, get("cache_creation_input_tokens"));
            outcome_.prompt_tokens = get("input_tokens") + read + created;
            outcome_.cached_tokens = read;
            outcome_.cache_creation_tokens = created;
        };
        if (type == "message_start" && j.contains("message") && j["message"].is_object() &&
            j["message"].contains("usage")) {
            read_usage(j["message"]["usage"]);
        } else if (type == "message_delta" && j.contains("usage")) {
            read_usage(j["usage"]);
        } else if (type == "message_stop") {
            done_seen_ = true;
        } else if (type == "content_block_delta" && j.contains("delta") &&
                   j["delta"].is_object() && j["delta"].value("type", "") == "text_delta" &&
                   j["delta"].contains("text") && j["delta"]["text"].is_string()) {
            *text = j["delta"]["text"];
            return true;
        }
        return false;
    }

    void Finish(Clock::time_point now) {
        outcome_.e2e_s = Since(sent_, now);
        outcome_.output_tokens = usage_tokens_ >= 0 ? usage_tokens_ : text_chunks_;
        if (!error_.empty()) return Fail(error_);
        if (parser_.get().result() != http::status::ok) {
            return Fail("HTTP " + std::to_string(parser_.get().result_int()) + ": " +
                        error_body_.substr(0, 500));
        }
        if (!done_seen_) return Fail("the stream ended without data: [DONE] (or message_stop)");
        outcome_.ok = true;
        Done();
    }

    void Fail(const std::string& why) {
        outcome_.ok = false;
        outcome_.error = why;
        if (outcome_.e2e_s == 0) outcome_.e2e_s = Since(sent_, Clock::now());
        Done();
    }

    void Done() {
        if (!done_) return;
        beast::error_code ignored;
        beast::get_lowest_layer(stream_).socket().shutdown(tcp::socket::shutdown_both, ignored);
        auto done = std::move(done_);
        done_ = nullptr;
        done(std::move(outcome_));
    }

    tcp::resolver resolver_;
    Stream stream_;
    beast::flat_buffer buffer_;
    HttpTarget target_;
    http::request<http::string_body> request_;
    http::response_parser<http::buffer_body> parser_;
    std::array<char, 16384> chunk_;
    SseParser sse_;
    Clock::time_point run_start_;
    Clock::time_point sent_;
    Clock::time_point last_text_;
    std::function<void(RequestOutcome)> done_;
    RequestOutcome outcome_;
    std::string error_;
    std::string error_body_;
    int64_t text_chunks_ = 0;
    int64_t usage_tokens_ = -1;
    bool done_seen_ = false;
};

// One blocking exchange on its own io_context: `request` empty means connect (and shake hands)
// only. The answer's body, or one line saying what failed.
template <class Stream>
Result<std::string> Exchange(const BaseUrl& url, http::request<http::string_body>* request,
                             double timeout_s) {
    const std::string where = request ? std::string(request->method_string()) + " " + UrlText(url) +
                                            std::string(request->target().substr(url.prefix.size()))
                                      : UrlText(url);
    net::io_context io;
    tcp::resolver resolver(io);
    Stream stream = MakeStream<Stream>(io, url);
    beast::flat_buffer buffer;
    http::response<http::string_body> res;
    std::string error;
    bool finished = false;
    auto fail = [&](std::string why) {
        error = std::move(why);
        finished = true;
    };
    AsyncOpen(resolver, stream, url, timeout_s, [&](const std::string& open_error) {
        if (!open_error.empty()) return fail(open_error);
        if (!request) {
            finished = true;
            return;
        }
        http::async_write(stream, *request, [&](beast::error_code ec, size_t) {
            if (ec) return fail(where + ": write: " + ec.message());
            http::async_read(stream, buffer, res, [&](beast::error_code ec, size_t) {
                if (ec) return fail(where + ": read: " + ec.message());
                finished = true;
            });
        });
    });
    io.run_for(Seconds(timeout_s));
    if (!finished) return Status(StatusCode::kUnavailable, where + ": timed out");
    if (!error.empty()) return Status(StatusCode::kUnavailable, error);
    if (!request) return std::string();
    if (res.result() != http::status::ok) {
        return Status(StatusCode::kUnavailable, where + ": HTTP " +
                                                    std::to_string(res.result_int()) + ": " +
                                                    res.body().substr(0, 500));
    }
    return res.body();
}

Result<std::string> Exchange(const BaseUrl& url, http::request<http::string_body>* request,
                             double timeout_s) {
    if (!url.https) return Exchange<beast::tcp_stream>(url, request, timeout_s);
    if (!url.tls) return InvalidArgument(UrlText(url) + ": https without a TLS context");
    return Exchange<TlsStream>(url, request, timeout_s);
}

http::request<http::string_body> MakeRequest(http::verb verb, const BaseUrl& url,
                                             const std::string& path, const std::string& api_key) {
    http::request<http::string_body> req{verb, url.prefix + path, 11};
    req.set(http::field::host, url.host);
    if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
    req.keep_alive(false);
    return req;
}

}  // namespace

void StartStreamingRequest(net::io_context& io, const HttpTarget& target,
                           Clock::time_point run_start, std::function<void(RequestOutcome)> done) {
    if (!target.url.https) {
        std::make_shared<StreamingRequest<beast::tcp_stream>>(io, target, run_start,
                                                              std::move(done))
            ->Run();
    } else if (!target.url.tls) {
        RequestOutcome outcome;
        outcome.error = UrlText(target.url) + ": https without a TLS context";
        done(std::move(outcome));
    } else {
        std::make_shared<StreamingRequest<TlsStream>>(io, target, run_start, std::move(done))
            ->Run();
    }
}

Result<std::string> HttpGet(const BaseUrl& url, const std::string& path, const std::string& api_key,
                            double timeout_s) {
    auto req = MakeRequest(http::verb::get, url, path, api_key);
    return Exchange(url, &req, timeout_s);
}

Result<std::string> HttpPost(const BaseUrl& url, const std::string& path, const std::string& body,
                             const std::string& api_key, double timeout_s) {
    auto req = MakeRequest(http::verb::post, url, path, api_key);
    req.set(http::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    return Exchange(url, &req, timeout_s);
}

Status CheckConnection(const BaseUrl& url, double timeout_s) {
    if (!url.https) return Status::Ok();
    return Exchange(url, nullptr, timeout_s).status();
}

}  // namespace kvshard::loadgen
